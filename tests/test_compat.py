"""The compatibility module (``hf_paralleldecode/compat.py``): what it relies on resolves on the installed
transformers, and nothing else in the project reaches past it.

When a transformers release removes or renames an internal, ``test_internal_name_resolves`` names it here
instead of an equivalence case failing somewhere else.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from models import prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode import compat

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_paralleldecode"
COMPAT = PACKAGE / "compat.py"


def _resolve(owner: str, attribute: str):
    parts = owner.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return getattr(obj, attribute)
    raise ImportError(owner)


@pytest.mark.parametrize("owner,attribute", compat.INTERNALS, ids=lambda x: x)
def test_internal_name_resolves(owner, attribute):
    """Each transformers internal compat.py relies on exists on the installed release."""
    assert _resolve(owner, attribute) is not None, f"{owner}.{attribute} is gone in transformers {transformers.__version__}"


def _exists(owner: str, attribute: str) -> bool:
    try:
        _resolve(owner, attribute)  # the attribute may be None (a flag's default): only its absence counts
    except (AttributeError, ImportError):
        return False
    return True


@pytest.mark.parametrize("owner,attribute,release", compat.INTRODUCED, ids=lambda x: x)
def test_introduced_names_exist_exactly_from_their_release(owner, attribute, release):
    """A name transformers added inside the range is there on that release and after, absent before: the release
    each of compat's gates names is the right one (CI runs the floor and the newest release)."""
    assert not compat.since(release, compat.TESTED_TRANSFORMERS[0]), "added at or below the floor: move it to INTERNALS"
    assert _exists(owner, attribute) == compat.since(release), (
        f"{owner}.{attribute} {'is' if _exists(owner, attribute) else 'is not'} in transformers "
        f"{transformers.__version__}; compat gates it on {release}")


@pytest.mark.parametrize("version,release,expected", [
    ("5.16.1", "5.19.0", False), ("5.18.9", "5.19.0", False), ("5.19.0", "5.19.0", True),
    ("5.19.0.dev0", "5.19.0", True), ("5.19.0rc1", "5.19.0", True), ("5.24.0", "5.19.0", True), ("6.0.0", "5.24.0", True),
])
def test_since_compares_releases_counting_a_pre_release_as_its_release(version, release, expected):
    assert compat.since(release, version) is expected


def test_the_gates_follow_the_installed_release():
    assert compat.TRAINER_READS_LOSS_SCALING == compat.since("5.19.0")
    assert compat.TRAINER_READS_LOSS_SCALING == hasattr(transformers.Trainer, "loss_is_scaled_for_ga")
    # the cache argument's name: `cache` from 5.24 on, `past_key_values` before
    assert compat.GENERATE_CACHE_KEY == ("cache" if compat.since("5.24.0") else "past_key_values")


def test_runtime_internals_are_set_by_generate():
    """The attributes transformers sets at run time (RUNTIME_INTERNALS) are there on a real call."""
    model = tiny_model("llama")
    seen = {}

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        seen["generation_config"], seen["model_kwargs"] = generation_config, model_kwargs
        return input_ids

    ids, mask = prompts(2)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, custom_generate=capture)
    gc_names, config_names, rope_names, output_names = compat.RUNTIME_INTERNALS.values()
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert rotary and all(hasattr(m, name) for m in rotary for name in rope_names)
    for name in gc_names:
        assert hasattr(seen["generation_config"], name), name
    assert compat.pad_token_tensor(seen["generation_config"]) is not None
    assert compat.eos_token_tensor(seen["generation_config"]) is not None
    for name in config_names:
        assert getattr(model.config, name) in ("sdpa", "eager")
    # generate hands the callable its cache under GENERATE_CACHE_KEY, and that is the name outputs use
    assert isinstance(seen["model_kwargs"][compat.GENERATE_CACHE_KEY], compat.DynamicCache)
    assert output_names == (compat.GENERATE_CACHE_KEY,)
    assert compat.GENERATE_CACHE_KEY in compat.GenerateDecoderOnlyOutput.__dataclass_fields__
    out = model(input_ids=ids, use_cache=True)
    assert isinstance(getattr(out, compat.GENERATE_CACHE_KEY), compat.Cache)
    assert compat.output_cache(out) is getattr(out, compat.GENERATE_CACHE_KEY)


def test_sample_arguments_are_what_generate_hands_a_callable():
    assert {"input_ids", "logits_processor", "stopping_criteria", "generation_config", "streamer"} <= compat.SAMPLE_ARGUMENTS


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_stock_models_take_the_releases_cache_name(arch):
    model = tiny_model(arch)
    assert compat.forward_cache_key(model) == compat.GENERATE_CACHE_KEY
    cache = compat.DynamicCache()
    ids, _ = prompts(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning: the name the forward takes is used
        model(input_ids=ids, use_cache=True, **compat.cache_kwargs(model, cache))
    assert cache.get_seq_length() == ids.shape[1]


def test_a_forward_written_for_another_release_gets_its_own_name():
    """Remote-code and user models keep the name they were written with (read from the signature)."""
    for name in compat.CACHE_NAMES:
        ns = {}
        exec(f"def forward(self, input_ids, {name}=None, **kwargs):\n    return {name}", ns)
        module = type("M", (torch.nn.Module,), {"forward": ns["forward"]})()
        assert compat.cache_kwargs(module, "c") == {name: "c"}
        assert module(None, **compat.cache_kwargs(module, "c")) == "c"
    only_kwargs = type("K", (torch.nn.Module,), {"forward": lambda self, **kwargs: kwargs})()
    assert compat.forward_cache_key(only_kwargs) == compat.GENERATE_CACHE_KEY


def test_user_cache_reads_every_name():
    for name in compat.CACHE_NAMES:
        assert compat.user_cache({name: "c"}) == "c"
    assert compat.user_cache({"attention_mask": 1}) is None


@pytest.mark.parametrize("name", compat.CACHE_NAMES)
def test_a_prefilled_cache_under_any_name_is_refused_clearly(name):
    model = hfpd.enable(tiny_model("llama"))
    ids, mask = prompts(1)
    cache = compat.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **compat.cache_kwargs(model, cache))
    with pytest.raises(ValueError, match="pre-filled"):
        model.generate(input_ids=ids, max_new_tokens=4, decoding="jacobi", **{name: cache})


def test_decoding_emits_no_transformers_deprecation_warning():
    """Every forward the library makes uses the current argument names (no FutureWarning from transformers)."""
    model = hfpd.enable(tiny_model("llama"))
    ids, mask = prompts(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for decoding in ("jacobi", "jacobi_forcing", "lookahead", "prompt_lookup"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, decoding=decoding)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))
                    and "deprecat" in str(w.message).lower()]
    assert not deprecations, deprecations


# ---- the declared range ---------------------------------------------------------------------------------
def _requirement(name: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(rf'^\s*"({name}[<>=!~][^"]*)"', text, re.M).group(1)


def test_declared_range_is_the_tested_range():
    low, high = compat.TESTED_TRANSFORMERS
    assert _requirement("transformers").replace(" ", "") == f"transformers>={low.removesuffix('.0')},<{high}"
    assert compat.tested_range_warning() is None, "CI runs on a transformers outside the tested range"


@pytest.mark.parametrize("version,warns", [("5.16.1", False), ("5.19.0", False), ("5.23.0", False), ("5.24.0", False),
                                           ("5.24.3", False), ("5.25.0", True), ("5.25.0.dev0", True), ("5.16.0", True),
                                           ("5.15.1", True), ("6.0.0", True)])
def test_outside_the_tested_range_warns_once_naming_it(version, warns):
    message = compat.tested_range_warning(version)
    assert (message is not None) == warns
    if warns:
        low, high = compat.TESTED_TRANSFORMERS
        assert f">={low},<{high}" in message and version in message


def test_import_outside_the_range_logs_one_warning_and_does_not_refuse():
    """A transformers installed by hand outside the range: one warning naming the tested range, then it works."""
    code = ("import transformers; transformers.__version__ = '5.99.0'\n"
            "import hf_paralleldecode as hfpd, hf_paralleldecode.decoding, hf_paralleldecode.compat as c\n"
            "print('imported', c.GENERATE_CACHE_KEY)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    low, high = compat.TESTED_TRANSFORMERS
    warnings_logged = [line for line in done.stderr.splitlines() if "tested with transformers" in line]
    assert len(warnings_logged) == 1, done.stderr
    assert f">={low},<{high}" in warnings_logged[0] and "5.99.0" in warnings_logged[0]
    assert "imported" in done.stdout


# ---- nothing outside compat.py reaches into transformers ----------------------------------------------
def _project_files():
    for folder in ("hf_paralleldecode", "recipes", "scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != COMPAT and path != Path(__file__).resolve():
                yield path


def test_no_file_outside_compat_names_the_cache_argument():
    legacy = [n for n in compat.CACHE_NAMES if n != "cache"]  # "cache" is a word; the old names are not
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _project_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if any(n in line for n in legacy)]
    assert not hits, f"name the cache argument through hf_paralleldecode.compat: {hits}"


#: private names of other libraries the package may use outside compat.py (not transformers')
NOT_TRANSFORMERS = {
    "_is_avx512_bf16_supported": "torch.cpu probe (hardware.py)",
    "_is_amx_tile_supported": "torch.cpu probe (hardware.py)",
    "_is_mkldnn_bf16_supported": "torch.ops.mkldnn probe of oneDNN's bf16 kernel (hardware.py)",
    "_is_mkldnn_fp16_supported": "torch.ops.mkldnn probe of oneDNN's fp16 kernel (hardware.py)",
    "_hfpd_drafter": "the library's own attribute on a model (integration.py)",
    "_hfpd_target_key": "the library's own attribute on a model naming it for the batch policy's measurements (decoding/policy.py)",
    "_orig_mod": "the module torch.compile wraps (integration.py refuses the wrapper, naming it)",
    "_forward_hooks": "torch.nn.Module hooks (engine/target.py: the greedy head notices a new hook)",
    "_forward_pre_hooks": "torch.nn.Module hooks (engine/target.py)",
    "_global_forward_hooks": "torch.nn.Module global hooks (engine/target.py)",
    "_global_forward_pre_hooks": "torch.nn.Module global hooks (engine/target.py)",
    "_C": "torch._C, for the attention backends' priority order (attention.py; tests/test_attention.py uses it)",
    "_get_sdp_priority_order": "torch's attention backends' priority order (attention.py)",
    "_set_sdp_priority_order": "torch's attention backends' priority order (attention.py)",
}


def _private_names(tree: ast.AST):
    """Private identifiers a module's code reads (attributes, imported names, string constants that are
    identifiers, e.g. for getattr), and those it defines (assignments, defs, class attributes)."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    used, defined = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.Attribute):
            (defined if isinstance(n.ctx, ast.Store) else used).add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            defined.add(n.id)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
        elif isinstance(n, ast.ImportFrom):
            used.update(a.name for a in n.names)
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()
              and id(n) not in docstrings and id(n) not in in_fstrings):
            used.add(n.value)
    private = lambda names: {x for x in names if x.startswith("_") and not x.startswith("__")}  # noqa: E731
    return private(used), private(defined)


def test_no_module_outside_compat_uses_a_private_name_it_does_not_define():
    trees = {p: ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py") if p != COMPAT}
    defined = set().union(*(_private_names(t)[1] for t in trees.values()))
    foreign = {}
    for path, tree in trees.items():
        for name in _private_names(tree)[0] - defined - set(NOT_TRANSFORMERS):
            foreign.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not foreign, f"private names of another library outside compat.py (move them there): {foreign}"


def test_no_class_outside_compat_overrides_a_private_transformers_member():
    import hf_paralleldecode.training  # noqa: F401 - the trainers
    import hf_paralleldecode.training.diffusion_alignment  # noqa: F401
    import hf_paralleldecode.training.draft_head  # noqa: F401

    bad = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("hf_paralleldecode") or name == "hf_paralleldecode.compat":
            continue
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("transformers")]
            for attr in vars(cls):
                if attr.startswith("_") and not attr.startswith("__") and any(attr in vars(b) for b in bases):
                    bad.append(f"{name}.{cls.__name__}.{attr}")
    assert not bad, f"override transformers internals through compat.py (TrainerHooks, HeadPreTrainedModel): {bad}"


def test_no_module_outside_compat_imports_transformers_internals_modules():
    """Public transformers modules only: the top-level package, model classes, Trainer / config classes."""
    allowed = re.compile(r"^transformers(\.models\.\w+)?$")
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path == COMPAT:
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            mods = [n.module] if isinstance(n, ast.ImportFrom) and n.module else \
                [a.name for a in n.names] if isinstance(n, ast.Import) else []
            bad += [f"{path.relative_to(ROOT)}: {m}" for m in mods
                    if m.startswith("transformers") and not allowed.match(m)]
    assert not bad, bad


# ---- the Trainer's loss scaling under gradient accumulation ---------------------------------------------
class _Linear(torch.nn.Module):
    """A model whose forward takes no ``**kwargs``: the Trainer does not think it normalises its own loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.proj(x)


class _Rows(torch.utils.data.Dataset):
    """Four rows of unequal weight, so a sum over the optimizer step differs from a mean of micro-batch means."""

    def __init__(self, weights=(1.0, 3.0, 0.5, 2.0)):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
        self.w = torch.tensor(weights)

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "w": self.w[i]}


def _weighted_trainer(scaled: bool | None):
    from transformers import Trainer

    class Weighted(compat.TrainerHooks, Trainer):
        """``scaled``: its loss is the weighted sum over the step's total weight (``num_items_in_batch``);
        otherwise the weighted mean of the micro-batch (the Trainer divides by the accumulation steps)."""

        loss_is_scaled_for_ga = scaled

        def count_items_in_batch(self, batch_samples, device):
            return sum(b["w"].sum() for b in batch_samples).to(device) if scaled else None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            per_row = inputs["w"] * (model(inputs["x"]) - inputs["y"]).square().squeeze(-1)
            return per_row.sum() / (num_items_in_batch if scaled else inputs["w"].sum())

    return Weighted


def _one_step(trainer_cls, tmp_path, batch: int, accumulation: int, **rows):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / f"{batch}x{accumulation}"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, remove_unused_columns=False, dataloader_drop_last=False, disable_tqdm=True, seed=0)
    collate = lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    trainer = trainer_cls(model=_Linear(), args=args, train_dataset=_Rows(**rows), data_collator=collate)
    trainer.train()
    return trainer, torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def test_a_loss_scaled_for_accumulation_takes_the_big_batch_step_on_every_release(tmp_path):
    """``loss_is_scaled_for_ga = True``: 2 accumulated micro-batches of 2 take the step of one batch of 4, on a
    release whose Trainer reads the flag (>= 5.19) and on one where TrainerHooks bridges it (the floor)."""
    trainer_cls = _weighted_trainer(True)
    _, big = _one_step(trainer_cls, tmp_path, 4, 1)
    trainer, accumulated = _one_step(trainer_cls, tmp_path, 2, 2)
    torch.testing.assert_close(accumulated, big, rtol=1e-5, atol=1e-6)
    if not compat.TRAINER_READS_LOSS_SCALING:
        assert trainer.model_accepts_loss_kwargs is True


def test_a_per_micro_batch_loss_is_still_divided_by_the_accumulation_steps(tmp_path):
    """``loss_is_scaled_for_ga = False``: the loss is each micro-batch's mean and the Trainer divides it by the
    accumulation steps, so with equal weights 2 x 2 again takes the step of one batch of 4 (not twice it)."""
    trainer_cls = _weighted_trainer(False)
    _, big = _one_step(trainer_cls, tmp_path, 4, 1, weights=(1.0, 1.0, 1.0, 1.0))
    trainer, accumulated = _one_step(trainer_cls, tmp_path, 2, 2, weights=(1.0, 1.0, 1.0, 1.0))
    torch.testing.assert_close(accumulated, big, rtol=1e-5, atol=1e-6)
    if not compat.TRAINER_READS_LOSS_SCALING:
        assert trainer.model_accepts_loss_kwargs is False


@pytest.mark.parametrize("reads_flag", [True, False])
@pytest.mark.parametrize("scaled", [True, False, None])
def test_trainer_hooks_copy_the_flag_only_where_the_trainer_ignores_it(monkeypatch, tmp_path, reads_flag, scaled):
    """On the installed release (5.24 by default) both paths of the gate: below 5.19 the flag becomes
    ``model_accepts_loss_kwargs``; from 5.19 on (and for a trainer without the flag) the Trainer's own value stays."""
    from transformers import TrainingArguments

    monkeypatch.setattr(compat, "TRAINER_READS_LOSS_SCALING", reads_flag)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, remove_unused_columns=False)
    trainer = _weighted_trainer(scaled)(model=_Linear(), args=args, train_dataset=_Rows())
    own = False  # _Linear.forward takes no **kwargs
    assert trainer.model_accepts_loss_kwargs is (own if reads_flag or scaled is None else scaled)
