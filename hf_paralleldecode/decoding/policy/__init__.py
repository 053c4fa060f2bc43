"""The batch policy: each step, how much of its tree the whole batch feeds, from measured committed tokens per second.

Modules, bottom up (none imports a strategy or the engine's loop):

* :mod:`.shapes`: the shapes a step may take (:class:`Shape`, :func:`shapes_from`) and what a chain would have
  accepted on a step of the configured tree (:func:`first_child_prefix`);
* :mod:`.tuning`: the rule's constants, one typed :class:`PolicyTuning`;
* :mod:`.times`: each shape's measured step times per batch-size bucket (:class:`StepTimes`), read on a clock;
* :mod:`.memory`: what is learned, kept on its owner for the next call (:class:`PolicyMemory`, :func:`memory_of`),
  and the target model's clock;
* :mod:`.tail`: what a static batch loses to rows that finish apart;
* :mod:`.budget`: the cost-aware node budget (``cost_aware=True``), driven by the policy;
* :mod:`.rule`: the choice (:class:`BatchPolicy`) and the policy of a call (:func:`batch_policy`).
"""

from .budget import (
    MEASURED_TOKENS,
    AcceptanceModel,
    CostAwareBudget,
    ForwardCost,
    ForwardTimes,
    forward_cost,
    time_forwards,
)
from .memory import PolicyMemory, acceptance_rule, memory_of, memory_scope, target_key
from .rule import BatchPolicy, batch_policy, check_policy_settings
from .shapes import CHAIN_DEPTHS, PLAIN, Shape, first_child_prefix, path_prefix, shapes_from
from .tail import expected_max, tail_factor
from .times import Clock, StepTimes
from .tuning import PolicyTuning

__all__ = ["Shape", "BatchPolicy", "shapes_from", "first_child_prefix", "path_prefix", "PLAIN", "CHAIN_DEPTHS",
           "target_key", "acceptance_rule", "batch_policy", "check_policy_settings", "PolicyTuning", "PolicyMemory",
           "memory_of", "memory_scope", "Clock", "StepTimes", "expected_max", "tail_factor", "CostAwareBudget",
           "ForwardCost", "AcceptanceModel", "forward_cost", "time_forwards", "ForwardTimes",
           "MEASURED_TOKENS"]
