"""Decoding strategies (``custom_generate`` callables) and the batch policy they share.

Strategies, one module each: ``jacobi``, ``jacobi_forcing``, ``lookahead``, ``prompt_lookup``, ``speculative``
(registered by name in :mod:`hf_paralleldecode.registry`; importable from the top-level package), each with its
settings class (``JacobiSettings``, ...) and its entry point built by :func:`~hf_paralleldecode.decoding_strategy`. They are built
on :mod:`hf_paralleldecode.engine` (the decode loop, cache, target, trees, verification, emission) and, for
``speculative``, on :mod:`hf_paralleldecode.drafters`.

The engine's modules lived here before; their old import paths (``hf_paralleldecode.decoding.tree`` and so on, and
``decoding.base`` for ``engine.run``) still name the same modules. The batch policy is a package,
:mod:`hf_paralleldecode.decoding.policy`; the cost-aware budget's old path ``decoding.budget`` names its
``policy.budget`` module.
"""

import importlib as _importlib
import sys as _sys

from ..engine.run import ParallelDecodingOutput
from .jacobi import jacobi
from .policy import budget

#: old module path (under this package) -> its module in the engine
_MOVED_TO_ENGINE = {"base": "run", "cache": "cache", "target": "target", "support": "support", "tree": "tree",
                    "verify": "verify", "commit": "commit", "processors": "processors", "draft_tree": "draft_tree",
                    "ngram_pool": "ngram_pool"}
for _old, _new in _MOVED_TO_ENGINE.items():
    _sys.modules[f"{__name__}.{_old}"] = _importlib.import_module(f"hf_paralleldecode.engine.{_new}")
_sys.modules[f"{__name__}.budget"] = budget  # (its old path; the policy package holds it now)

__all__ = ["ParallelDecodingOutput", "jacobi"]
