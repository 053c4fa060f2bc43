"""Training: trajectory collection, regenerated data, packing, losses (pure functions) and trl-style trainers."""

from .collators import ConsistencyCollator, ProgressiveCollator
from .diffusion_alignment import DiffusionAlignmentCollator, DiffusionAlignmentConfig, DiffusionAlignmentTrainer
from .draft_head import DraftHeadCollator, DraftHeadDistillationConfig, DraftHeadDistillationTrainer
from .eagle3 import Eagle3Collator, Eagle3DistillationConfig, Eagle3DistillationTrainer
from .losses import (
    ar_loss,
    consistency_loss,
    diffusion_alignment_loss,
    divergence,
    draft_distillation_loss,
    position_weights,
    progressive_consistency_loss,
)
from .regenerate import load_regenerated, regenerate
from .trainers import (
    ConsistencyConfig,
    ConsistencyTrainer,
    ProgressiveConsistencyConfig,
    ProgressiveConsistencyTrainer,
)
from .trajectories import collect_trajectories, load_trajectories

__all__ = [
    "DiffusionAlignmentCollator",
    "DiffusionAlignmentConfig",
    "DiffusionAlignmentTrainer",
    "diffusion_alignment_loss",
    "ConsistencyCollator",
    "DraftHeadCollator",
    "DraftHeadDistillationConfig",
    "DraftHeadDistillationTrainer",
    "Eagle3Collator",
    "Eagle3DistillationConfig",
    "Eagle3DistillationTrainer",
    "draft_distillation_loss",
    "load_regenerated",
    "position_weights",
    "regenerate",
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
