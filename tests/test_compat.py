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


@pytest.mark.parametrize("version,warns", [("5.23.0", False), ("5.24.0", False), ("5.24.3", False),
                                           ("5.25.0", True), ("5.25.0.dev0", True), ("5.22.2", True), ("6.0.0", True)])
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
    "_hfpd_drafter": "the library's own attribute on a model (integration.py)",
    "_hfpd_target_key": "the library's own attribute on a model naming it for the batch policy's measurements (decoding/policy.py)",
    "_orig_mod": "the module torch.compile wraps (integration.py refuses the wrapper, naming it)",
    "_forward_hooks": "torch.nn.Module hooks (engine/target.py: the greedy head notices a new hook)",
    "_forward_pre_hooks": "torch.nn.Module hooks (engine/target.py)",
    "_global_forward_hooks": "torch.nn.Module global hooks (engine/target.py)",
    "_global_forward_pre_hooks": "torch.nn.Module global hooks (engine/target.py)",
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
