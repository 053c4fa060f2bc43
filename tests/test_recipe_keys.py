"""docs/recipe-keys.md is what scripts/recipe_keys.py writes now, and every shipped recipe uses known keys only."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _script():
    spec = importlib.util.spec_from_file_location("recipe_keys", ROOT / "scripts" / "recipe_keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_keys_page_is_up_to_date():
    page = ROOT / "docs" / "recipe-keys.md"
    assert page.is_file(), "docs/recipe-keys.md is missing: run python scripts/recipe_keys.py"
    assert page.read_text() == _script().render(), "docs/recipe-keys.md is out of date: run python scripts/recipe_keys.py"


def test_recipe_keys_page_is_deterministic_and_complete():
    from hf_paralleldecode.training.cli import METHODS, ScriptArguments

    script = _script()
    text = script.render()
    assert text == script.render()
    for name, (config_name, trainer_name) in METHODS.items():
        assert f"## `method: {name}`" in text and config_name in text and trainer_name in text
    for f in dataclasses.fields(ScriptArguments):
        assert f"| `{f.name}` |" in text


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_key_is_known(recipe):
    from hf_paralleldecode import training
    from hf_paralleldecode.training.cli import METHODS, ScriptArguments

    spec = yaml.safe_load(recipe.read_text())
    assert isinstance(spec, dict), f"{recipe.name} is not a YAML mapping"
    assert spec.get("method") in METHODS, f"{recipe.name}: method {spec.get('method')!r} is not one of {sorted(METHODS)}"
    config_cls = getattr(training, METHODS[spec["method"]][0])
    known = {f.name for cls in (ScriptArguments, config_cls) for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(spec) - known)
    assert not unknown, f"{recipe.name}: unknown keys {unknown} for {config_cls.__name__}"
