"""The benchmark command and the CLI (on a tiny random model; the demo model in test_demo_model)."""

from __future__ import annotations

import json

import pytest
import torch
from models import tiny_model, word_tokenizer

from hf_paralleldecode import cli
from hf_paralleldecode.bench import format_report, parse_strategy, run_benchmark


def test_parse_strategy():
    spec = parse_strategy("jacobi:block_size=16,jacobi_init=repeat")
    assert spec.decoding == "jacobi" and spec.settings == {"block_size": 16, "jacobi_init": "repeat"}
    assert spec.label == "jacobi(block_size=16,jacobi_init=repeat)"
    with pytest.raises(ValueError, match="Available decodings"):
        parse_strategy("nope:block_size=2")
    assert parse_strategy("transformers_prompt_lookup").decoding == "transformers_prompt_lookup"  # the peer
    assert parse_strategy("prompt_lookup").decoding == "prompt_lookup"  # this library's strategy
    with pytest.raises(ValueError, match="key=value"):
        parse_strategy("jacobi:block_size")
    with pytest.raises(ValueError, match=r"Unknown setting\(s\) \['bogus'\] of strategy 'jacobi'.*Its settings: .*block_size"):
        parse_strategy("jacobi:bogus=1")
    with pytest.raises(ValueError, match=r"'block_sise'.*did you mean 'block_size'"):
        parse_strategy("jacobi:block_sise=4")


def test_each_bench_entry_learns_only_from_its_own_calls():
    """Two entries with one policy key (the default and ``max_step_tokens=1``) each run in their own memory scope:
    shared, the capped entry's plain steps kept the default's plain-step times fresh, which a process running the
    default alone does not have. Nothing reaches the model's own memory."""
    from hf_paralleldecode.decoding.policy import memory_of

    model = tiny_model("llama")
    specs = [parse_strategy("prompt_lookup"), parse_strategy("prompt_lookup:max_step_tokens=1")]
    run_benchmark(model, word_tokenizer(), ["t5 t6 t7 t5 t6 t7 t5", "t9 t10 t9 t10 t9"], specs, max_new_tokens=10,
                  repeats=1, batch_size=2, progress=False)
    assert not memory_of(model).policy
    scopes = memory_of(model).scopes
    default, capped = (scopes[s.label].policy for s in specs)
    assert default.keys() == capped.keys() and len(default) == 1  # one key: they would have shared it
    (own,), (plain,) = default.values(), capped.values()
    assert 0 in {i for _, i in own["times"]}  # the default ran its configured tree
    assert len({i for _, i in plain["times"]}) == 1 and 0 not in {i for _, i in plain["times"]}  # plain steps only


def test_trace_steps_keeps_every_step_of_every_call_of_the_policy_entries_only():
    """``trace_steps=True``: each entry that runs the batch policy reports, per repeat and per prompt batch, the call's
    ``step_trace``; stock and a fixed shape (``adaptive=False``) have none; without it no entry has one."""
    model = tiny_model("llama")
    prompts = ["t5 t6 t7 t5 t6 t7 t5", "t9 t10 t9 t10 t9", "t4 t5 t4 t5 t4 t5"]
    specs = [parse_strategy("prompt_lookup"), parse_strategy("prompt_lookup:adaptive=false")]
    report = run_benchmark(model, word_tokenizer(), prompts, specs, max_new_tokens=10, repeats=2, batch_size=2,
                           progress=False, trace_steps=True)
    results = report["results"]
    assert "step_traces" not in results["ar"] and "step_traces" not in results[specs[1].label]
    traces = results[specs[0].label]["step_traces"]
    assert len(traces) == 2 and all(len(per_repeat) == 2 for per_repeat in traces)  # 2 repeats x 2 prompt batches
    rows = {}
    for per_repeat in traces:
        for trace in per_repeat:
            assert trace and all(1 <= r <= 2 and c >= r and s > 0 and setup in (None, "first", "lag")
                                 for _, r, c, s, setup in trace)
            for shape, r, *_ in trace:
                rows[shape] = rows.get(shape, 0) + r
    assert rows == results[specs[0].label]["shape_row_steps"]  # the same steps the row-step counts sum
    json.dumps(report)
    plain = run_benchmark(model, word_tokenizer(), prompts[:2], specs[:1], max_new_tokens=4, repeats=1,
                          batch_size=2, progress=False)
    assert "step_traces" not in plain["results"][specs[0].label]
    with pytest.raises(ValueError, match="trace_steps takes True or False"):
        run_benchmark(None, None, ["t5"], [], trace_steps="yes")


def test_sdpa_backends_restrict_attention_for_every_entry_stock_included_and_are_restored(monkeypatch):
    """``sdpa_backends`` holds for every run, stock generate's and the warm-up's included (so the entries stay
    comparable), the report records it, and torch's own choice is back afterwards."""
    import hf_paralleldecode.bench as bench

    seen = []
    one_run = bench._one_run

    def spy(model, enc, spec, *args, **kwargs):
        seen.append((spec is None, torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return one_run(model, enc, spec, *args, **kwargs)

    monkeypatch.setattr(bench, "_one_run", spy)
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
              torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    model = tiny_model("llama")
    report = run_benchmark(model, word_tokenizer(), ["t5 t6 t7 t5 t6 t7", "t9 t10 t9"], [parse_strategy("jacobi")],
                           max_new_tokens=6, repeats=1, batch_size=2, progress=False, sdpa_backends=["math"])
    assert report["sdpa_backends"] == ["math"] and report["cudnn"] is None
    assert report["results"]["jacobi"]["exact_match_vs_ar"] == 1.0
    assert len(seen) == 4 and {ar for ar, _, _ in seen} == {True, False}  # warm-up and timed, stock and jacobi
    assert all(not flash and math for _, flash, math in seen)
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before
    default = run_benchmark(model, word_tokenizer(), ["t5 t6"], [], max_new_tokens=2, repeats=1, progress=False)
    assert default["sdpa_backends"] is None


@pytest.mark.parametrize("bad", [[], ["flash", "triton"], "fast"])
def test_an_unknown_sdpa_backend_is_a_clear_error_before_anything_runs(bad, capsys):
    with pytest.raises(ValueError, match="sdpa_backends takes one or more of .*cudnn.*efficient.*flash.*math"):
        run_benchmark(None, None, ["t5"], [], sdpa_backends=bad)
    with pytest.raises(SystemExit) as exc:  # before the model loads
        cli.main(["bench", "--model", "random-tiny", "--sdpa-backends", "flash", "cudnnn", "--output-dir", ""])
    assert exc.value.code == 2 and "cudnnn" in capsys.readouterr().err


@pytest.mark.parametrize("batch_size", [1, 2])
def test_benchmark_reports_every_figure_and_writes_json_and_png(tmp_path, batch_size):
    model = tiny_model("llama")
    prompts = ["t5 t6 t7 t8", "t9 t10 t11", "t12 t13 t14 t15 t16"]
    specs = [parse_strategy("jacobi:block_size=4"), parse_strategy("jacobi:block_size=16")]
    if batch_size == 1:  # transformers' prompt lookup decoding is batch-1 only
        specs.append(parse_strategy("transformers_prompt_lookup:prompt_lookup_num_tokens=3"))
    report = run_benchmark(model, word_tokenizer(), prompts, specs, max_new_tokens=12, repeats=2,
                           batch_size=batch_size, output_dir=tmp_path, progress=False)
    assert {"ar", "jacobi(block_size=4)", "jacobi(block_size=16)"} <= set(report["results"])
    for r in report["results"].values():
        assert r["exact_match_vs_ar"] == 1.0
        assert r["tpf"] >= 0.99 or r["decoding"] == "ar"  # a row commits >= 1 token per forward it is in
        assert 0 <= r["loop_overhead"] < 1
        assert r["host_ms_per_step"] > 0
        assert r["tokens_per_second"] > 0 and r["decode_tokens_per_second"] > 0
        assert len(r["speedup_by_repeat"]) == 2  # each repeat's ratio, in order; the median is the headline
        assert r["speedup_vs_ar"] == pytest.approx(sorted(r["speedup_by_repeat"])[0] / 2
                                                   + sorted(r["speedup_by_repeat"])[1] / 2, rel=1e-3)
    assert abs(report["results"]["ar"]["tpf"] - 1.0) < 1e-9 or batch_size > 1
    assert json.loads((tmp_path / "bench.json").read_text())["repeats"] == 2
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert "jacobi(block_size=16)" in format_report(report) and "host ms/step" in format_report(report)
    assert "tail" in format_report(report).splitlines()[0]
    for lab, r in report["results"].items():
        if r["sequential_rows"]:  # a batch-1 peer run row by row: no tail to speak of
            assert r["tail_time_share"] is None
        elif lab == "ar":  # stock keeps every row to the end
            assert r["tail_time_share"] == 0.0
        else:
            assert 0.0 <= r["tail_time_share"] <= 1.0


def test_the_tail_is_the_decoding_forwards_time_with_fewer_rows_than_the_batch():
    """The bench's ``tail_time_share``: forwards after the prompt's that fed fewer rows than the call's batch (rows
    that finished early while the batch waits for its slowest), over all the decoding forwards' time."""
    from hf_paralleldecode.bench import _ForwardTimer

    model = tiny_model("llama")
    timer = _ForwardTimer(model)
    try:
        with torch.no_grad():
            for rows, width in ((3, 6), (3, 1), (3, 2), (1, 2), (2, 1)):  # the prompt, then the decoding forwards
                model(input_ids=torch.full((rows, width), 5))
            model(torch.full((1, 1), 5))  # a positional input is counted as well
    finally:
        timer.remove()
    assert [rows for rows, _ in timer.calls] == [3, 3, 3, 1, 2, 1]
    tail, total = timer.tail(3)
    seconds = [s for _, s in timer.calls]
    assert total == pytest.approx(sum(seconds[1:])) and tail == pytest.approx(seconds[3] + seconds[4] + seconds[5])
    assert timer.tail(1) == (0.0, pytest.approx(sum(seconds[1:])))
    timer.reset()
    assert timer.calls == [] and timer.tail(3) == (0.0, 0.0)


def test_cost_aware_entries_report_the_nodes_their_budget_fed():
    model = tiny_model("llama")
    prompts = ["t5 t6 t7 t5 t6 t7 t5 t6", "t9 t10 t9 t10 t9"]
    specs = [parse_strategy("prompt_lookup:cost_aware=true"), parse_strategy("prompt_lookup")]
    report = run_benchmark(model, word_tokenizer(), prompts, specs, max_new_tokens=10, repeats=1, progress=False)
    budgeted = report["results"]["prompt_lookup(cost_aware=True)"]
    assert budgeted["exact_match_vs_ar"] == 1.0 and budgeted["budget_optional_nodes_per_step"] >= 0
    assert "budget_optional_nodes_per_step" not in report["results"]["prompt_lookup"]


def test_cli_env(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "transformers" in out and "jacobi" in out


def test_cli_bench_on_random_tiny_model(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n    return"}\n{"prompt": "import os\\n"}\n')
    code = cli.main(["bench", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", "8",
                     "--repeats", "1", "--strategies", "jacobi:block_size=4", "--output-dir", str(tmp_path / "o")])
    assert code == 0
    assert "jacobi(block_size=4)" in capsys.readouterr().out
    results = json.loads((tmp_path / "o" / "bench.json").read_text())["results"]
    # the baselines every table shows beside stock eager: its fast path (static cache, compiled) and prompt lookup
    assert list(results) == ["ar", "jacobi(block_size=4)", "transformers_fast_path", "transformers_prompt_lookup"]
    assert all(r["exact_match_vs_ar"] == 1.0 for r in results.values())


def test_cli_bench_baselines_are_added_unless_asked_not_to(monkeypatch, tmp_path):
    import hf_paralleldecode.bench as bench

    seen = []

    def fake(model, tokenizer, prompts, strategies, **kw):
        seen.append([s.decoding for s in strategies])
        return dict(results={}, files=[])

    monkeypatch.setattr(bench, "run_benchmark", fake)
    monkeypatch.setattr(bench, "format_report", lambda report: "")
    argv = ["bench", "--model", "random-tiny", "--max-new-tokens", "4", "--repeats", "1", "--num-prompts", "1",
            "--output-dir", str(tmp_path)]
    assert cli.main([*argv, "--strategies", "jacobi", "transformers_prompt_lookup"]) == 0
    assert cli.main([*argv, "--strategies", "jacobi", "--no-baselines"]) == 0
    assert seen == [["jacobi", "transformers_prompt_lookup", "transformers_fast_path"], ["jacobi"]]


def test_the_fast_path_peer_is_a_static_cache_and_a_compiled_forward_on_every_device():
    from hf_paralleldecode.bench import _generate_kwargs
    from hf_paralleldecode.compat import fast_path_generate_kwargs

    for device, everywhere in (("cpu", True), ("cuda", None)):
        kw = fast_path_generate_kwargs(device)
        assert kw["cache_implementation"] == "static"
        assert kw["compile_config"]._compile_all_devices is everywhere  # transformers compiles on CUDA by itself
    kw = _generate_kwargs(tiny_model("llama"), parse_strategy("transformers_fast_path"))
    assert kw["decoding"] == "stock" and kw["cache_implementation"] == "static"


def test_every_entry_runs_under_the_runs_attention_order_and_ar_torch_order_under_torchs(monkeypatch):
    """Stock and its peers get the attention order the decodings get (one setting for the whole run); the
    ``ar_torch_order`` line is stock under torch's own order: what the order alone gives stock."""
    import contextlib

    import hf_paralleldecode.bench as bench
    from hf_paralleldecode.attention import get_attention_priority

    entered = []

    @contextlib.contextmanager
    def recorder(device):
        entered.append(get_attention_priority())
        yield {}

    monkeypatch.setattr(bench, "decoding_attention", recorder)
    model = tiny_model("llama")
    report = run_benchmark(model, word_tokenizer(), ["t5 t6 t7", "t8 t9"], [parse_strategy("jacobi"),
                           parse_strategy("ar_torch_order")], max_new_tokens=4, repeats=1, batch_size=2,
                           attention_priority="auto", output_dir=None, progress=False)
    assert report["attention_priority"] == "auto"
    # warm-up and timed run of each stock entry (the decodings enter the order inside their own calls)
    assert entered == ["auto", "torch", "auto", "torch"]
    assert report["results"]["ar_torch_order"]["exact_match_vs_ar"] == 1.0


def test_cli_bad_strategy_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--model", "random-tiny", "--strategies", "jacobi:block_size=0", "--repeats", "1",
                  "--num-prompts", "1", "--max-new-tokens", "4", "--output-dir", ""])
    assert exc.value.code == 2
    assert "block_size" in capsys.readouterr().err


def test_cli_unknown_strategy_setting_names_the_setting_and_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exc:  # before the model loads
        cli.main(["bench", "--model", "random-tiny", "--strategies", "jacobi:bogus=1", "--repeats", "1",
                  "--num-prompts", "1", "--max-new-tokens", "4", "--output-dir", ""])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Unknown setting(s) ['bogus'] of strategy 'jacobi'" in err
    assert "block_size" in err and "cannot feed" not in err


def test_benchmark_survives_single_token_runs_and_uses_stock_ar(tmp_path):
    import hf_paralleldecode as hfpd
    from hf_paralleldecode.config import ParallelDecodingConfig

    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = ParallelDecodingConfig("jacobi", {"block_size": 4})  # must not leak into AR
    report = run_benchmark(model, word_tokenizer(), ["t5 t6", "t7 t8 t9"], [parse_strategy("jacobi:block_size=4")],
                           max_new_tokens=1, repeats=1, progress=False)
    assert report["results"]["ar"]["decode_speedup_vs_ar"] is None  # no decode phase to compare
    assert report["results"]["ar"]["tpf"] == 1.0


def test_cli_sweep_writes_heatmap(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n    return\n\nimport os\n")
    out = tmp_path / "s"
    code = cli.main(["sweep", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", "6",
                     "--decoding", "jacobi_forcing", "--grid", "block_size=2,4", "pool_size=0,2",
                     "--output-dir", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert len(report["results"]) == 1 + 4
    assert (out / "sweep.png").stat().st_size > 1000


def _saved_head(tmp_path, target, kind="block_bidirectional"):
    import torch

    from hf_paralleldecode import DraftHead

    torch.manual_seed(0)
    head = DraftHead.for_target(target, attention=kind, num_hidden_layers=1, block_size=4)
    head.save_pretrained(tmp_path / "head")
    return str(tmp_path / "head")


def test_batch_one_peers_run_row_by_row_and_budgets_make_a_scaling_chart(tmp_path):
    from hf_paralleldecode.bench import scaling_series

    model = tiny_model("llama")
    head = _saved_head(tmp_path, model)
    prompts = ["t5 t6 t7 t8 t5 t6", "t9 t10 t11", "t12 t13 t14 t15 t16", "t20 t21"]
    specs = [parse_strategy(s) for s in (
        f"speculative:drafter={head},tree_budget=2", f"speculative:drafter={head},tree_budget=6",
        "transformers_prompt_lookup:prompt_lookup_num_tokens=3", f"dflash_transformers:drafter={head}")]
    report = run_benchmark(model, word_tokenizer(), prompts, specs, max_new_tokens=10, repeats=1, batch_size=2,
                           output_dir=tmp_path / "o", progress=False)
    res = report["results"]
    for lab, r in res.items():
        assert r["exact_match_vs_ar"] == 1.0, lab
        assert r["sequential_rows"] == (r["decoding"] in ("transformers_prompt_lookup", "dflash_transformers"))
    # row by row, every target forward serves one row: TPF is tokens per forward, never below 1
    assert res[f"dflash_transformers(drafter={head})"]["tpf"] >= 1.0
    series = scaling_series(report, "tree_budget")
    assert list(series) == [f"speculative(drafter={head})"] and [v for v, _ in series[next(iter(series))]] == [2, 6]
    assert (tmp_path / "o" / "tree_budget.png").stat().st_size > 1000
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["results"]["ar"]["decoding"] == "ar"


def test_cli_drafter_flag_attaches_a_head_for_speculative_and_dflash(tmp_path, capsys):
    from hf_paralleldecode.bench import random_model
    from hf_paralleldecode.loading import default_model_path, load_tokenizer

    target = random_model("random-tiny", vocab_size=len(load_tokenizer(default_model_path())))
    head = _saved_head(tmp_path, target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n    return"}\n{"prompt": "import os\\n"}\n')
    argv = ["bench", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", "6", "--repeats", "1",
            "--output-dir", str(tmp_path / "o"), "--no-baselines"]
    assert cli.main([*argv, "--drafter", head, "--strategies", "speculative:tree_budget=4", "dflash_transformers"]) == 0
    results = json.loads((tmp_path / "o" / "bench.json").read_text())["results"]
    assert all(r["exact_match_vs_ar"] == 1.0 for r in results.values()) and len(results) == 3
    capsys.readouterr()
    for extra, message in ((["--drafter", str(tmp_path / "missing"), "--strategies", "speculative"], "--drafter"),
                           (["--strategies", "dflash_transformers"], "dflash_transformers needs")):
        with pytest.raises(SystemExit) as exc:
            cli.main([*argv, *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_bench_at_several_batch_sizes_writes_one_report_each_and_the_batch_chart(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "def f{i}(x):\\n    return"}}\n' for i in range(4)))
    code = cli.main(["bench", "--no-baselines", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", "6",
                     "--repeats", "1", "--strategies", "prompt_lookup", "jacobi_forcing:context_matches=2",
                     "--batch-sizes", "1", "2", "--output-dir", str(tmp_path / "o")])
    assert code == 0
    out = capsys.readouterr().out
    assert "batch size 1" in out and "batch size 2" in out
    for b in (1, 2):
        report = json.loads((tmp_path / "o" / f"batch{b}" / "bench.json").read_text())
        assert report["batch_size"] == b
        assert all(r["exact_match_vs_ar"] == 1.0 for r in report["results"].values())
    assert (tmp_path / "o" / "batch_sizes.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--model", "random-tiny", "--prompts", str(prompts), "--batch-sizes", "0"])
    assert exc.value.code == 2 and "argument --batch-sizes: must be an integer >= 1" in capsys.readouterr().err


def test_cli_tune_prints_the_knee_and_the_choice(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n    return"}\n{"prompt": "import os\\n"}\n')
    code = cli.main(["tune", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", "6",
                     "--grid", "block_size=2,4", "--output-dir", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 0 and "knee:" in out and "best: jacobi_forcing" in out
    assert json.loads((tmp_path / "o" / "tune.json").read_text())["choice"]["decoding"] == "jacobi_forcing"
    with pytest.raises(SystemExit) as exc:  # --save needs a local model folder
        cli.main(["tune", "--model", "random-tiny", "--prompts", str(prompts), "--save", "--grid", "block_size=2"])
    assert exc.value.code == 2 and "--save-to" in capsys.readouterr().err


def test_cli_tune_save_to_a_new_folder_creates_it(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n    return"}\n')
    target = tmp_path / "new" / "configs"
    code = cli.main(["tune", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", "4",
                     "--grid", "block_size=2", "--save", "--save-to", str(target), "--output-dir", str(tmp_path / "o")])
    assert code == 0 and str(target) in capsys.readouterr().out
    assert json.loads((target / "parallel_decoding_config.json").read_text())["decoding"] == "jacobi_forcing"
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:  # a path that is a file is refused before the model loads
        cli.main(["tune", "--model", "random-tiny", "--prompts", str(prompts), "--save", "--save-to",
                  str(tmp_path / "file"), "--grid", "block_size=2"])
    assert exc.value.code == 2 and "is a file" in capsys.readouterr().err


def test_sampled_runs_report_speed_against_stock_sampling_with_the_same_seed(tmp_path):
    """--do-sample: stock sampling is the baseline, each batch's runs start from one seed (AR twice gives the same
    text), exactness is n/a (compared in distribution by the sampling tests), the settings are in the report."""
    model = tiny_model("llama")
    prompts = ["t5 t6 t7 t5 t6 t7 t5 t6", "t9 t10 t9 t10 t9"]
    specs = [parse_strategy("prompt_lookup")]
    report = run_benchmark(model, word_tokenizer(), prompts, specs, max_new_tokens=10, repeats=1, progress=False,
                           sampling=dict(temperature=0.8), batch_size=2)
    assert report["sampling"] == {"do_sample": True, "temperature": 0.8}
    for r in report["results"].values():
        assert r["exact_match_vs_ar"] is None and r["tokens_per_second"] > 0
    assert " n/a" in format_report(report)
    with pytest.raises(ValueError, match="temperature, top_p and top_k"):
        run_benchmark(model, word_tokenizer(), prompts, specs, max_new_tokens=4, repeats=1, progress=False,
                      sampling=dict(temprature=0.8))


def test_bench_cli_sampling_flags_need_do_sample(capsys):
    from hf_paralleldecode import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--model", "random-tiny", "--temperature", "0.5", "--max-new-tokens", "4"])
    assert exit_.value.code == 2 and "--do-sample" in capsys.readouterr().err


def test_the_paired_regret_script_reports_every_round_and_the_policys_regret(tmp_path, monkeypatch):
    """``scripts/policy_regret.py``: stock, the default, each chain alone and the plain step alone, interleaved per batch
    for several rounds, each timed run after a garbage collection; the report keeps every round's speed against stock
    and the medians, and the regret is against the best fixed shape (a chain or plain steps)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "policy_regret.py"
    spec = importlib.util.spec_from_file_location("policy_regret", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "regret.json"
    collected = []
    real = script.gc.collect
    monkeypatch.setattr(script.gc, "collect", lambda *a: collected.append(a) or real(*a))
    assert script.main(["--model", "default", "--batch-size", "2", "--num-prompts", "4", "--rounds", "2",
                        "--chains", "4", "2", "--max-new-tokens", "6", "--output", str(out)]) == 0
    monkeypatch.undo()
    assert len(collected) == 2 * 2 * 5  # rounds x batches x entries: before every timed run
    report = json.loads(out.read_text())
    fixed = ("chain of 4", "chain of 2", "plain steps")
    assert set(report["speed_vs_stock_by_round"]) == {"stock", "default", *fixed}
    assert all(len(v) == 2 for v in report["speed_vs_stock_by_round"].values())
    assert report["speed_vs_stock_by_round"]["stock"] == [1.0, 1.0]
    s = report["all_rounds"]
    assert s["best_fixed"] in fixed
    assert s["best_fixed_speed"] == max(s["speed_vs_stock"][n] for n in fixed)
    assert s["regret"] == pytest.approx(1 - s["speed_vs_stock"]["default"] / s["best_fixed_speed"])
    assert report["after_first_round"]["speed_vs_stock"]["default"] == report["speed_vs_stock_by_round"]["default"][1]
    rounds = report["speed_vs_stock_by_round"]
    per_round = sorted(1 - d / b for d, b in zip(rounds["default"], rounds[s["best_fixed"]]))
    assert s["paired_regret"] == pytest.approx(sum(per_round) / 2)  # the median of each round's own regret
    # --resummarize recomputes both summaries from the seconds a report holds (an earlier report gains paired_regret)
    old = dict(report, all_rounds={k: v for k, v in s.items() if k != "paired_regret"}, after_first_round=None)
    out.write_text(json.dumps(old))
    assert script.main(["--resummarize", str(out)]) == 0
    assert json.loads(out.read_text()) == report
    with pytest.raises(SystemExit, match="num-prompts"):
        script.main(["--model", "default", "--batch-size", "8", "--num-prompts", "4", "--output", str(out)])
    with pytest.raises(SystemExit, match="needs --model, --batch-size and --output"):
        script.main(["--model", "default", "--output", str(out)])


@pytest.mark.parametrize("fast", [False, True])
def test_a_half_precision_run_on_a_cpu_without_a_fast_kernel_for_it_is_warned_of(tmp_path, capsys, monkeypatch, fast):
    """On a CPU whose oneDNN has no bf16 / fp16 matrix kernel (AVX2 only: no AVX-512) torch multiplies such matrices
    on a slow fallback whose cost grows with every token fed (measured here: a 2048 x 2048 bf16 product 122 s, fp32
    0.28 s; a 1B cost twin's bf16 prefill took minutes). A bench in that dtype measures the fallback, not a model's
    cost, so the command says so at the start, naming the fix; where the kernel exists it says nothing."""
    from hf_paralleldecode import hardware

    monkeypatch.setattr(hardware, "cpu_has_fast_matmul", lambda dtype: fast or dtype == torch.float32)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n    return"}\n')
    argv = ["bench", "--no-baselines", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", "4", "--repeats", "1",
            "--strategies", "jacobi:block_size=4", "--device", "cpu", "--output-dir", str(tmp_path / "o")]
    assert cli.main([*argv, "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    if fast:
        assert "warning" not in err
    else:
        assert "warning: --dtype bfloat16 on this CPU" in err and "--dtype float32" in err
    assert cli.main(argv) == 0  # float32 is never warned of
    assert "warning" not in capsys.readouterr().err


def test_the_fast_matmul_probe_answers_for_each_dtype_and_survives_a_missing_torch_probe(monkeypatch):
    from hf_paralleldecode import hardware

    assert hardware.cpu_has_fast_matmul(torch.float32) is True
    for dtype in (torch.bfloat16, torch.float16):
        assert isinstance(hardware.cpu_has_fast_matmul(dtype), bool)
    hardware.cpu_has_fast_matmul.cache_clear()
    monkeypatch.setitem(hardware._FAST_MATMUL_PROBES, torch.bfloat16, "_a_probe_torch_renamed")
    try:
        assert hardware.cpu_has_fast_matmul(torch.bfloat16) is True  # unknown: no warning on a guess
    finally:
        hardware.cpu_has_fast_matmul.cache_clear()


def test_the_modeled_cost_script_runs_the_bench_on_a_forward_grid(tmp_path, monkeypatch):
    """``scripts/modeled_cost.py``: each forward of the target costs what the grid says for its rows x tokens per row
    (linear between points, along the last segment beyond them, between row counts), on the process's clock, so the
    bench, its forward timers and the batch policy all read the modeled time; host work stays real."""
    import importlib.util
    import time
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "modeled_cost.py"
    spec = importlib.util.spec_from_file_location("modeled_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    points = [dict(batch=r, tokens_per_row=k, ms=ms) for r, k, ms in
              [(1, 1, 100), (1, 5, 300), (1, 128, 4000), (4, 1, 200), (4, 5, 1000), (4, 128, 9000)]]
    grid = script.ForwardGrid(points)
    assert grid(1, 1) == pytest.approx(0.1) and grid(1, 3) == pytest.approx(0.2)  # between points
    assert grid(1, 251) == pytest.approx(4.0 + 3.7 * 123 / 123)  # beyond the last, along its last segment
    assert grid(2, 1) == pytest.approx(0.1 + 0.1 / 3)  # between row counts
    assert grid(16, 5) == pytest.approx(1.0) and grid(1, 0) == pytest.approx(0.1)  # outside: the nearest
    with pytest.raises(ValueError, match="two token counts"):
        script.ForwardGrid([dict(batch=1, tokens_per_row=1, ms=1.0)])
    flat = [dict(batch=r, tokens_per_row=k, ms=2000.0) for r in (1, 4) for k in (1, 128)]  # every forward: 2 s
    (tmp_path / "grid.json").write_text(json.dumps(dict(points=flat)))
    monkeypatch.setattr(time, "perf_counter", time.perf_counter)  # (restored after the test)
    script.main(["bench", "--model", "default", "--grid", str(tmp_path / "grid.json"), "--num-prompts", "2",
                 "--batch-size", "2", "--max-new-tokens", "4", "--strategies", "speculative:max_step_tokens=1",
                 "--output-dir", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    for entry in report["results"].values():  # 4 forwards of 2 s each, the prompt's included; 2 rows x 4 tokens
        assert entry["seconds"] == pytest.approx(8.0, rel=0.05)
        assert entry["decode_tokens_per_second"] == pytest.approx(6 / 6.0, rel=0.05)  # 3 decode forwards, 6 tokens
    assert "step_traces" in report["results"]["speculative(max_step_tokens=1)"]


# ---- issue 64 (day-one round 5): `name:key=None` is a setting's None where its type admits it ---------------------
def _every_type_strategy():
    """A registered strategy with a setting of every simple type, each with and without None."""
    from dataclasses import dataclass, field

    import hf_paralleldecode as hfpd

    @dataclass
    class EveryType(hfpd.StrategySettings):
        flag: bool = field(default=True, metadata={"help": "a bool"})
        ratio: float = field(default=0.5, metadata={"help": "a float"})
        count: int = field(default=2, metadata={"help": "an int", "minimum": 1})
        mode: str = field(default="fast", metadata={"help": "a str", "choices": ("fast", "16")})
        name: str = field(default="x", metadata={"help": "any str"})
        maybe_flag: bool | None = field(default=None, metadata={"help": "a bool or None"})
        maybe_ratio: float | None = field(default=None, metadata={"help": "a float or None"})
        maybe_count: int | None = field(default=None, metadata={"help": "an int or None", "minimum": 1})
        maybe_name: str | None = field(default=None, metadata={"help": "a str or None"})

    return hfpd.decoding_strategy("test_every_type", EveryType, lambda model, settings, call: None)


@pytest.fixture
def every_type():
    from hf_paralleldecode import registry

    strategy = _every_type_strategy()
    registry.register_decoding("test_every_type", strategy)
    yield strategy.settings_class
    registry._REGISTRY.pop("test_every_type")


def test_cli_day_one_none_is_the_none_of_a_setting_whose_type_admits_it():
    assert parse_strategy("jacobi:block_size=None").settings == {"block_size": None}
    assert parse_strategy("jacobi:block_size=none,max_step_tokens=None").settings == {"block_size": None,
                                                                                     "max_step_tokens": None}
    assert parse_strategy("speculative:drafter=None").settings == {"drafter": None}  # a type beyond the simple ones
    assert parse_strategy("jacobi:block_size=None").label == "jacobi(block_size=None)"


def test_cli_day_one_every_setting_type_parses_to_its_type_and_none_only_where_admitted(every_type):
    spec = parse_strategy("test_every_type:flag=False,ratio=1,count=3,mode=16,name=007,maybe_flag=true,"
                          "maybe_ratio=2,maybe_count=4,maybe_name=None")
    assert spec.settings == dict(flag=False, ratio=1.0, count=3, mode="16", name="007", maybe_flag=True,
                                 maybe_ratio=2.0, maybe_count=4, maybe_name=None)
    assert type(spec.settings["ratio"]) is float and type(spec.settings["maybe_ratio"]) is float
    every_type(**spec.settings)  # the settings class takes every parsed value
    none = parse_strategy("test_every_type:maybe_flag=None,maybe_ratio=none,maybe_count=None,maybe_name=none")
    assert none.settings == dict(maybe_flag=None, maybe_ratio=None, maybe_count=None, maybe_name=None)
    for key, default in [("flag", "True"), ("ratio", "0.5"), ("count", "2"), ("mode", "'fast'"), ("name", "'x'")]:
        with pytest.raises(ValueError, match=rf"`{key}` does not take None \(default {default}\).*leave it out"):
            parse_strategy(f"test_every_type:{key}=None")


def test_cli_day_one_bench_refuses_none_for_a_setting_without_it_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model loaded before the settings were parsed"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--model", "random-tiny", "--strategies", "jacobi:adaptive=None", "--repeats", "1",
                  "--num-prompts", "1", "--max-new-tokens", "4", "--output-dir", ""])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "`adaptive` does not take None (default True)" in err


def test_cli_day_one_bench_runs_a_none_setting_as_its_default(tmp_path, capsys):
    code = cli.main(["bench", "--no-baselines", "--model", "random-tiny", "--num-prompts", "1", "--max-new-tokens", "4", "--repeats",
                     "1", "--strategies", "jacobi:block_size=None", "--output-dir", str(tmp_path / "o")])
    assert code == 0 and "jacobi(block_size=None)" in capsys.readouterr().out


def test_a_generation_longer_than_the_model_has_positions_is_refused_before_anything_runs(tmp_path, capsys):
    """``--max-new-tokens 10**12`` on a model with 2,048 positions ran until killed."""
    from models import ForwardRecorder

    model = tiny_model("llama")  # 512 positions
    rec = ForwardRecorder(model)
    try:
        with pytest.raises(ValueError, match=r"max_new_tokens=1000000000000.*512 positions.*at most 50[0-9]"):
            run_benchmark(model, word_tokenizer(), ["t5 t6 t7", "t9 t10 t9 t10"], [parse_strategy("jacobi")],
                          max_new_tokens=10**12, repeats=1, progress=False)
        with pytest.raises(ValueError, match=r"max_new_tokens=509 .*512 positions.*at most 50[0-9]"):
            run_benchmark(model, word_tokenizer(), ["t5 t6 t7", "t9 t10 t9 t10"], [parse_strategy("jacobi")],
                          max_new_tokens=509, repeats=1, batch_size=2, progress=False)
    finally:
        rec.restore()
    assert rec.calls == []
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n    return"}\n')
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--model", "random-tiny", "--prompts", str(prompts), "--max-new-tokens", str(10**12),
                  "--repeats", "1", "--strategies", "jacobi:block_size=4", "--output-dir", ""])
    assert exc.value.code == 2 and "--max-new-tokens" in capsys.readouterr().err
