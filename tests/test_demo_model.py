"""The embedded demo model ships with the package, loads offline and decodes losslessly."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

import hf_paralleldecode as hfpd
from hf_paralleldecode.bench import load_prompts

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes" / "demo_model"))


@functools.lru_cache(maxsize=1)
def demo():
    return hfpd.load_default_model()


def test_demo_model_files_and_training_report():
    path = hfpd.default_model_path()
    assert (path / "model.safetensors").is_file()
    assert not list(path.glob("*.bin")) and not list(path.glob("*.pt"))
    assert (path / "model.safetensors").stat().st_size < 40 * 2**20
    report = json.loads((path / "training_report.json").read_text())
    # random weights score ln(8192) = 9.0; the shipped model measured 4.44 (see docs/demo-model.md)
    assert report["held_out_loss"] < 5.0, "the shipped model should be trained, not random"
    assert "train_demo_model.py" in report["command"]


def test_demo_model_is_a_standard_architecture_that_writes_code():
    model, tokenizer = demo()
    assert type(model).__name__ == "LlamaForCausalLM"
    enc = tokenizer("import os\nimport sys\n\n\ndef main():\n    ", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert len(set(new)) >= 6, "greedy output degenerates into one repeated token"


@pytest.mark.parametrize("block_size", [4, 16, 64])
def test_jacobi_on_demo_model_equals_greedy_over_shipped_prompts(block_size):
    model, tokenizer = demo()
    tokenizer.padding_side = "left"
    prompts = [p for p in load_prompts(hfpd.default_model_path().parent / "prompts" / "stdlib_test.jsonl")][:6]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(**batch, max_new_tokens=48, do_sample=False)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="jacobi", block_size=block_size, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.tokens_per_forward >= 1.0


def test_shipped_tokenizer_loader_reproduces_the_training_tokenization():
    """AutoTokenizer swaps in Qwen2Tokenizer for qwen2 checkpoints (it pre-tokenizes differently); the
    library's loader must give the ids of the byte-level BPE the model was trained with."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = hfpd.default_model_path()
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "    def __init__(self, x):\n        return  x + 1\n\tcaf\u00e9 = {'a': [1, 2]}  # \u00fc\n"
    for tok in (hfpd.load_tokenizer(path), AutoTokenizer.from_pretrained(path)):
        assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok(text)["input_ids"]) == text


def test_llama_export_of_the_trained_qwen2_layout_is_exact():
    """The demo model was trained as Qwen2 and exported in Llama layout (q/k/v biases, zero o_proj bias), so
    that ``AutoTokenizer`` keeps its tokenizer; the conversion must not change a single logit."""
    from train_demo_model import to_llama_layout
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    llama = to_llama_layout(qwen).eval()
    assert type(llama).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(qwen(input_ids=ids).logits, llama(input_ids=ids).logits)
