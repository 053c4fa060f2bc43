"""regenerate: the target's own continuations, resumable, data-parallel under accelerate launch."""

from __future__ import annotations

import json

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


def test_response_column_writes_the_corpus_text_in_the_same_format(tmp_path):
    import datasets

    model, tok = tiny_model("llama"), word_tokenizer()
    data = datasets.Dataset.from_dict({"prompt": PROMPTS[:4], "continuation": ["t7 t8 t9 t10 t11"] * 4})
    ds = regenerate(model, tok, data, tmp_path, max_new_tokens=3, batch_size=3, response_column="continuation",
                    progress=False)
    assert ds["prompt_id"] == [0, 1, 2, 3]
    for row in ds:  # the text, cut at max_new_tokens; nothing generated
        assert row["response_ids"] == [7, 8, 9] and row["input_ids"] == row["prompt_ids"] + [7, 8, 9]
    with pytest.raises(ValueError, match="sampling settings do not apply"):
        regenerate(model, tok, data, tmp_path / "b", response_column="continuation", do_sample=True, progress=False)
    with pytest.raises(ValueError, match="no column 'text'"):
        regenerate(model, tok, data, tmp_path / "c", response_column="text", progress=False)
    with pytest.raises(ValueError, match="other settings"):  # a model-written collection is not mixed with text
        regenerate(model, tok, data, tmp_path, max_new_tokens=3, batch_size=3, progress=False)


def test_data_from_another_tokenizer_or_empty_shards_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import PreTrainedTokenizerFast

    from hf_paralleldecode.training.trajectories import load_trajectories

    model, tok = tiny_model("llama"), word_tokenizer()
    regenerate(model, tok, PROMPTS[:4], tmp_path / "r", max_new_tokens=4, progress=False)
    assert len(load_regenerated(tmp_path / "r", tokenizer=tok)) == 4
    from tokenizers import Tokenizer, models, pre_tokenizers

    other_model = Tokenizer(models.WordLevel({f"w{i}": i for i in range(5)}, unk_token="w3"))
    other_model.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=other_model, pad_token="w0", eos_token="w2")
    with pytest.raises(ValueError, match="another tokenizer"):
        load_regenerated(tmp_path / "r", tokenizer=other)
    # data without a fingerprint (written by hand) is still range-checked against the vocabulary
    (tmp_path / "r" / "collection_config.json").unlink()
    with pytest.raises(ValueError, match="token ids in"):  # the prompts use t5 and above
        load_regenerated(tmp_path / "r", tokenizer=other)
    empty = tmp_path / "e"
    empty.mkdir()
    with pytest.raises(ValueError, match="No regenerated shards"):
        load_regenerated(empty)
    schema = pa.schema([("prompt_id", pa.int64()), ("input_ids", pa.list_(pa.int64()))])
    pq.write_table(pa.Table.from_pylist([], schema=schema), empty / "shard-00000000.parquet")
    with pytest.raises(ValueError, match="holds no rows"):
        load_regenerated(empty)
    (empty / "shard-00000000.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="Could not read"):
        load_trajectories(empty)


def test_resume_matches_prompts_by_content_and_appending_extends_the_collection(tmp_path):
    model, tok = tiny_model("llama"), word_tokenizer()
    kw = dict(max_new_tokens=6, batch_size=4, progress=False)
    first = regenerate(model, tok, PROMPTS[:8], tmp_path, **kw)
    shards = sorted(tmp_path.glob("shard-*.parquet"))
    grown = regenerate(model, tok, PROMPTS, tmp_path, **kw)  # 4 prompts appended: only they are generated
    assert grown["prompt_id"] == list(range(12)) and grown["response_ids"][:8] == first["response_ids"]
    assert set(shards) < set(tmp_path.glob("shard-*.parquet"))
    assert json.loads((tmp_path / "collection_config.json").read_text())["num_prompts"] == 12
    for changed in (PROMPTS[::-1], [*PROMPTS[:3], "t9 t9", *PROMPTS[4:]], PROMPTS[:5]):  # reordered, edited, shortened
        with pytest.raises(ValueError, match=r"prompt_id .*reordered, edited or shortened"):
            regenerate(model, tok, changed, tmp_path, **kw)
