"""Learned drafters: draft heads on the target's hidden states (``head``) and their exports (``export``)."""

from .head import DraftHead, DraftHeadConfig

__all__ = ["DraftHead", "DraftHeadConfig"]
