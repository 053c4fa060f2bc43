"""Strategy settings, declared once, and the one factory that turns a strategy into a ``custom_generate`` callable.

What it is for
    A strategy declares its settings as a :class:`StrategySettings` dataclass, in the style of trl's configs:
    typed fields with defaults and ``field(metadata={"help": ...})``. Each field's check is its declaration:
    its type (``int``, ``float``, ``bool``, ``str``; ``X | None`` lets ``None`` through, which for most
    settings means "the device preset") plus the metadata ``minimum``, ``choices`` or ``check``; a class adds
    checks across fields in :meth:`StrategySettings.check`. Building the settings runs every check, once.

    :func:`decoding_strategy` builds the callable that transformers' ``generate(custom_generate=...)`` calls
    (and ``generate(decoding="name")`` through the registry) from a name, a settings class and a run function.
    The arguments ``generate`` hands every such callable are written here once. The callable's signature
    lists every setting with its default, its docstring their help, and it carries its settings class.

    :func:`settings_class` gives any strategy's settings class; a callable registered without one gets a
    class read off its signature (its signature is its schema). :data:`STRATEGIES` is the table of strategies
    by name that :mod:`hf_paralleldecode.registry` fills: it sits here so that the engine's checks
    (``support.py``) can tell another strategy's setting from a model input without importing the registry.

What it deliberately does not know
    Any strategy: the built-in ones are declared in :mod:`hf_paralleldecode.decoding` and registered by the
    registry above it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..compat import SAMPLE_ARGUMENTS
from ..hardware import preset_settings

__all__ = ["StrategySettings", "GenerateCall", "decoding_strategy", "settings_class", "STRATEGIES",
           "GENERATE_ARGUMENTS", "unknown_settings_hint", "check_int_setting", "check_bool_setting"]

#: what ``generate`` hands every strategy itself: not settings a caller passes
GENERATE_ARGUMENTS = frozenset(SAMPLE_ARGUMENTS - {"self"} | {"model"})
#: the streamer ``generate(decoding=...)`` hands a strategy that takes it (``integration.py``): not a setting either
STREAMER_ARGUMENT = "pd_streamer"

#: registered strategies by name (``hf_paralleldecode.registry`` owns the rules and registers the built-in ones)
STRATEGIES: dict[str, Callable] = {}


# ---- checks of one value ------------------------------------------------------------------------------
def check_int_setting(name: str, value, minimum: int | None) -> int:
    """Validate an integer setting (bools and floats are refused) and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"`{name}` must be an integer{bound}, got {value!r} ({type(value).__name__}).")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return value


def check_bool_setting(name: str, value) -> bool:
    """Validate a True/False setting and return it."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return value


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a number, got {value!r}.")


def _check_str(name: str, value) -> None:
    if not isinstance(value, str):
        raise ValueError(f"`{name}` must be a string, got {value!r}.")


#: the check a field's type implies (``minimum`` applies to integers)
_TYPE_CHECKS = {
    bool: lambda name, value, meta: check_bool_setting(name, value),
    int: lambda name, value, meta: check_int_setting(name, value, meta.get("minimum")),
    float: lambda name, value, meta: _check_number(name, value),
    str: lambda name, value, meta: _check_str(name, value),
}


def unknown_settings_hint(unknown, known) -> str:
    """`` (did you mean 'x'?)`` for the first of ``unknown`` close to one of ``known``; else ``""``."""
    for key in unknown:
        close = difflib.get_close_matches(key, list(known), n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


# ---- the settings base class ---------------------------------------------------------------------------
@dataclass
class StrategySettings:
    """Base of a strategy's settings: a dataclass whose fields are the settings, checked when it is built.

    Declare each setting as a typed field with a default and its help, and how a value is checked:

    ```python
    @dataclass
    class MySettings(StrategySettings):
        width: int | None = field(default=None, metadata={"help": "tokens per step (None: 4)", "minimum": 1})
        mode: str = field(default="fast", metadata={"help": "...", "choices": ("fast", "exact")})
    ```

    Metadata: ``help`` (the text of the strategy's docstring), ``minimum`` (integers), ``choices`` (a tuple of
    allowed values) and ``check`` (a function of the value that raises ``ValueError``: replaces the check of
    the type). Override :meth:`check` for rules across fields. A bad value raises ``ValueError`` naming the
    setting, before any forward.
    """

    def __post_init__(self):
        types_ = _field_types(type(self))
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name), types_.get(f.name))
        self.check()

    def check(self) -> None:
        """Checks across fields (each field's own check has run before)."""

    @classmethod
    def names(cls) -> list[str]:
        """The settings, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each setting's help text."""
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each setting's default (a field without one is left out)."""
        return {f.name: d for f in dataclasses.fields(cls) if (d := _default(f)) is not dataclasses.MISSING}

    @classmethod
    def unknown(cls, keys) -> list[str]:
        """Those of ``keys`` that are not settings of this class (in their order)."""
        names = set(cls.names())
        return [k for k in keys if k not in names]

    @classmethod
    def from_dict(cls, values: dict, decoding: str | None = None):
        """The settings ``values`` name (the rest at their defaults), checked; an unknown key is refused naming the
        known ones (``decoding``: the strategy's name, for the message)."""
        unknown = sorted(cls.unknown(values))
        if unknown:
            known = sorted(cls.names())
            what = f" for decoding {decoding!r}" if decoding else f" of {cls.__name__}"
            raise ValueError(f"Unknown settings {unknown}{what}{unknown_settings_hint(unknown, known)}; its settings: "
                             f"{', '.join(known)}.")
        return cls(**values)

    def to_dict(self, changed_only: bool = False) -> dict[str, Any]:
        """``{setting: value}``; ``changed_only``: only the settings whose value is not their default."""
        values = {name: getattr(self, name) for name in self.names()}
        if not changed_only:
            return values
        defaults = self.defaults()
        return {k: v for k, v in values.items() if k not in defaults or not _same(v, defaults[k])}

    def with_preset(self, model, decoding: str):
        """``(preset name, settings)``: a copy whose ``None`` values the device preset of ``model`` sets for
        ``decoding`` are filled in (:func:`hf_paralleldecode.hardware_preset`; the values are the preset's and are
        not checked again)."""
        name, values = preset_settings(model, decoding, **self.to_dict())
        resolved = copy.copy(self)
        resolved.__dict__.update(values)
        return name, resolved


def _same(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_TYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _field_types(cls) -> dict[str, tuple[type | None, bool]]:
    """``{field: (the one simple type it is checked as, or None; whether None is allowed)}``, from its annotation."""
    if cls not in _TYPES:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve here (a local type): not checked
            hints = {}
        kinds = {}
        for name, hint in hints.items():
            args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
            rest = [a for a in args if a is not type(None)]
            kinds[name] = (rest[0] if len(rest) == 1 and rest[0] in _TYPE_CHECKS else None, len(rest) < len(args))
        _TYPES[cls] = kinds
    return _TYPES[cls]


def _check_field(f: dataclasses.Field, value, kind: tuple[type | None, bool] | None) -> None:
    simple, optional = kind if kind is not None else (None, True)
    if value is None and optional:
        return
    meta = f.metadata
    if "check" in meta:
        meta["check"](value)
    elif "choices" in meta:
        if value not in meta["choices"]:
            raise ValueError(f"`{f.name}` must be one of {meta['choices']}, got {value!r}.")
    elif simple is not None:
        _TYPE_CHECKS[simple](f.name, value, meta)


# ---- the settings of any strategy ----------------------------------------------------------------------
_SIGNATURE_SETTINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def settings_class(strategy: Callable) -> type[StrategySettings]:
    """The settings class of a strategy callable: the one it was built with (:func:`decoding_strategy`), else a
    class read off its signature (its named parameters beyond what ``generate`` hands every strategy; their
    defaults, no checks: a parameter without a default gets ``None``)."""
    declared = getattr(strategy, "settings_class", None)
    if isinstance(declared, type) and issubclass(declared, StrategySettings):
        return declared
    try:
        return _SIGNATURE_SETTINGS[strategy]
    except (KeyError, TypeError):
        pass
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = [p for p in inspect.signature(strategy).parameters.values()
              if p.kind in named and p.name not in GENERATE_ARGUMENTS and p.name != STREAMER_ARGUMENT]
    name = getattr(strategy, "__name__", type(strategy).__name__)
    cls = dataclasses.make_dataclass(
        f"{name}_settings", [(p.name, Any, field(default=None if p.default is p.empty else p.default))
                             for p in params], bases=(StrategySettings,))
    try:
        _SIGNATURE_SETTINGS[strategy] = cls
    except TypeError:  # not weakly referenceable: read again next time
        pass
    return cls


def takes_streamer(strategy: Callable) -> bool:
    """Whether ``strategy`` takes ``pd_streamer`` (every callable :func:`decoding_strategy` builds does)."""
    if getattr(strategy, "settings_class", None) is not None:
        return True
    return STREAMER_ARGUMENT in inspect.signature(strategy).parameters


# ---- the factory ---------------------------------------------------------------------------------------
@dataclass
class GenerateCall:
    """What ``generate`` handed a strategy besides the model and its settings (see :func:`decoding_strategy`).

    ``name`` is the strategy's; ``pd_streamer`` wins over ``streamer`` (transformers keeps the user's streamer from a
    ``custom_generate`` callable); ``model_kwargs`` are the model inputs (attention mask, cache, ...).
    """

    name: str
    input_ids: Any  # [batch, prompt_len]
    logits_processor: Any
    stopping_criteria: Any
    generation_config: Any
    synced_gpus: bool = False
    streamer: Any = None
    pd_streamer: Any = None
    model_kwargs: dict = field(default_factory=dict)


_STREAMER_HELP = (
    "streamer receiving committed tokens. ``decoding=`` routes ``streamer=`` here; with ``custom_generate=`` pass "
    "``pd_streamer=`` yourself, because transformers does not hand ``streamer`` to ``custom_generate`` callables "
    "(it would only see the prompt).")


def _type_text(f: dataclasses.Field) -> str:
    text = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
    return text.replace("torch.", "").replace("typing.", "")


def _args_section(settings: type[StrategySettings]) -> str:
    entries = [(f.name, _type_text(f), f.metadata.get("help", "")) for f in dataclasses.fields(settings)]
    entries.append((STREAMER_ARGUMENT, "BaseStreamer | None", _STREAMER_HELP))
    lines = ["Args:"]
    for name, kind, text in entries:
        lines += textwrap.wrap(f"{name} ({kind}): {text}", width=116, initial_indent="    ",
                               subsequent_indent="        ", break_on_hyphens=False)
    return "\n".join(lines)


def decoding_strategy(name: str, settings: type[StrategySettings], run: Callable, doc: str = "") -> Callable:
    """Build the ``custom_generate`` callable of a strategy.

    The callable is ``strategy(model, input_ids, logits_processor, stopping_criteria, generation_config,
    synced_gpus=False, streamer=None, *, ..., pd_streamer=None, **model_kwargs)`` with every setting in place of the
    ``...``, keyword-only and at its default: transformers reads that signature to route a call's keyword arguments,
    ``help()`` and the docs show it. It carries ``strategy.settings_class`` and ``strategy.check_settings(values)`` (a
    dict of settings, checked without a model).

    Args:
        name: the strategy's name (``ParallelDecodingOutput.decoding``; register it with
            :func:`hf_paralleldecode.register_decoding` to use ``generate(decoding=name)``).
        settings: its :class:`StrategySettings` subclass.
        run: ``run(model, settings, call)`` decodes: ``settings`` is an instance of ``settings`` built from the
            call's keyword arguments (checked once per call), ``call`` a :class:`GenerateCall` with the rest of
            what ``generate`` handed over; it usually ends with :func:`hf_paralleldecode.engine.run.decode_call`.
        doc: the callable's docstring; an ``Args:`` section listing every setting's help is appended.

    Returns:
        The ``custom_generate`` callable.
    """
    if not (isinstance(settings, type) and issubclass(settings, StrategySettings) and dataclasses.is_dataclass(settings)):
        raise ValueError(f"decoding_strategy({name!r}) needs a StrategySettings dataclass, got {settings!r}.")
    names = settings.names()
    clash = sorted(set(names) & (GENERATE_ARGUMENTS | {STREAMER_ARGUMENT}))
    if clash:
        raise ValueError(f"Settings {clash} of {settings.__name__} are arguments generate hands every strategy.")

    def strategy(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, *, pd_streamer=None, **model_kwargs):
        given = {k: model_kwargs.pop(k) for k in names if k in model_kwargs}
        call = GenerateCall(name, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, pd_streamer, model_kwargs)
        return run(model, settings(**given), call)

    P = inspect.Parameter
    fixed = [P(n, P.POSITIONAL_OR_KEYWORD) for n in
             ("model", "input_ids", "logits_processor", "stopping_criteria", "generation_config")]
    fixed += [P("synced_gpus", P.POSITIONAL_OR_KEYWORD, default=False), P("streamer", P.POSITIONAL_OR_KEYWORD, default=None)]
    try:
        hints = typing.get_type_hints(settings)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: its text
        hints = {}
    declared = [P(f.name, P.KEYWORD_ONLY, default=d if (d := _default(f)) is not dataclasses.MISSING else P.empty,
                  annotation=hints.get(f.name, f.type)) for f in dataclasses.fields(settings)]
    tail = [P(STREAMER_ARGUMENT, P.KEYWORD_ONLY, default=None), P("model_kwargs", P.VAR_KEYWORD)]
    strategy.__signature__ = inspect.Signature(fixed + declared + tail)
    strategy.__name__ = strategy.__qualname__ = name
    strategy.__module__ = getattr(run, "__module__", __name__)
    strategy.__doc__ = f"{inspect.cleandoc(doc)}\n\n{_args_section(settings)}\n" if doc else _args_section(settings)
    strategy.settings_class = settings
    strategy.check_settings = lambda values: settings.from_dict(dict(values), decoding=name)
    return strategy
