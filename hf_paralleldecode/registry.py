"""Names of decoding strategies -> ``custom_generate`` callables.

Built-in names (registered when this module is imported): ``"jacobi"``, ``"jacobi_forcing"``,
``"lookahead"`` and ``"speculative"``. Third parties may register their own callables; a strategy
must accept the arguments of ``GenerationMixin._sample``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_decoding", "get_decoding", "available_decodings"]

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


def _load_builtins() -> None:
    import sys

    from . import _register_builtin_strategies

    _register_builtin_strategies(sys.modules[__name__])


_load_builtins()

