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


@pytest.mark.parametrize("name, drafter_target", [("default", "stdlib-coder-8m"),
                                                   ("default-trained", "stdlib-coder-8m-jacobi-forcing")])
def test_embedded_models_load_with_their_drafter_and_decoding_config_and_are_lossless(name, drafter_target):
    """Both embedded checkpoints default to their fastest measured strategy (issue 11): DEER speculative decoding
    with a drafter aligned to that model (the base model names the shipped alias, the Jacobi Forcing model bundles
    its own in drafter/), composed with context n-grams."""
    from hf_paralleldecode import DiffusionDrafter
    from hf_paralleldecode.integration import attached_drafter

    model, tokenizer = hfpd.load_default_model(name)
    config = model.parallel_decoding_config
    assert config.decoding == "speculative" and config.settings["context_matches"] == 2
    drafter = attached_drafter(model)
    assert isinstance(drafter, DiffusionDrafter) and drafter.config.target_name_or_path == drafter_target
    prompts = load_prompts(hfpd.default_model_path().parent / "prompts" / "stdlib_test.jsonl")[:3]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    # its saved decoding, its configured tree every step (adaptive=False: the tree's TPF, not the batch policy's)
    out = model.generate(**batch, max_new_tokens=48, return_dict_in_generate=True, adaptive=False)
    assert out.decoding == "speculative" and out.stats["tree_depth"] == config.settings["tree_depth"]
    assert torch.equal(out.sequences, model.generate(**batch, max_new_tokens=48, do_sample=False, decoding="stock"))
    assert out.tokens_per_forward > 2.5 and out.stats["tau"] > 2.5


def test_trained_embedded_model_is_faster_with_jacobi_forcing_than_the_base_model():
    """The consistency training itself (docs/training.md): its Jacobi Forcing TPF on held-out prompts."""
    model, tokenizer = hfpd.load_default_model("default-trained")
    assert model.parallel_decoding_config.base_model_name_or_path == "stdlib-coder-8m"
    report = json.loads((hfpd.default_model_path("default-trained") / "training_report.json").read_text())
    assert report["tpf_held_out"]["jacobi_forcing_n16_K2_pool4"]["trained"] > 2.0
    prompts = load_prompts(hfpd.default_model_path().parent / "prompts" / "stdlib_test.jsonl")[:3]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=48, return_dict_in_generate=True, decoding="jacobi_forcing",
                         block_size=16, num_blocks=2, pool_size=0, context_matches=2, context_tokens=6,
                         adaptive=False)  # the TPF of this tree every step, not of the shapes the batch policy picks
    assert torch.equal(out.sequences, model.generate(**batch, max_new_tokens=48, do_sample=False, decoding="stock"))
    assert out.tokens_per_forward > 1.5  # consistency-trained: well above the base model's ~1.3


def test_demo_command_shows_base_and_trained_model(capsys):
    from hf_paralleldecode.cli import main

    assert main(["demo", "--num-prompts", "1", "--max-new-tokens", "16", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "stdlib-coder-8m (embedded)" in out and "stdlib-coder-8m-jacobi-forcing (embedded)" in out
    assert "before -> after training" in out
    assert "identical to the model's own AR greedy output for every strategy: yes" in out
    with pytest.raises(ValueError, match="Unknown embedded model"):
        hfpd.default_model_path("default-nope")


@pytest.mark.parametrize("alias, kind", [("default-jetspec", "tree_causal"), ("default-dflash", "block_bidirectional")])
def test_shipped_draft_heads_load_by_alias_and_decode_the_embedded_model_losslessly(alias, kind):
    from hf_paralleldecode import DraftHead

    model, tokenizer = hfpd.load_default_model()
    head = DraftHead.from_pretrained(alias)
    assert head.config.attention == kind and head.config.target_name_or_path == "stdlib-coder-8m"
    tokenizer.padding_side = "left"
    enc = tokenizer(["def parse_args(argv):\n    ", "class Config:\n    def __init__(self"], return_tensors="pt",
                    padding=True)
    kwargs = dict(**enc, max_new_tokens=48, do_sample=False)
    ref = model.generate(**kwargs, decoding="stock")
    out = model.generate(**kwargs, decoding="speculative", drafter=head, tree_budget=8, adaptive=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats["mean_accepted_length"] > 1.5  # a trained head drafts tokens the model accepts


def test_shipped_eagle3_drafter_loads_by_alias_and_decodes_the_embedded_model_losslessly():
    model, tokenizer = hfpd.load_default_model()
    drafter = hfpd.load_drafter("default-eagle3")
    assert isinstance(drafter, hfpd.Eagle3Drafter) and drafter.config.target_name_or_path == "stdlib-coder-8m"
    tokenizer.padding_side = "left"
    enc = tokenizer(["def parse_args(argv):\n    ", "class Config:\n    def __init__(self"], return_tensors="pt",
                    padding=True)
    kwargs = dict(**enc, max_new_tokens=48, do_sample=False)
    ref = model.generate(**kwargs, decoding="stock")
    out = model.generate(**kwargs, decoding="speculative", drafter="default-eagle3", tree_budget=8,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.draft_stats.tau > 1.5  # a trained drafter drafts tokens the model accepts
