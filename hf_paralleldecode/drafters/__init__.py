"""Learned drafters: the contract every kind implements (``base``, ``context``), the built-in kinds (draft heads on
the target's hidden states ``head``, EAGLE-3 ``eagle3``, masked-diffusion drafters ``diffusion``: DEER), reading
(``formats``, ``loading``) and exporting (``export``) their checkpoints.

The built-in kinds are imported here, in one place: each registers itself (its formats and exports) when its module
loads, so whatever reaches the package finds them. They register in this order, which is the order
:func:`~.loading.load_drafter` asks their formats.
"""

# isort: off
from .diffusion import DiffusionDrafter, DiffusionDrafterConfig
from .head import DraftHead, DraftHeadConfig
from .eagle3 import Eagle3Config, Eagle3Drafter
# isort: on

__all__ = ["DiffusionDrafter", "DiffusionDrafterConfig", "DraftHead", "DraftHeadConfig", "Eagle3Config",
           "Eagle3Drafter"]
