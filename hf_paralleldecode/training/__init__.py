"""Training: losses (pure functions) now; trajectory collection, packing and trainers build on them."""

from .losses import ar_loss, consistency_loss, divergence, progressive_consistency_loss

__all__ = ["ar_loss", "consistency_loss", "divergence", "progressive_consistency_loss"]
