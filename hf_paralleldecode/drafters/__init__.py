"""Learned drafters: draft heads on the target's hidden states (``head``), their exports (``export``) and
masked-diffusion drafters (``diffusion``, DEER)."""

from .diffusion import DiffusionDrafter, DiffusionDrafterConfig
from .head import DraftHead, DraftHeadConfig

__all__ = ["DiffusionDrafter", "DiffusionDrafterConfig", "DraftHead", "DraftHeadConfig"]
