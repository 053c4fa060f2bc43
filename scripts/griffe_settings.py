"""Griffe extension of the docs build (``mkdocs.yml``): strategies and their settings as the objects themselves are.

A strategy is built by :func:`hf_paralleldecode.decoding_strategy` (``jacobi = decoding_strategy(...)``) and its
settings' help is field metadata: static analysis sees an assignment and bare fields. This extension documents
each strategy from the callable (its signature listing every setting, its docstring with their help) and gives
each field of a settings class its help and default.
"""

from __future__ import annotations

import dataclasses
import importlib

import griffe

_FACTORY = "decoding_strategy("


def _runtime(obj: griffe.Object):
    return getattr(importlib.import_module(obj.module.path), obj.name)


class StrategySettingsDocs(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, agent, **kwargs) -> None:
        built = [m for m in mod.members.values()
                 if not m.is_alias and m.is_attribute and str(m.value or "").startswith(_FACTORY)]
        if not built:
            return
        inspected = griffe.inspect(mod.path, docstring_parser="google")
        for attr in built:
            function = inspected.members[attr.name]
            function.lineno, function.endlineno = attr.lineno, attr.endlineno
            mod.set_member(attr.name, function)

    def on_class_members(self, *, cls: griffe.Class, agent, **kwargs) -> None:
        if not any(str(base).endswith("StrategySettings") for base in cls.bases):
            return
        runtime = _runtime(cls)
        for field in dataclasses.fields(runtime):
            member = cls.members.get(field.name)
            if member is None or member.is_alias:
                continue
            member.docstring = griffe.Docstring(field.metadata.get("help", ""), parent=member, parser="google")
            default = field.default if field.default is not dataclasses.MISSING else None
            member.value = repr(default)
