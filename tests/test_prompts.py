"""Issue class: one prompt reader, one set of messages, for every command; the CLI says only what it did."""

from __future__ import annotations

import json

import pytest

from hf_paralleldecode import cli
from hf_paralleldecode.prompts import read_prompts

PROMPTS = ["def f(x):\n    return", "import os\n"]


def _write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


@pytest.mark.parametrize("name, content", [
    ("p.jsonl", "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)),
    ("p.jsonl", "".join(json.dumps(p) + "\n" for p in PROMPTS)),
    ("p.json", json.dumps(PROMPTS)),
    ("p.json", json.dumps([{"prompt": p} for p in PROMPTS])),
    ("p.txt", "\n\n".join(PROMPTS)),
])
def test_every_format_reads_the_same_prompts(tmp_path, name, content):
    expected = PROMPTS if name != "p.txt" else [p for p in "\n\n".join(PROMPTS).split("\n\n")]
    assert read_prompts(_write(tmp_path, name, content)) == expected


def test_parquet_and_datasets_and_columns(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": PROMPTS})
    ds.to_parquet(str(tmp_path / "p.parquet"))
    assert read_prompts(tmp_path / "p.parquet", "text") == PROMPTS
    assert read_prompts(ds, "text") == PROMPTS
    with pytest.raises(ValueError, match=r"no column 'prompt' \(columns: \['text'\]\)"):
        read_prompts(tmp_path / "p.parquet")


@pytest.mark.parametrize("name, content, match", [
    ("missing.jsonl", None, "does not exist"),
    ("p.csv", "a,b\n", "Unsupported prompt file"),
    ("p.jsonl", "", "No prompts in .*empty"),
    ("p.json", "[]", "No prompts in .*empty"),
    ("p.jsonl", '{"text": "a"}\n', "no column 'prompt'.*--prompt-column"),
    ("p.json", '{"prompt": "a"}', "JSON list"),
    ("p.jsonl", "{not json\n", "Could not read prompts"),
    ("p.json", '["a", ""]', "rows \\[1\\]"),
    ("p.parquet", b"not parquet", "Could not read prompts"),
])
def test_bad_prompt_files_get_one_clear_message(tmp_path, name, content, match):
    path = tmp_path / name if content is None else _write(tmp_path, name, content)
    with pytest.raises(ValueError, match=match):
        read_prompts(path)


@pytest.mark.parametrize("command", ["bench", "collect", "regenerate"])
def test_commands_check_the_prompt_file_before_loading_a_model(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded before the prompts were checked"))
    path = _write(tmp_path, "p.jsonl", '{"text": "a"}\n')
    argv = [command, "--prompts", str(path)]
    if command != "bench":
        argv += ["--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and "no column 'prompt'" in capsys.readouterr().err


def test_the_cli_only_claims_files_it_wrote(tmp_path, capsys, monkeypatch):
    from hf_paralleldecode import bench

    monkeypatch.setattr(bench, "plot_report", lambda *a: False)  # as without matplotlib
    monkeypatch.setattr(bench, "plot_sweep", lambda *a: False)
    path = _write(tmp_path, "p.jsonl", json.dumps({"prompt": "def f(x):"}) + "\n")
    common = ["--model", "random-tiny", "--prompts", str(path), "--max-new-tokens", "3", "--repeats", "1"]
    assert cli.main(["bench", "--no-baselines", *common, "--strategies", "jacobi:block_size=2", "--output-dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "bench.json" in out and "bench.png" not in out
    assert cli.main(["sweep", *common, "--decoding", "jacobi", "--grid", "block_size=2,3", "--output-dir",
                     str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "sweep.png" not in out and not (tmp_path / "s" / "sweep.png").exists()


def test_long_labels_keep_the_table_aligned():
    from hf_paralleldecode.bench import format_report

    row = dict(tpf=2.0, tokens_per_second=10.0, decode_tokens_per_second=10.0, speedup_vs_ar=1.0,
               exact_match_vs_ar=1.0, loop_overhead=0.1)
    label = "speculative(drafter=some/long/path/to/a/head,tree_budget=256,tree_width=8)"
    lines = format_report({"results": {"ar": row, label: row}}).splitlines()
    assert len({len(line) for line in lines}) == 1  # every line as wide as the header
