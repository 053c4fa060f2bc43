"""collect / regenerate in the format the model sees: conversations and chat templates, recorded in the config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from models import tiny_model, word_tokenizer

from hf_paralleldecode.prompts import chat_prompts, read_prompts
from hf_paralleldecode.training.regenerate import regenerate
from hf_paralleldecode.training.trajectories import collect_trajectories

# a word-level chat template over the tiny vocabulary: t4 opens a turn, the role word follows, t5 closes it
TEMPLATE = ("{% for m in messages %}t4 {{ 't6' if m['role'] == 'user' else 't7' }} {{ m['content'] }} t5 "
            "{% endfor %}{% if add_generation_prompt %}t4 t7 {% endif %}")


def chat_tokenizer():
    tok = word_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


CONVERSATIONS = [[{"role": "user", "content": f"t{10 + i} t{11 + i}"}] for i in range(5)] + [
    [{"role": "user", "content": "t30 t31"}, {"role": "assistant", "content": "t32"},
     {"role": "user", "content": "t33"}]]


def test_conversations_are_templated_with_the_generation_prompt(tmp_path):
    model, tok = tiny_model("llama"), chat_tokenizer()
    ds = regenerate(model, tok, CONVERSATIONS, tmp_path, max_new_tokens=6, batch_size=4, progress=False)
    config = json.loads((tmp_path / "collection_config.json").read_text())
    assert config["prompt_format"] == "chat_template"
    want = tok.apply_chat_template(CONVERSATIONS[5], tokenize=False, add_generation_prompt=True)
    row = ds[5]
    assert row["prompt"] == want and want.endswith("t4 t7 ")
    assert row["prompt_ids"] == tok(want, add_special_tokens=False)["input_ids"]  # no second set of special tokens
    ref = model.generate(input_ids=torch.tensor([row["prompt_ids"]]), max_new_tokens=6, do_sample=False)
    assert row["response_ids"] == ref[0, len(row["prompt_ids"]):].tolist()[: len(row["response_ids"])]


def test_plain_prompts_stay_raw_with_a_warning_naming_the_flag_or_are_templated_on_request(tmp_path):
    model, tok = tiny_model("llama"), chat_tokenizer()
    prompts = ["t10 t11", "t12 t13"]
    with pytest.warns(UserWarning, match="chat_template=True .--chat-template."):
        raw = regenerate(model, tok, prompts, tmp_path / "raw", max_new_tokens=4, progress=False)
    assert raw[0]["prompt"] == "t10 t11"
    assert json.loads((tmp_path / "raw" / "collection_config.json").read_text())["prompt_format"] == "raw"
    chat = collect_trajectories(model, tok, prompts, tmp_path / "chat", block_size=4, max_new_tokens=8,
                                progress=False, chat_template=True)
    assert chat[0]["prompt"] == "t4 t6 t10 t11 t5 t4 t7 "  # a plain prompt becomes one user message
    assert json.loads((tmp_path / "chat" / "collection_config.json").read_text())["prompt_format"] == "chat_template"


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="need a chat template"):
        chat_prompts(word_tokenizer(), CONVERSATIONS)  # no template
    with pytest.raises(ValueError, match="no-chat-template"):
        chat_prompts(chat_tokenizer(), CONVERSATIONS, chat_template=False)
    with pytest.raises(ValueError, match="conversations"):
        read_prompts([[{"role": "user"}]], conversations=True)  # a message without content
    with pytest.raises(ValueError, match="non-empty strings;"):
        read_prompts(CONVERSATIONS)  # commands that take only text


def test_cli_reads_a_jsonl_of_message_lists_and_a_messages_column(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                 eos_token_id=2)).save_pretrained(tmp_path / "m")
    chat_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "lists.jsonl").write_text("\n".join(json.dumps(c) for c in CONVERSATIONS[:3]) + "\n")
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in CONVERSATIONS[:3]) + "\n")
    for name, extra in (("lists.jsonl", []), ("rows.jsonl", ["--prompt-column", "messages"])):
        out = tmp_path / f"out-{name}"
        subprocess.run([sys.executable, "-m", "hf_paralleldecode.cli", "regenerate", "--model", str(tmp_path / "m"),
                        "--prompts", str(tmp_path / name), "--output-dir", str(out), "--max-new-tokens", "3",
                        *extra], check=True, capture_output=True)
        assert json.loads((out / "collection_config.json").read_text())["prompt_format"] == "chat_template"


def test_bench_takes_conversations_and_the_chat_option_as_collect_does(tmp_path, monkeypatch, capsys):
    from hf_paralleldecode import cli
    from hf_paralleldecode.bench import StrategySpec, run_benchmark

    model, tok = tiny_model("llama"), chat_tokenizer()
    report = run_benchmark(model, tok, CONVERSATIONS[:2], [StrategySpec("jacobi", {"block_size": 4})],
                           max_new_tokens=4, repeats=1, progress=False)
    assert report["prompt_format"] == "chat_template"
    assert report["results"]["jacobi(block_size=4)"]["exact_match_vs_ar"] == 1.0
    with pytest.warns(UserWarning, match="--chat-template"):
        raw = run_benchmark(model, tok, ["t10 t11"], [], max_new_tokens=4, repeats=1, progress=False)
    assert raw["prompt_format"] == "raw"
    templated = run_benchmark(model, tok, ["t10 t11"], [], max_new_tokens=4, repeats=1, progress=False,
                              chat_template=True)
    assert templated["prompt_format"] == "chat_template"
    # the command line reads conversation files and refuses them with --no-chat-template, before loading a model
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": c}) for c in CONVERSATIONS) + "\n")
    monkeypatch.setattr(cli, "_load", lambda args: (model, tok, "tiny"))
    assert cli.main(["bench", "--no-baselines", "--prompts", str(path), "--strategies", "jacobi:block_size=4", "--repeats", "1",
                     "--max-new-tokens", "4", "--output-dir", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["prompt_format"] == "chat_template"
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the prompts are checked before a model loads"))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--prompts", str(path), "--no-chat-template", "--repeats", "1", "--max-new-tokens", "4"])
    assert "conversations" in capsys.readouterr().err
