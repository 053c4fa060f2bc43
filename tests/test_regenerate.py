"""regenerate: the target's own continuations, resumable, data-parallel under accelerate launch."""

from __future__ import annotations

import pytest
import torch
from models import launch_two_processes, saved_model_and_prompts, tiny_model, word_tokenizer

from hf_paralleldecode.training.regenerate import load_regenerated, regenerate

PROMPTS = [f"t{5 + i % 80} t{6 + i % 80} t{9 + i % 70}" for i in range(12)]


def test_greedy_continuations_match_generate_and_resume(tmp_path):
    model, tok = tiny_model("llama"), word_tokenizer()
    ds = regenerate(model, tok, PROMPTS, tmp_path, max_new_tokens=10, batch_size=5, progress=False)
    assert ds["prompt_id"] == list(range(12))
    for row in ds:
        ids = torch.tensor([row["prompt_ids"]])
        ref = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist()
        eos = model.generation_config.eos_token_id
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert row["response_ids"] == ref and row["input_ids"] == row["prompt_ids"] + ref
    # a lost shard is redone on rerun; every prompt ends in exactly one shard
    shards = sorted(tmp_path.glob("shard-*.parquet"))
    shards[1].unlink()
    again = regenerate(model, tok, PROMPTS, tmp_path, max_new_tokens=10, batch_size=5, progress=False)
    assert again["prompt_id"] == list(range(12)) and again["response_ids"] == ds["response_ids"]
    with pytest.raises(ValueError, match="other settings"):
        regenerate(model, tok, PROMPTS, tmp_path, max_new_tokens=11, progress=False)


def test_sampling_is_reproducible_and_settings_are_checked(tmp_path):
    model, tok = tiny_model("llama"), word_tokenizer()
    kw = dict(max_new_tokens=8, batch_size=3, do_sample=True, temperature=1.5, progress=False)
    a = regenerate(model, tok, PROMPTS, tmp_path / "a", **kw)
    b = regenerate(model, tok, PROMPTS, tmp_path / "b", **kw)
    assert a["response_ids"] == b["response_ids"]
    sorted((tmp_path / "b").glob("shard-*.parquet"))[2].unlink()
    assert regenerate(model, tok, PROMPTS, tmp_path / "b", **kw)["response_ids"] == a["response_ids"]
    greedy = regenerate(model, tok, PROMPTS, tmp_path / "g", max_new_tokens=8, progress=False)
    assert greedy["response_ids"] != a["response_ids"]  # sampling really sampled
    with pytest.raises(ValueError, match="do_sample=True"):
        regenerate(model, tok, PROMPTS, tmp_path / "c", temperature=0.7, progress=False)


@pytest.mark.slow
def test_two_processes_share_the_prompts_and_resume_exactly(tmp_path):
    model_dir, prompts = saved_model_and_prompts(tmp_path, PROMPTS)
    out = tmp_path / "out"
    def launch():
        launch_two_processes(["regenerate", "--model", str(model_dir), "--prompts", str(prompts),
                              "--output-dir", str(out), "--max-new-tokens", "8", "--batch-size", "2", "--threads", "1"])

    launch()
    ds = load_regenerated(out)
    assert ds["prompt_id"] == list(range(12))
    firsts = sorted(int(p.stem.split("-")[1]) for p in out.glob("shard-*.parquet"))
    assert {f % 2 for f in firsts} == {0, 1}  # both processes wrote shards
    single = regenerate(tiny_model("llama"), word_tokenizer(), PROMPTS, tmp_path / "single", max_new_tokens=8,
                        progress=False)
    assert ds["response_ids"] == single["response_ids"]
    for p in sorted(out.glob("shard-*.parquet"))[::2]:
        p.unlink()  # as if both processes had been killed mid-run
    launch()
    ds = load_regenerated(out)
    assert ds["prompt_id"] == list(range(12)) and ds["response_ids"] == single["response_ids"]
