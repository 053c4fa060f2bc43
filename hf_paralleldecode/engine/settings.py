"""Strategy settings, declared once, and the one factory that turns a strategy into a ``custom_generate`` callable.

What it is for
    A strategy declares its settings as a :class:`StrategySettings` dataclass, in the style of trl's configs:
    typed fields with defaults and ``field(metadata={"help": ...})``. Each field's check is its declaration:
    its type (``int``, ``float``, ``bool``, ``str``, any class, a union of them, a ``Literal``; ``X | None`` lets
    ``None`` through, which for most settings means "the device preset") plus the metadata ``minimum``,
    ``maximum``, ``choices`` or ``check``; a class adds checks across fields in :meth:`StrategySettings.check`.
    Building the settings runs every check, once.

    A size setting also carries a ``bound`` (a :class:`SizeBound`) derived from the call (:class:`CallLimits`:
    its ``max_new_tokens``, its length, the model's positions and vocabulary): the callable checks it once per
    call, before the prefill. A value larger than what the call can use is lowered to that (every strategy is
    lossless: only the speed changes); a value larger than any call of the model can use is refused.

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
import logging
import sys
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
           "GENERATE_ARGUMENTS", "unknown_settings_hint", "check_int_setting", "check_bool_setting", "CallLimits",
           "SizeBound", "model_positions", "NEW_TOKENS", "NGRAM_TOKENS", "CALL_LENGTH", "STEP_TOKENS", "TREE_LEVELS",
           "VOCAB", "SEED_MAX", "INT_MAX"]

logger = logging.getLogger(__name__)

#: what ``generate`` hands every strategy itself: not settings a caller passes
GENERATE_ARGUMENTS = frozenset(SAMPLE_ARGUMENTS - {"self"} | {"model"})
#: the streamer ``generate(decoding=...)`` hands a strategy that takes it (``integration.py``): not a setting either
STREAMER_ARGUMENT = "pd_streamer"

#: registered strategies by name (``hf_paralleldecode.registry`` owns the rules and registers the built-in ones)
STRATEGIES: dict[str, Callable] = {}


# ---- checks of one value ------------------------------------------------------------------------------
#: the largest integer an ``int`` setting takes when its field sets no ``maximum`` (int64: a larger one would
#: overflow the first tensor it meets, after the prefill)
INT_MAX = 2**63 - 1
#: the largest seed ``torch.Generator.manual_seed`` takes
SEED_MAX = 2**64 - 1
_MAXIMUM_WHY = {INT_MAX: "2**63 - 1, the largest int64",
                SEED_MAX: "2**64 - 1, the largest seed torch.Generator.manual_seed takes"}


def check_int_setting(name: str, value, minimum: int | None, maximum: int | None = None) -> int:
    """Validate an integer setting (bools and floats are refused) and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"`{name}` must be an integer{bound}, got {value!r} ({type(value).__name__}).")
    _check_range(name, value, minimum, maximum)
    return value


def _check_range(name: str, value, minimum, maximum) -> None:
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        why = _MAXIMUM_WHY.get(maximum)
        raise ValueError(f"`{name}` must be <= {maximum}{f' ({why})' if why else ''}, got {value}.")


def check_bool_setting(name: str, value) -> bool:
    """Validate a True/False setting and return it."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return value


def _check_number(name: str, value, minimum=None, maximum=None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a number, got {value!r}.")
    _check_range(name, value, minimum, maximum)


def _check_str(name: str, value) -> None:
    if not isinstance(value, str):
        raise ValueError(f"`{name}` must be a string, got {value!r}.")


#: the check a field's type implies (``minimum`` and ``maximum`` apply to numbers; an integer's default maximum is
#: :data:`INT_MAX`)
_TYPE_CHECKS = {
    bool: lambda name, value, meta: check_bool_setting(name, value),
    int: lambda name, value, meta: check_int_setting(name, value, meta.get("minimum"), meta.get("maximum", INT_MAX)),
    float: lambda name, value, meta: _check_number(name, value, meta.get("minimum"), meta.get("maximum")),
    str: lambda name, value, meta: _check_str(name, value),
}


def _type_name(kind) -> str:
    name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _instance_check(kinds: tuple):
    """The check of a field typed as classes (``Path``, ``int | float``, ``Drafter | str``): an instance of one of
    them (a bool is not an int unless ``bool`` is listed; an int is a float), within ``minimum`` / ``maximum``."""
    classes = tuple(typing.get_origin(k) or k for k in kinds)
    if float in classes and int not in classes:
        classes += (int,)
    names = " or ".join(_type_name(k) for k in kinds)

    def check(name, value, meta):
        try:
            instance = isinstance(value, classes)
        except TypeError:  # a class isinstance cannot test (a protocol that is not runtime-checkable): not checked
            return
        if not instance or (isinstance(value, bool) and bool not in classes):
            raise ValueError(f"`{name}` must be {names}, got {value!r} ({type(value).__name__}).")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _check_range(name, value, meta.get("minimum"),
                         meta.get("maximum", INT_MAX if isinstance(value, int) and int in classes else None))

    return check


def unknown_settings_hint(unknown, known) -> str:
    """`` (did you mean 'x'?)`` for the first of ``unknown`` close to one of ``known``; else ``""`` (a key that is
    not a string has no close match)."""
    for key in unknown:
        if not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, list(known), n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


# ---- bounds from the call ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CallLimits:
    """What one ``generate`` call can use, for the size settings' bounds (:class:`SizeBound`); built once per call,
    before the prefill (:meth:`of`)."""

    model: str  # the model's class name, for messages
    max_new_tokens: int  # the tokens the call may generate
    length: int  # prompt (padding included) + max_new_tokens: the call's max_length
    positions: int | None = None  # the model's positions (max_position_embeddings / n_positions); None: unknown
    vocab: int | None = None  # the tokens the model's head scores

    @classmethod
    def of(cls, model, input_ids, generation_config) -> CallLimits | None:
        """The limits of a call (``None`` when the call has no resolved ``max_length``: nothing is bounded)."""
        max_length = getattr(generation_config, "max_length", None)
        if max_length is None or input_ids is None:
            return None
        prompt = int(input_ids.shape[-1])
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        rows = getattr(getattr(head, "weight", None), "shape", None)
        if rows:
            vocab = max(int(rows[0]), int(vocab or 0))
        return cls(type(model).__name__, max(int(max_length) - prompt, 0), max(int(max_length), prompt),
                   model_positions(model), int(vocab) if vocab else None)


def model_positions(model) -> int | None:
    """The positions ``model`` declares (its text config's ``n_positions`` or ``max_position_embeddings``), or
    ``None`` when it declares none."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None)
    return int(positions) if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


@dataclass(frozen=True)
class SizeBound:
    """A size setting's upper bound, derived from the call: a field's ``bound`` metadata.

    ``cap(limits)``: what the call can use; a larger value is lowered to it for the call (every strategy is lossless,
    so the output does not change; ``output.stats`` records the value used). ``limit(limits)``: more than any call of
    the model can use, refused with a ``ValueError`` naming the setting (default: the larger of the cap and the
    model's positions; no refusal when the model declares no positions). ``counts``: what the setting counts, and
    ``cap_text`` / ``limit_text`` what the cap and the limit are, for the messages.
    """

    counts: str
    cap: Callable[[CallLimits], int | None] | None = None
    cap_text: str = ""
    limit: Callable[[CallLimits], int | None] | None = None
    limit_text: str = "{model} has {limit} positions (max_position_embeddings)"

    def apply(self, name: str, value: int, minimum: int | None, limits: CallLimits) -> int:
        """``value``, lowered to the cap; ``ValueError`` above the limit."""
        cap = self.cap(limits) if self.cap is not None else None
        if cap is not None and minimum is not None:
            cap = max(cap, minimum)
        if self.limit is not None:
            limit = self.limit(limits)
        else:
            limit = max(cap or 0, limits.positions) if limits.positions is not None else None
        if limit is not None and value > limit:
            what = self.limit_text.format(model=limits.model, limit=limit)
            fix = (f"Pass {name} <= {cap} ({self.cap_text}: {cap}); a value up to {limit} is lowered to it."
                   if cap is not None and cap < limit else f"Pass {name} <= {limit}.")
            raise ValueError(f"`{name}`={value} is more than any call of {limits.model} can use: {self.counts}, and "
                             f"{what}. {fix}")
        if cap is not None and value > cap:
            logger.info("`%s`=%s is more than this call can use (%s: %s): lowered to %s.", name, value,
                        self.cap_text, cap, cap)
            return cap
        return value


#: tokens of the generation (a block, a window's columns, a continuation, a tree's levels): at most max_new_tokens
NEW_TOKENS = SizeBound("it counts tokens of the generation", cap=lambda c: c.max_new_tokens,
                       cap_text="this call's max_new_tokens")
#: an n-gram: a key token and tokens of the generation after it
NGRAM_TOKENS = SizeBound("an n-gram is a key token and tokens of the generation after it",
                         cap=lambda c: c.max_new_tokens + 1, cap_text="this call's max_new_tokens + 1")
#: what is found in the prompt and the generation (n-gram lengths, matches, stored continuations)
CALL_LENGTH = SizeBound("it counts what the prompt and the generation hold (tokens, n-grams, matches)",
                        cap=lambda c: c.length, cap_text="this call's prompt + max_new_tokens")
#: the tokens one forward feeds per row (a tree's nodes, a step's waves): at most the model's positions, not capped
STEP_TOKENS = SizeBound("one verification forward would feed that many tokens per row")
#: a tree's levels below the root (a deeper level than the call generates is cut per row, so not capped): at most
#: the model's positions
TREE_LEVELS = SizeBound("it counts levels below the root, each a token of the generation")
#: children per node: at most one per token of the vocabulary
VOCAB = SizeBound("a node has at most one child per token of the vocabulary", limit=lambda c: c.vocab,
                  limit_text="{model} scores {limit} tokens")


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

    Metadata: ``help`` (the text of the strategy's docstring), ``minimum`` and ``maximum`` (numbers; an integer's
    maximum is :data:`INT_MAX` unless set; a seed's is :data:`SEED_MAX`), ``choices`` (a tuple of allowed values;
    a ``Literal`` type gives them too), ``check`` (a function of the value that raises ``ValueError``: replaces the
    check of the type) and ``bound`` (a :class:`SizeBound`: what a call can use, see :meth:`for_call`). Override
    :meth:`check` for rules across fields. A bad value raises ``ValueError`` naming the setting, before any forward.
    The class must be decorated with ``@dataclass`` (:func:`decoding_strategy` refuses it otherwise).
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
        what = f" for decoding {decoding!r}" if decoding else f" of {cls.__name__}"
        if not isinstance(values, dict):
            raise ValueError(f"The settings{what} must be a dict of {{name: value}}, got {type(values).__name__}.")
        named = [k for k in values if not isinstance(k, str)]
        if named:
            raise ValueError(f"Setting names are strings, got {named[0]!r} ({type(named[0]).__name__}) in the settings"
                             f"{what}; its settings: {', '.join(sorted(cls.names()))}.")
        unknown = sorted(cls.unknown(values))
        if unknown:
            known = sorted(cls.names())
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

    def for_call(self, limits: CallLimits | None, names=None):
        """These settings for a call of ``limits``: a copy whose size settings (fields with a ``bound``; ``names``:
        only those, the ones the call passed) above what the call can use are lowered to it, or ``ValueError``
        naming the setting when a value is more than any call of the model can use. ``self`` when nothing changes."""
        if limits is None:
            return self
        changed = {}
        for f in dataclasses.fields(self):
            bound = f.metadata.get("bound")
            value = getattr(self, f.name)
            if bound is None or (names is not None and f.name not in names) or isinstance(value, bool) \
                    or not isinstance(value, int):
                continue
            used = bound.apply(f.name, value, f.metadata.get("minimum"), limits)
            if used != value:
                changed[f.name] = used
        if not changed:
            return self
        bounded = copy.copy(self)
        bounded.__dict__.update(changed)
        return bounded

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


def _field_types(cls) -> dict[str, tuple[Callable | None, bool]]:
    """``{field: (the check its type implies, or None; whether None is allowed)}``, from its annotation."""
    if cls not in _TYPES:
        _TYPES[cls] = {name: _type_check(hint) for name, hint in _hints(cls).items()}
    return _TYPES[cls]


def _hints(cls) -> dict[str, Any]:
    """Each field's resolved annotation; one that does not resolve here (a local type) is left out (not checked)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - resolve field by field, keeping those that do
        pass
    hints = {}
    for klass in reversed(cls.__mro__):
        module = vars(sys.modules.get(klass.__module__, object))
        for name, hint in vars(klass).get("__annotations__", {}).items():
            try:
                hints[name] = eval(hint, dict(module), dict(vars(klass))) if isinstance(hint, str) else hint
            except Exception:  # noqa: BLE001 - not resolvable here: not checked
                hints.pop(name, None)
    return hints


def _type_check(hint) -> tuple[Callable | None, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
    else:
        args = (hint,)
    rest = [a for a in args if a is not type(None)]
    optional = len(rest) < len(args)
    if len(rest) == 1 and rest[0] in _TYPE_CHECKS:
        return _TYPE_CHECKS[rest[0]], optional
    if len(rest) == 1 and typing.get_origin(rest[0]) is typing.Literal:
        choices = typing.get_args(rest[0])
        return (lambda name, value, meta: _check_choices(name, value, choices)), optional
    if rest and all(isinstance(typing.get_origin(a) or a, type) and a is not typing.Any for a in rest):
        return _instance_check(tuple(rest)), optional
    return None, optional  # Any, a type variable, a Literal among others: not checked


def _check_choices(name: str, value, choices) -> None:
    if not any(_same_choice(value, c) for c in choices):
        raise ValueError(f"`{name}` must be one of {tuple(choices)}, got {value!r}.")


def _same_choice(value, choice) -> bool:
    try:  # True is not the choice 1, nor 1 the choice True
        return bool(value == choice) and isinstance(value, bool) == isinstance(choice, bool)
    except Exception:  # noqa: BLE001 - a value that does not compare (a tensor): not a choice
        return False


def _check_field(f: dataclasses.Field, value, kind: tuple[Callable | None, bool] | None) -> None:
    check, optional = kind if kind is not None else (None, True)
    if value is None and optional:
        return
    meta = f.metadata
    if "check" in meta:
        meta["check"](value)
    elif "choices" in meta:
        _check_choices(f.name, value, meta["choices"])
    elif check is not None:
        check(f.name, value, meta)


def _undeclared_settings(cls) -> tuple[type, list[str]] | None:
    """``(class, names)``: a class between ``cls`` and :class:`StrategySettings` that is not itself a dataclass but
    declares values (annotations, class attributes), which then are not settings; ``None`` when there is none (a
    subclass that only overrides :meth:`~StrategySettings.check` needs no decorator)."""
    for klass in cls.__mro__:
        if klass is StrategySettings or not issubclass(klass, StrategySettings):
            continue
        if "__dataclass_fields__" in vars(klass):  # decorated
            continue
        own = set(vars(klass).get("__annotations__", {}))
        own |= {n for n, v in vars(klass).items() if not n.startswith("_") and not callable(v)
                and not isinstance(v, (classmethod, staticmethod, property))}
        if own:
            return klass, sorted(own)
    return None


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
    undeclared = _undeclared_settings(settings)
    if undeclared:
        klass, names_ = undeclared
        raise ValueError(f"decoding_strategy({name!r}): {klass.__name__} declares {names_} but is not a dataclass, so "
                         f"they would not be settings (the strategy would silently have none of them). Decorate "
                         f"{klass.__name__} with @dataclass (from dataclasses import dataclass).")
    names = settings.names()
    clash = sorted(set(names) & (GENERATE_ARGUMENTS | {STREAMER_ARGUMENT}))
    if clash:
        raise ValueError(f"Settings {clash} of {settings.__name__} are arguments generate hands every strategy.")

    def strategy(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, *, pd_streamer=None, **model_kwargs):
        given = {k: model_kwargs.pop(k) for k in names if k in model_kwargs}
        call = GenerateCall(name, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, pd_streamer, model_kwargs)
        # every check of the settings, then their bounds from this call: before the prefill
        built = settings(**given).for_call(CallLimits.of(model, input_ids, generation_config), given)
        return run(model, built, call)

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
