"""Training: trajectory collection, packing, losses (pure functions) and trl-style trainers."""

from .collators import ConsistencyCollator, ProgressiveCollator
from .losses import ar_loss, consistency_loss, divergence, progressive_consistency_loss
from .trainers import (
    ConsistencyConfig,
    ConsistencyTrainer,
    ProgressiveConsistencyConfig,
    ProgressiveConsistencyTrainer,
)
from .trajectories import collect_trajectories, load_trajectories

__all__ = [
    "ConsistencyCollator",
    "ConsistencyConfig",
    "ConsistencyTrainer",
    "ProgressiveCollator",
    "ProgressiveConsistencyConfig",
    "ProgressiveConsistencyTrainer",
    "ar_loss",
    "collect_trajectories",
    "consistency_loss",
    "divergence",
    "load_trajectories",
    "progressive_consistency_loss",
]
