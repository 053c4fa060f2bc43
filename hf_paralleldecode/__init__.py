"""hf_paralleldecode: many tokens per forward pass for Hugging Face causal LMs.

``import hf_paralleldecode`` is cheap: submodules (and torch / transformers) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

_LAZY = {
    "enable": "integration",
    "is_enabled": "integration",
    "ParallelDecodingMixin": "integration",
    "register_decoding": "registry",
    "get_decoding": "registry",
    "available_decodings": "registry",
    # the built-in strategies through the registry, which registers them all (the engine's checks read the table)
    "jacobi": "registry",
    "jacobi_forcing": "registry",
    "lookahead": "registry",
    "prompt_lookup": "registry",
    "speculative": "registry",
    "JacobiSettings": "decoding.jacobi",
    "JacobiForcingSettings": "decoding.jacobi_forcing",
    "LookaheadSettings": "decoding.lookahead",
    "PromptLookupSettings": "decoding.prompt_lookup",
    "SpeculativeSettings": "decoding.speculative",
    "StrategySettings": "engine.settings",
    "decoding_strategy": "engine.settings",
    "DraftHead": "drafters.head",
    "DraftHeadConfig": "drafters.head",
    "DiffusionDrafter": "drafters.diffusion",
    "DiffusionDrafterConfig": "drafters.diffusion",
    "export_draft_head": "drafters.export",
    "export_drafter": "drafters.export",
    "Eagle3Drafter": "drafters.eagle3",
    "Eagle3Config": "drafters.eagle3",
    "load_drafter": "drafters.loading",
    "DraftStats": "drafters.base",
    "ParallelDecodingOutput": "engine.run",
    "ParallelDecodingConfig": "config",
    "load_model": "loading",
    "default_model_path": "loading",
    "load_default_model": "loading",
    "load_tokenizer": "loading",
    "hardware_preset": "hardware",
    "set_attention_priority": "attention",
    "attention_priority": "attention",
    "cost_twin": "twins",
    "TwinShape": "twins",
    "TWIN_SHAPES": "twins",
}

__all__ = [
    "DiffusionDrafter",
    "DiffusionDrafterConfig",
    "DraftHead",
    "DraftHeadConfig",
    "DraftStats",
    "Eagle3Config",
    "Eagle3Drafter",
    "JacobiForcingSettings",
    "JacobiSettings",
    "LookaheadSettings",
    "ParallelDecodingConfig",
    "ParallelDecodingMixin",
    "ParallelDecodingOutput",
    "PromptLookupSettings",
    "SpeculativeSettings",
    "StrategySettings",
    "TWIN_SHAPES",
    "TwinShape",
    "__version__",
    "attention_priority",
    "available_decodings",
    "cost_twin",
    "decoding_strategy",
    "default_model_path",
    "enable",
    "export_draft_head",
    "export_drafter",
    "get_decoding",
    "hardware_preset",
    "is_enabled",
    "jacobi",
    "jacobi_forcing",
    "load_default_model",
    "load_drafter",
    "load_model",
    "load_tokenizer",
    "lookahead",
    "prompt_lookup",
    "register_decoding",
    "set_attention_priority",
    "speculative",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hf_paralleldecode' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from .attention import attention_priority, set_attention_priority
    from .config import ParallelDecodingConfig
    from .decoding.jacobi import JacobiSettings, jacobi
    from .decoding.jacobi_forcing import JacobiForcingSettings, jacobi_forcing
    from .decoding.lookahead import LookaheadSettings, lookahead
    from .decoding.prompt_lookup import PromptLookupSettings, prompt_lookup
    from .decoding.speculative import SpeculativeSettings, speculative
    from .drafters.base import DraftStats
    from .drafters.diffusion import DiffusionDrafter, DiffusionDrafterConfig
    from .drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from .drafters.export import export_draft_head, export_drafter
    from .drafters.head import DraftHead, DraftHeadConfig
    from .drafters.loading import load_drafter
    from .engine.run import ParallelDecodingOutput
    from .engine.settings import StrategySettings, decoding_strategy
    from .hardware import hardware_preset
    from .integration import ParallelDecodingMixin, enable, is_enabled
    from .loading import default_model_path, load_default_model, load_model, load_tokenizer
    from .registry import available_decodings, get_decoding, register_decoding
