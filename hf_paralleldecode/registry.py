"""Names of decoding strategies -> ``custom_generate`` callables.

Built-in names (registered when this module is imported): ``"jacobi"``, ``"jacobi_forcing"``, ``"lookahead"``,
``"prompt_lookup"`` and ``"speculative"``. Third parties may register their own callables: one built by
:func:`hf_paralleldecode.decoding_strategy` from a settings class, or any callable that accepts the arguments
``generate`` hands every ``custom_generate`` callable (:data:`hf_paralleldecode.compat.SAMPLE_ARGUMENTS`), whose
signature is then its settings' schema. A strategy's settings are its settings class
(:func:`settings_class`): the registry, ``enable()``'s ``generate``, the saved configs, the bench and ``tune`` read
it.
"""

from __future__ import annotations

from collections.abc import Callable

from .decoding.jacobi import jacobi
from .decoding.jacobi_forcing import jacobi_forcing
from .decoding.lookahead import lookahead
from .decoding.prompt_lookup import prompt_lookup
from .decoding.speculative import speculative
from .engine.settings import GENERATE_ARGUMENTS, STRATEGIES, StrategySettings, unknown_settings_hint
from .engine.settings import settings_class as _settings_class

__all__ = ["register_decoding", "get_decoding", "available_decodings", "decoding_settings", "settings_class",
           "unknown_settings_hint", "GENERATE_ARGUMENTS"]

#: the table (it lives in the engine, whose checks read it: ``engine/settings.py``)
_REGISTRY = STRATEGIES


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


def settings_class(decoding: str | Callable) -> type[StrategySettings]:
    """The settings class of a strategy (its name or callable): the one it was built with, or for a callable
    registered without one, a class read off its signature."""
    return _settings_class(get_decoding(decoding) if isinstance(decoding, str) else decoding)


def decoding_settings(decoding: str | Callable) -> list[str]:
    """The settings ``generate(decoding=...)`` takes for a strategy (its name or callable), sorted."""
    return sorted(settings_class(decoding).names())


for _strategy in (jacobi, prompt_lookup, speculative, jacobi_forcing, lookahead):
    register_decoding(_strategy.__name__, _strategy, overwrite=True)
