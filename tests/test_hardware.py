"""Hardware presets: derived from datasheet rooflines, shrinking under load, valid for every strategy."""

from __future__ import annotations

import pytest
import torch
from models import enabled, prompts

import hf_paralleldecode as hfpd
from hf_paralleldecode.decoding.jacobi_forcing import CPU_DEFAULTS, GPU_DEFAULTS
from hf_paralleldecode.hardware import GPU_SPECS, knee_tokens, preset_name
from hf_paralleldecode.registry import get_decoding

CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]


def test_every_listed_architecture_has_a_part_and_a_ridge():
    assert sorted(GPU_SPECS) == CAPABILITIES
    for spec in GPU_SPECS.values():
        assert 100 < spec.ridge < 500  # dense bf16 FLOP per byte of the datasheet parts


def test_knee_is_the_ridge_plus_the_kv_cache_share():
    spec = GPU_SPECS[(9, 0)]
    assert knee_tokens(spec, params=1e9, kv_bytes_per_token=0.0) == pytest.approx(spec.ridge)
    # KV bytes equal to the weights' double the bytes per forward, so twice the tokens fit under the knee
    assert knee_tokens(spec, params=1e9, kv_bytes_per_token=2e9 / 1000, context=1000) == pytest.approx(2 * spec.ridge)


@pytest.mark.parametrize("where", [*CAPABILITIES, "cpu", torch.device("cpu")])
def test_presets_name_valid_settings_for_every_strategy(where):
    preset = hfpd.hardware_preset(where)
    assert set(preset) >= {"jacobi", "jacobi_forcing", "lookahead", "prompt_lookup"}
    for decoding, settings in preset.items():
        if decoding != "speculative":  # speculative also needs a drafter
            get_decoding(decoding).check_settings(settings)


def test_hopper_and_blackwell_give_the_papers_jacobi_forcing_defaults_and_cpu_the_measured_ones():
    for cc in [(9, 0), (10, 0)]:
        jf = hfpd.hardware_preset(cc)["jacobi_forcing"]
        assert {k: jf[k] for k in GPU_DEFAULTS} == GPU_DEFAULTS  # n=64, K=2, r=0.85, pool 4
    assert hfpd.hardware_preset("cpu")["jacobi_forcing"] == CPU_DEFAULTS
    assert hfpd.hardware_preset((8, 7)) == hfpd.hardware_preset((8, 6))  # closest lower listed architecture
    assert preset_name((9, 0)) == "sm90" and preset_name("cpu") == "cpu"


@pytest.mark.parametrize("cc", CAPABILITIES)
def test_budget_under_load_shrinks_per_row_sizes_with_the_batch(cc):
    sizes = [hfpd.hardware_preset(cc, batch_size=b) for b in (1, 4, 16, 64)]
    for key, setting in [("jacobi_forcing", "block_size"), ("jacobi", "block_size"), ("lookahead", "window_size"),
                         ("prompt_lookup", "tree_budget"), ("speculative", "tree_budget")]:
        values = [s[key][setting] for s in sizes]
        assert values == sorted(values, reverse=True) and values[0] > values[-1], (key, values)


@pytest.mark.parametrize("bad", [(7, 5), "tpu", (9,), "9.0", (9, 0.5)])
def test_bad_devices_are_refused_with_the_fix(bad):
    with pytest.raises(ValueError, match="capability|device|preset"):
        hfpd.hardware_preset(bad)
    with pytest.raises(ValueError, match="batch_size"):
        hfpd.hardware_preset("cpu", batch_size=0)


def test_jacobi_forcing_records_the_preset_it_ran_with():
    model = enabled("llama")
    ids, mask = prompts(2)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         decoding="jacobi_forcing", return_dict_in_generate=True)
    assert out.stats["hardware_preset"] == "cpu"
    assert {k: out.stats[k] for k in CPU_DEFAULTS} == CPU_DEFAULTS
    config = hfpd.ParallelDecodingConfig("jacobi_forcing", hfpd.hardware_preset((9, 0))["jacobi_forcing"])
    assert config.settings["block_size"] == 64  # a preset saves like any settings


def test_the_docs_table_is_what_the_code_derives():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "hardware.md").read_text()
    for cc, spec in GPU_SPECS.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| sm{cc[0]}{cc[1]} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        one, eight = hfpd.hardware_preset(cc), hfpd.hardware_preset(cc, batch_size=8)
        assert float(cells[2]) == spec.bf16_tflops and float(cells[3]) == spec.memory_tbps
        assert int(cells[4]) == round(spec.ridge) and int(cells[5]) == round(knee_tokens(spec))
        jf = [f"n={p['jacobi_forcing']['block_size']}, pool {p['jacobi_forcing']['pool_size']}" for p in (one, eight)]
        assert cells[6] == " / ".join(jf)
        assert cells[7] == f"{one['speculative']['tree_budget']} / {eight['speculative']['tree_budget']}"
        assert cells[8] == f"{one['lookahead']['window_size']} / {eight['lookahead']['window_size']}"


def test_tune_measures_the_curve_picks_the_fastest_exact_point_and_saves_it(tmp_path):
    from models import tiny_model, word_tokenizer

    from hf_paralleldecode.tune import knee_of, tune

    assert knee_of([(1, 1.0), (2, 1.2), (4, 1.5), (8, 3.0)]) == 4
    model = hfpd.enable(tiny_model("llama"))
    prompts = ["t5 t6 t7 t8 t5 t6 t7", "t9 t10 t11 t9 t10"]
    grid = {"block_size": [2, 4], "pool_size": [0, 2]}
    report = tune(model, word_tokenizer(), prompts, "jacobi_forcing", grid, max_new_tokens=8, tokens=(1, 2, 4, 8),
                  output_dir=tmp_path / "out", save_to=tmp_path / "model", progress=False)
    assert report["roofline"]["tokens"] == [1, 2, 4, 8] and report["roofline"]["knee_tokens"] in (1, 2, 4, 8)
    assert len(report["results"]) == 4 and all(r["exact"] for r in report["results"])
    best = max(report["results"], key=lambda r: r["tokens_per_second"])
    assert report["choice"]["settings"] == best["settings"]
    saved = hfpd.ParallelDecodingConfig.from_pretrained(tmp_path / "model")
    assert saved.decoding == "jacobi_forcing" and saved.settings == best["settings"]
    for name in ("tune.json", "roofline.png", "sweep.png"):
        assert (tmp_path / "out" / name).stat().st_size > 100
    tight = tune(model, word_tokenizer(), prompts, "jacobi_forcing", {"block_size": [2]}, max_new_tokens=4,
                 tokens=(1, 2), latency_budget_ms=1e-6, progress=False)
    assert tight["choice"] is None  # nothing fits a one-nanosecond step
    with pytest.raises(ValueError, match="grid"):
        tune(model, word_tokenizer(), prompts, "jacobi_forcing", {}, progress=False)


def test_device_preset_never_refuses_a_device_a_strategy_runs_on(monkeypatch):
    from hf_paralleldecode.hardware import device_preset

    assert device_preset(torch.device("mps"))[0] == "cpu"  # no roofline here: the CPU preset
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    name, preset = device_preset(torch.device("cuda"))
    assert name == "sm80" and preset == hfpd.hardware_preset((8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert device_preset(torch.device("cuda")) == ("sm90", hfpd.hardware_preset((9, 0)))


@pytest.mark.parametrize("decoding", ["jacobi", "lookahead", "prompt_lookup", "jacobi_forcing"])
def test_strategies_fill_unset_settings_from_the_device_preset_and_record_it(decoding):
    model = enabled("llama")
    ids, mask = prompts(2)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, decoding=decoding,
                         return_dict_in_generate=True)
    assert out.stats["hardware_preset"] == "cpu"
    preset = hfpd.hardware_preset("cpu")[decoding]
    assert {k: out.stats[k] for k in preset} == preset  # every preset setting, as resolved


def test_a_strategy_on_a_device_without_a_roofline_names_the_cpu_preset():
    from types import SimpleNamespace

    from hf_paralleldecode.hardware import preset_settings

    name, settings = preset_settings(SimpleNamespace(device=torch.device("mps")), "jacobi_forcing", block_size=None,
                                     pool_size=2)
    assert name == "cpu" and settings == {"block_size": CPU_DEFAULTS["block_size"], "pool_size": 2}
