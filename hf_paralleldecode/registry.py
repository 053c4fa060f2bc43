"""Names of decoding strategies -> ``custom_generate`` callables.

Built-in names (registered when this module is imported): ``"jacobi"``, ``"jacobi_forcing"``,
``"lookahead"`` and ``"speculative"``. Third parties may register their own callables; a strategy
must accept the arguments ``generate`` hands every ``custom_generate`` callable
(:data:`hf_paralleldecode.compat.SAMPLE_ARGUMENTS`).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

from .compat import SAMPLE_ARGUMENTS

__all__ = ["register_decoding", "get_decoding", "available_decodings", "decoding_settings", "unknown_settings_hint"]

#: what ``generate`` hands every strategy itself: not settings a caller passes
GENERATE_ARGUMENTS = frozenset(SAMPLE_ARGUMENTS - {"self"} | {"model"})

_REGISTRY: dict[str, Callable] = {}


def register_decoding(name: str, fn: Callable | None = None, *, overwrite: bool = False):
    """Register ``fn`` under ``name``; usable as a decorator (``@register_decoding("mine")``)."""

    def _register(f: Callable) -> Callable:
        if not isinstance(name, str) or not name:
            raise ValueError(f"A decoding name must be a non-empty string, got {name!r}.")
        if not callable(f):
            raise ValueError(f"A decoding strategy must be callable, got {type(f).__name__}.")
        if name in _REGISTRY and not overwrite and _REGISTRY[name] is not f:
            raise ValueError(f"decoding {name!r} is already registered; pass overwrite=True to replace it.")
        _REGISTRY[name] = f
        return f

    return _register(fn) if fn is not None else _register


def available_decodings() -> list[str]:
    """Sorted names accepted by ``generate(decoding=...)``."""
    return sorted(_REGISTRY)


def get_decoding(name: str) -> Callable:
    """The strategy registered under ``name``; ``ValueError`` listing the available ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown decoding {name!r}. Available decodings: {', '.join(available_decodings())}."
        ) from None


def decoding_settings(decoding: str | Callable) -> list[str]:
    """The settings ``generate(decoding=...)`` takes for a strategy (its name or callable): its named parameters
    beyond what ``generate`` hands every strategy (sorted)."""
    strategy = get_decoding(decoding) if isinstance(decoding, str) else decoding
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return sorted(p.name for p in inspect.signature(strategy).parameters.values()
                  if p.kind in named and p.name not in GENERATE_ARGUMENTS)


def unknown_settings_hint(unknown, known) -> str:
    """`` (did you mean 'x'?)`` for the first of ``unknown`` close to one of ``known``; else ``""``."""
    for key in unknown:
        close = difflib.get_close_matches(key, list(known), n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


def _load_builtins() -> None:
    import sys

    from . import _register_builtin_strategies

    _register_builtin_strategies(sys.modules[__name__])


_load_builtins()

