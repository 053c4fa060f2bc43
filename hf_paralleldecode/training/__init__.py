"""Training: trajectory collection, regenerated data, packing, losses (pure functions), trl-style trainers, and the
recipe methods they register (:mod:`.methods`).

The trainer modules are imported here, in one place: each registers its recipe methods when it loads, in the order
below (the order ``hf-paralleldecode train`` lists them).
"""

# isort: off
from .trainers import (
    ConsistencyConfig,
    ConsistencyTrainer,
    ProgressiveConsistencyConfig,
    ProgressiveConsistencyTrainer,
)
from .draft_head import DraftHeadCollator, DraftHeadDistillationConfig, DraftHeadDistillationTrainer
from .diffusion_alignment import DiffusionAlignmentCollator, DiffusionAlignmentConfig, DiffusionAlignmentTrainer
from .eagle3 import Eagle3Collator, Eagle3DistillationConfig, Eagle3DistillationTrainer
# isort: on
from .collators import ConsistencyCollator, ProgressiveCollator
from .losses import (
    ar_loss,
    consistency_loss,
    diffusion_alignment_loss,
    divergence,
    draft_distillation_loss,
    position_weights,
    progressive_consistency_loss,
)
from .methods import TRAINING_METHODS, TrainingMethod, register_training_method
from .regenerate import load_regenerated, regenerate
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
    "TRAINING_METHODS",
    "TrainingMethod",
    "register_training_method",
]
