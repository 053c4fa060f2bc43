"""Trajectory collection: exact Jacobi states, dataset schema, resumability (SIGKILL included), bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from models import launch_two_processes, saved_model_and_prompts, tiny_model, word_tokenizer

from hf_paralleldecode.training.trajectories import collect_trajectories, load_trajectories

PROMPTS = ["t5 t6 t7", "t9 t10", "t11 t12 t13 t14", "t20 t21", "t30 t31 t32", "t40"]


def test_states_are_cache_free_jacobi_iterations_ending_in_greedy_fixed_points(tmp_path):
    model, tok = tiny_model("llama"), word_tokenizer()
    ds = collect_trajectories(model, tok, PROMPTS, tmp_path, block_size=4, max_new_tokens=12, batch_size=4,
                              progress=False)
    assert ds["prompt_id"] == list(range(len(PROMPTS)))
    for row in ds:
        prompt = torch.tensor(row["prompt_ids"])
        greedy = model.generate(input_ids=prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None)
        response = greedy[0, len(prompt):].tolist()
        assert row["response_ids"] == response[: len(row["response_ids"])]
        assert [t for block in row["fixed_points"] for t in block] == response[: 4 * len(row["fixed_points"])]
        # every complete block is recorded, the last one too (12 is a multiple of the block size)
        assert len(row["fixed_points"]) == len(row["response_ids"]) // 4
        prefix = row["prompt_ids"]
        for states, fixed in zip(row["trajectories"], row["fixed_points"]):
            assert states[-1] == fixed and all(len(s) == 4 for s in states)
            for cur, nxt in zip(states, states[1:]):  # each state is the full Jacobi update of the previous one
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([prefix + cur])).logits[0]
                update = logits[len(prefix) - 1 : len(prefix) + 3].argmax(-1).tolist()
                assert nxt == update
            prefix = prefix + fixed


def test_schema_filter_and_resume_in_process(tmp_path):
    model, tok = tiny_model("gpt2"), word_tokenizer()
    collect_trajectories(model, tok, PROMPTS[:3], tmp_path, block_size=3, max_new_tokens=9, batch_size=2,
                         max_repeat=2, progress=False)
    first = sorted(p.name for p in tmp_path.glob("shard-*.parquet"))
    ds = collect_trajectories(model, tok, PROMPTS[:3], tmp_path, block_size=3, max_new_tokens=9, batch_size=2,
                              max_repeat=2, progress=False)  # nothing left to do
    assert sorted(p.name for p in tmp_path.glob("shard-*.parquet")) == first
    assert set(ds.column_names) >= {"prompt_id", "prompt", "prompt_ids", "response_ids", "trajectories",
                                    "fixed_points", "degenerate"}
    kept = load_trajectories(tmp_path)
    assert len(kept) == sum(not d for d in ds["degenerate"])
    with pytest.raises(ValueError, match="other settings"):
        collect_trajectories(model, tok, PROMPTS[:3], tmp_path, block_size=4, max_new_tokens=9, progress=False)


@pytest.mark.parametrize(
    "prompts, match",
    [([], "empty"), (["ok", ""], "non-empty strings")],
)
def test_bad_prompts(tmp_path, prompts, match):
    with pytest.raises(ValueError, match=match):
        collect_trajectories(tiny_model("llama"), word_tokenizer(), prompts, tmp_path, progress=False)
    assert not list(tmp_path.glob("shard-*"))


def test_bad_prompt_files(tmp_path):
    model, tok = tiny_model("llama"), word_tokenizer()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "t5"}\n{not json\n')
    with pytest.raises(ValueError, match="Could not read prompts"):
        collect_trajectories(model, tok, bad, tmp_path / "o1", progress=False)
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "t5"}\n')
    with pytest.raises(ValueError, match="no column 'prompt'"):
        collect_trajectories(model, tok, other, tmp_path / "o2", progress=False)
    with pytest.raises(ValueError, match="block_size"):
        collect_trajectories(model, tok, PROMPTS, tmp_path / "o3", block_size=1, progress=False)


@pytest.mark.slow
def test_sigkill_then_rerun_collects_every_prompt_exactly_once(tmp_path):
    saved_model_and_prompts(tmp_path, [f"t{5 + i % 80} t{6 + i % 80}" for i in range(40)])
    prompts = tmp_path / "prompts.jsonl"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_paralleldecode.cli", "collect", "--model", str(tmp_path / "model"),
           "--prompts", str(prompts), "--output-dir", str(out), "--block-size", "4", "--max-new-tokens", "24",
           "--batch-size", "2", "--threads", "1"]
    env = dict(os.environ, TQDM_DISABLE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("shard-*.parquet"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(list(out.glob("shard-*.parquet")))
    assert 0 < partial < 20, "the kill should land mid-collection"
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ds = load_trajectories(out, drop_degenerate=False)
    assert sorted(ds["prompt_id"]) == list(range(40))  # every prompt exactly once
    assert not list(out.glob("*.tmp"))


def test_block_ending_in_eos_is_recorded(tmp_path):
    model, tok = tiny_model("llama"), word_tokenizer()
    prompt = tok(PROMPTS[0])["input_ids"]
    greedy = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            eos_token_id=None)[0, len(prompt):].tolist()
    end = next(k for k in (7, 11) if greedy[k] not in greedy[:k])  # a token first seen at a block's end
    model.generation_config.eos_token_id = greedy[end]
    ds = collect_trajectories(model, tok, PROMPTS[:1], tmp_path, block_size=4, max_new_tokens=12, progress=False)
    assert ds[0]["response_ids"] == greedy[: end + 1]
    assert [t for b in ds[0]["fixed_points"] for t in b] == greedy[: end + 1]


@pytest.mark.slow
def test_collect_runs_data_parallel_under_accelerate_launch(tmp_path):
    saved_model_and_prompts(tmp_path, [f"t{5 + i} t{7 + i}" for i in range(10)])
    prompts = tmp_path / "prompts.jsonl"
    out = tmp_path / "out"
    launch_two_processes(["collect", "--model", str(tmp_path / "model"), "--prompts", str(prompts), "--output-dir",
                          str(out), "--block-size", "4", "--max-new-tokens", "12", "--batch-size", "2", "--threads", "1"])
    ds = load_trajectories(out, drop_degenerate=False)
    assert sorted(ds["prompt_id"]) == list(range(10))
    assert {int(p.stem.split("-")[1]) % 2 for p in out.glob("shard-*.parquet")} == {0, 1}


@pytest.mark.parametrize("what", ["collect", "regenerate"])
def test_a_checkpoints_generation_config_does_not_leak_into_the_data(what, tmp_path):
    """Qwen2.5 ships repetition_penalty=1.05 and do_sample=True: the data must still be plain greedy."""
    from transformers import GenerationConfig

    from hf_paralleldecode.training.regenerate import regenerate

    model = tiny_model("llama")
    tok = word_tokenizer()
    prompts = [f"t{5 + i} t{6 + i} t{7 + i} t{5 + i}" for i in range(4)]
    plain = GenerationConfig(eos_token_id=model.generation_config.eos_token_id,
                             pad_token_id=model.generation_config.pad_token_id, do_sample=False)
    refs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        refs.append(model.generate(input_ids=ids, max_new_tokens=12, generation_config=plain)[0, ids.shape[1]:].tolist())
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.7
    if what == "collect":
        ds = collect_trajectories(model, tok, prompts, tmp_path, block_size=4, max_new_tokens=12, progress=False)
    else:
        ds = regenerate(model, tok, prompts, tmp_path, max_new_tokens=12, progress=False)
    eos = model.generation_config.eos_token_id
    for row, ref in zip(ds, refs):
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert row["response_ids"] == ref
    cfg = json.loads((tmp_path / "collection_config.json").read_text())
    assert cfg["ignored_generation_config"] == {"do_sample": True, "no_repeat_ngram_size": 2, "repetition_penalty": 3.0,
                                                "temperature": 0.7}
