"""enable(), the registry, the decoding config and the loader."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from models import prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode.config import CONFIG_NAME, ParallelDecodingConfig
from hf_paralleldecode.drafters.base import Drafter

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


def test_registry_lists_and_returns_strategies():
    assert "jacobi" in hfpd.available_decodings()
    assert hfpd.get_decoding("jacobi") is hfpd.jacobi
    with pytest.raises(ValueError, match="Available decodings: .*jacobi"):
        hfpd.get_decoding("jacobbi")


def test_register_custom_decoding_and_refuse_silent_overwrite():
    def mine(model, input_ids, logits_processor, stopping_criteria, generation_config, **kw):
        return input_ids

    hfpd.register_decoding("test_mine", mine)
    try:
        assert hfpd.get_decoding("test_mine") is mine
        with pytest.raises(ValueError, match="already registered"):
            hfpd.register_decoding("test_mine", lambda *a, **k: None)
        model = hfpd.enable(tiny_model("llama"))
        ids, _ = prompts(1)
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=3, decoding="test_mine"), ids)
    finally:
        from hf_paralleldecode import registry

        registry._REGISTRY.pop("test_mine")


def test_unknown_decoding_name_raises_with_the_list():
    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    with pytest.raises(ValueError, match="Unknown decoding 'nope'. Available decodings"):
        model.generate(input_ids=ids, max_new_tokens=3, decoding="nope")


def test_enable_keeps_stock_behaviour_class_name_and_isinstance(tmp_path):
    model = tiny_model("qwen2")
    cls = type(model)
    ids, mask = prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    same = hfpd.enable(model)
    assert same is model and hfpd.is_enabled(model) and isinstance(model, cls)
    assert type(model).__name__ == cls.__name__
    assert hfpd.enable(model) is model  # idempotent
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False), ref)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [cls.__name__]
    # other instances of the class are untouched
    assert not hfpd.is_enabled(tiny_model("qwen2"))


@pytest.mark.parametrize("enabled_first", [False, True], ids=["plain", "enabled_then_compiled"])
def test_enable_refuses_a_torch_compile_wrapper_naming_what_to_do(enabled_first):
    """torch.compile(model) is a wrapper whose generate() is the wrapped model's (run uncompiled): enable() refuses it
    before anything changes, and the wrapper keeps working as before."""
    model = tiny_model("llama")
    if enabled_first:
        hfpd.enable(model)
    compiled = torch.compile(model)
    with pytest.raises(ValueError, match=r"torch\.compile.*_orig_mod.*model\.forward = torch\.compile"):
        hfpd.enable(compiled)
    assert type(compiled).__name__ == "OptimizedModule" and not hfpd.is_enabled(compiled)
    ids = torch.tensor([[5, 6, 7]])
    ref = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(compiled.generate(input_ids=ids, max_new_tokens=4, do_sample=False), ref)


def test_enable_refuses_a_wrapper_without_a_generate_of_its_own():
    class Wrapper(torch.nn.Module):  # forwards attributes to the model, as DDP-like wrappers may
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(super().__getattr__("inner"), name)

    with pytest.raises(ValueError, match="Wrapper.*generate"):
        hfpd.enable(Wrapper(tiny_model("llama")))


@pytest.mark.slow
def test_a_compiled_forward_serves_every_decoding_exactly():
    """What docs/troubleshooting.md advises: enable the model, then compile its forward (the eager backend here: the
    same graph capture, without the C++ build)."""
    model = hfpd.enable(tiny_model("llama"))
    ids, mask = prompts(2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    ref = model.generate(**kwargs)
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        for decoding in ("stock", "jacobi", "lookahead"):
            assert torch.equal(model.generate(**kwargs, decoding=decoding), ref), decoding
    finally:
        del model.forward


def test_unknown_strategy_setting_is_not_silently_ignored():
    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    with pytest.raises(ValueError, match="block_sz"):
        model.generate(input_ids=ids, max_new_tokens=3, decoding="jacobi", block_sz=4)


def test_config_round_trip_sorted_json_and_version(tmp_path):
    config = ParallelDecodingConfig("jacobi", {"block_size": 32, "jacobi_init": "repeat"}, base_model_name_or_path="x")
    path = config.save_pretrained(tmp_path)
    text = path.read_text()
    data = json.loads(text)
    assert list(data) == sorted(data)
    assert data["library_version"] == hfpd.__version__
    loaded = ParallelDecodingConfig.from_pretrained(tmp_path)
    assert loaded == config
    assert loaded.generate_kwargs() == {"decoding": "jacobi", "block_size": 32, "jacobi_init": "repeat"}


def test_config_drops_unknown_keys_from_newer_versions_with_a_warning(tmp_path, caplog):
    data = {"decoding": "jacobi", "settings": {"block_size": 8}, "library_version": "9.0", "future_field": 1}
    (tmp_path / CONFIG_NAME).write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        config = ParallelDecodingConfig.from_pretrained(tmp_path)
    assert config.settings == {"block_size": 8}
    assert "future_field" in caplog.text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(decoding="nope"), "Unknown decoding"),
        (dict(decoding="jacobi", settings={"blocksize": 3}), r"Unknown settings.*did you mean 'block_size'"),
        (dict(decoding="speculative", settings={"model": 3}), "Unknown settings"),  # generate's, not a setting
        (dict(decoding="jacobi", settings=[1]), "must be a dict"),
        # values are checked at construction, for every strategy, not at the first generate()
        (dict(decoding="jacobi", settings={"block_size": 0}), "block_size"),
        (dict(decoding="jacobi", settings={"jacobi_init": "zeros"}), "jacobi_init"),
        (dict(decoding="jacobi_forcing", settings={"activation_ratio": 1.5}), "activation_ratio"),
        (dict(decoding="jacobi_forcing", settings={"num_blocks": 2.0}), "num_blocks"),
        (dict(decoding="lookahead", settings={"ngram_size": 1}), "ngram_size"),
        (dict(decoding="lookahead", settings={"pool_from_prompt": "yes"}), "pool_from_prompt"),
        (dict(decoding="speculative", settings={"tree_budget": 0}), "tree_budget"),
        (dict(decoding="speculative", settings={"tree_depth": -1}), "tree_depth"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDecodingConfig(**kwargs)


def test_config_accepts_every_strategy_default_and_preset_placeholders():
    from hf_paralleldecode.registry import available_decodings

    for name in available_decodings():
        ParallelDecodingConfig(name, {})
    ParallelDecodingConfig("jacobi_forcing", {"block_size": None, "num_blocks": 2})  # None: the device preset


def test_config_from_bad_files(tmp_path):
    with pytest.raises(ValueError, match=f"No {CONFIG_NAME}"):
        ParallelDecodingConfig.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ParallelDecodingConfig.from_pretrained(tmp_path)


def test_loader_defaults_generate_to_the_checkpoint_decoding(tmp_path):
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = ParallelDecodingConfig("jacobi", {"block_size": 5})
    model.save_pretrained(tmp_path)
    assert (tmp_path / CONFIG_NAME).is_file()
    assert not list(tmp_path.glob("*.bin"))  # safetensors only

    loaded = hfpd.load_model(tmp_path)
    assert hfpd.is_enabled(loaded)
    assert loaded.parallel_decoding_config.settings == {"block_size": 5}
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    out = loaded.generate(**kwargs, return_dict_in_generate=True)
    assert out.decoding == "jacobi" and out.stats["block_size"] == 5  # checkpoint default used
    override = loaded.generate(**kwargs, return_dict_in_generate=True, block_size=3)
    assert override.stats["block_size"] == 3
    stock = tiny_model("llama").generate(**kwargs)
    assert torch.equal(out.sequences, stock) and torch.equal(override.sequences, stock)


def test_loader_refuses_pickle_weights(tmp_path):
    with pytest.raises(ValueError, match="safetensors"):
        hfpd.load_model(tmp_path, use_safetensors=False)


def test_loader_refuses_a_decoding_config_that_is_not_one(tmp_path):
    with pytest.raises(ValueError, match="`decoding_config` must be a ParallelDecodingConfig.*got dict"):
        hfpd.load_model(tmp_path, decoding_config={"decoding": "jacobi"})


def test_import_is_cheap():
    import subprocess
    import sys

    code = "import sys, hf_paralleldecode; print(int('torch' in sys.modules), int('transformers' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "0"]


def test_stock_decoding_bypasses_checkpoint_defaults():
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = ParallelDecodingConfig("jacobi", {"block_size": 5})
    ids, _ = prompts(1)
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, decoding="stock",
                         return_dict_in_generate=True)
    assert not isinstance(out, hfpd.ParallelDecodingOutput)
    assert isinstance(model.generate(input_ids=ids, max_new_tokens=5, return_dict_in_generate=True),
                      hfpd.ParallelDecodingOutput)  # without decoding=: the checkpoint's default


def test_config_from_a_newer_version_loads_with_warnings(caplog):
    data = {"decoding": "jacobi", "settings": {"block_size": 8, "new_setting": 1}, "library_version": "9.0"}
    with caplog.at_level(logging.WARNING):
        config = ParallelDecodingConfig.from_dict(data)
    assert config.settings == {"block_size": 8} and "new_setting" in caplog.text
    with caplog.at_level(logging.WARNING):
        future = ParallelDecodingConfig.from_dict({"decoding": "from_the_future", "settings": {"k": 1}})
    assert future.decoding == "from_the_future" and "from_the_future" in caplog.text
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = future
    ids, _ = prompts(1)
    with pytest.raises(ValueError, match="Unknown decoding 'from_the_future'"):
        model.generate(input_ids=ids, max_new_tokens=3)
    assert model.generate(input_ids=ids, max_new_tokens=3, decoding="stock").shape[1] == ids.shape[1] + 3


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_an_enabled_model_can_be_pickled_copied_and_saved(how, tmp_path):
    import copy
    import io
    import pickle

    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("jacobi", {"block_size": 4})
    hfpd.integration.attach_drafter(model, hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=2))
    if how == "pickle":
        clone = pickle.loads(pickle.dumps(model))
    elif how == "deepcopy":
        clone = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    assert hfpd.is_enabled(clone) and type(clone) is type(model) and type(clone).__name__ == "LlamaForCausalLM"
    assert hfpd.integration.attached_drafter(clone) is not None  # the draft head travels with it
    ids = torch.tensor([[5, 6, 7, 8]])
    out = clone.generate(input_ids=ids, max_new_tokens=8, return_dict_in_generate=True)
    assert out.decoding == "jacobi"
    assert torch.equal(out.sequences, model.generate(input_ids=ids, max_new_tokens=8, decoding="stock"))


@pytest.mark.parametrize("call", [
    dict(num_beams=3), dict(num_beams=2, num_return_sequences=2), dict(do_sample=True, num_return_sequences=2),
    dict(prompt_lookup_num_tokens=3), dict(use_cache=False), dict(output_attentions=True, return_dict_in_generate=True),
])
def test_checkpoint_defaults_step_aside_for_calls_they_cannot_serve(call, caplog):
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("jacobi", {"block_size": 4})
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="hf_paralleldecode"):
        out = model.generate(input_ids=ids, max_new_tokens=6, **call)
    torch.manual_seed(0)
    ref = model.generate(input_ids=ids, max_new_tokens=6, decoding="stock", **call)
    seqs = out.sequences if hasattr(out, "sequences") else out
    assert torch.equal(seqs, ref.sequences if hasattr(ref, "sequences") else ref)
    assert "steps aside" in caplog.text
    with pytest.raises(ValueError):  # asked for explicitly, it is refused as before
        model.generate(input_ids=ids, max_new_tokens=6, decoding="jacobi", **call)


def test_checkpoint_defaults_still_serve_plain_calls():
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("jacobi", {"block_size": 4})
    out = model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, return_dict_in_generate=True)
    assert out.decoding == "jacobi"


def test_the_library_version_is_the_packages():
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == hfpd.__version__


# ---- saving checkpoints: checked whole before any file, written atomically ------------------------------------
def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, "bfloat16", "target"])
def test_a_torch_dtype_setting_is_saved_as_its_name_and_read_back_as_the_dtype(dtype, tmp_path):
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = ParallelDecodingConfig("speculative", {"drafter_dtype": dtype, "tree_budget": 4})
    model.save_pretrained(tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / CONFIG_NAME).read_text())
    probe = tmp_path / "probe"  # the modes a plain mkdir and write give (a temporary folder's 0700 is not kept)
    probe.mkdir()
    (probe / "file").write_text("")
    assert (tmp_path / "ckpt").stat().st_mode == probe.stat().st_mode
    assert (tmp_path / "ckpt" / CONFIG_NAME).stat().st_mode == (probe / "file").stat().st_mode
    name = str(dtype).removeprefix("torch.")
    assert data["settings"] == {"drafter_dtype": name, "tree_budget": 4}
    loaded = hfpd.load_model(tmp_path / "ckpt").parallel_decoding_config
    want = getattr(torch, name) if name != "target" else "target"
    assert loaded.settings == {"drafter_dtype": want, "tree_budget": 4}
    assert loaded.strategy_settings.drafter_dtype == want
    assert ParallelDecodingConfig.from_pretrained(ParallelDecodingConfig(
        "speculative", {"drafter_dtype": dtype}).save_pretrained(tmp_path / "alone")).settings["drafter_dtype"] == want


class _PlainModuleDrafter(Drafter):
    """A drafter kind that is a plain ``torch.nn.Module``: no ``save_pretrained`` of its own."""

    kind = "test_plain_module"

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)

    def check_target(self, target, tokenizer=None):
        pass

    def start(self, context, depth, denoise_steps=None):
        raise NotImplementedError


def _unsaveable_setting():
    """A strategy registered without a settings class whose setting takes any object (its signature is its schema)."""
    def mine(model, input_ids, logits_processor, stopping_criteria, generation_config, anchor=None, **kw):
        return input_ids

    return mine


@pytest.mark.parametrize("case", ["plain-module drafter", "setting not JSON", "config's own save", "drafter's own save",
                                  "push_to_hub", "config's push_to_hub", "not a config"])
def test_an_unsaveable_checkpoint_is_refused_before_any_file_is_written(case, tmp_path):
    """Checked whole before anything is written (the hub pushes: before the repo is created, no network here)."""
    from pathlib import Path

    from hf_paralleldecode import registry

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")  # what was there before stays, and nothing is added
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = ParallelDecodingConfig("jacobi", {"block_size": 4})
    hfpd.register_decoding("test_unsaveable", _unsaveable_setting())
    try:
        if case in ("plain-module drafter", "push_to_hub"):
            hfpd.integration.attach_drafter(model, _PlainModuleDrafter())
            save = (lambda: model.save_pretrained(target)) if case != "push_to_hub" else \
                (lambda: model.push_to_hub("nobody/unsaveable"))
            match = "test_plain_module.*save_pretrained"
        elif case == "drafter's own save":
            save, match = lambda: _PlainModuleDrafter().save_pretrained(target), "test_plain_module.*save_pretrained"
        elif case == "not a config":
            model.parallel_decoding_config = {"decoding": "jacobi"}
            save, match = lambda: model.save_pretrained(target), "must be a hf_paralleldecode.ParallelDecodingConfig"
        else:
            config = ParallelDecodingConfig("test_unsaveable", {"anchor": Path("x")})
            model.parallel_decoding_config = config
            save = {"setting not JSON": lambda: model.save_pretrained(target),
                    "config's own save": lambda: config.save_pretrained(target),
                    "config's push_to_hub": lambda: config.push_to_hub("nobody/unsaveable")}[case]
            match = "`anchor`.*JSON"
        with pytest.raises(ValueError, match=match):
            save()
    finally:
        registry._REGISTRY.pop("test_unsaveable")
    assert _files(target) == ["tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left beside it


def test_a_save_that_fails_while_writing_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = ParallelDecodingConfig("speculative", {"tree_budget": 4})
    head = hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=2)
    hfpd.integration.attach_drafter(model, head)
    model.save_pretrained(tmp_path / "ckpt")  # a bundle saved before
    before = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}

    def disk_full(self, save_directory, *args, **kwargs):
        from pathlib import Path

        Path(save_directory).mkdir(parents=True, exist_ok=True)
        (Path(save_directory) / "model.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(type(head), "save_pretrained", disk_full)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(OSError, match="No space"):
        model.save_pretrained(tmp_path / "ckpt")
    assert {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(OSError, match="No space"):
        model.save_pretrained(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # a new folder is not created at all
    monkeypatch.undo()
    model.save_pretrained(tmp_path / "ckpt")  # saving over a bundle replaces it
    loaded = hfpd.load_model(tmp_path / "ckpt")
    assert loaded.parallel_decoding_config == ParallelDecodingConfig("speculative", {"tree_budget": 4}, drafter="drafter",
                                                                     library_version=hfpd.__version__)
    assert torch.equal(next(loaded.parameters()), next(model.parameters()))


@pytest.mark.parametrize("data, match", [
    ({"decoding": ["jacobi"]}, "`decoding` must be .*str.*got \\['jacobi'\\]"),
    ({"decoding": None}, "`decoding` must be"),
    ({"decoding": "jacobi", "drafter": 5}, "`drafter` must be a folder, path or repo id"),
    ({"decoding": "jacobi", "base_model_name_or_path": 3}, "`base_model_name_or_path` must be"),
    ({"decoding": "jacobi", "library_version": [0]}, "`library_version` must be"),
    ({"decoding": "jacobi", "settings": [1]}, "`settings` must be"),
    ({"decoding": "speculative", "settings": {"drafter": "default-jetspec"}}, "Name the draft head with `drafter=`"),
    ({"decoding": "jacobi", "settings": {"block_size": True}}, "block_size"),
    ({"decoding": "speculative", "settings": {"drafter_dtype": "int8"}}, "drafter_dtype"),
])
def test_a_loaded_config_is_checked_as_the_constructor_checks_it(data, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        ParallelDecodingConfig.from_dict(data)
    (tmp_path / CONFIG_NAME).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        ParallelDecodingConfig.from_pretrained(tmp_path)
    if "drafter" not in json.dumps(data.get("settings")):  # the constructor refuses the same (strictly)
        with pytest.raises(ValueError, match=match):
            ParallelDecodingConfig(**data)
