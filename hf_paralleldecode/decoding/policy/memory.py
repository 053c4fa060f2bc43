"""What the batch policy and its node budget learn, kept by the object that learned it for its next calls.

One :class:`PolicyMemory` per owner, made on first use (:func:`memory_of`) and kept on the owner itself, so it lives
and dies with it and never crosses to another object:

* the target **model** owns the memory of the strategies that draft from the model alone (``jacobi``,
  ``jacobi_forcing``, ``lookahead``, ``prompt_lookup``), its measured forward-cost curves (:func:`~.budget.forward_cost`)
  and the **clock** its calls are timed with;
* a **drafter** owns what the policy and the node budget learn of it (``speculative``), per target model
  (:func:`target_key`): a drafter shared by a model and its cost twin learns each one's step times apart.

Inside a memory, entries are keyed by what must match for them to carry over: the strategy, device, dtype, shapes
and acceptance rule (:func:`acceptance_rule`); a call with another key starts afresh. A copy of the owner (pickle,
``copy.deepcopy``, a drafter's ``copy_to``) starts with an empty memory of its own.

Scopes
    Inside ``with memory_scope(name):`` every owner's memory is another one, kept per ``name`` in the owner's
    memory (:meth:`PolicyMemory.scope`; its clock, token and forward-cost points are the owner's, which are facts of
    the device, not learned choices): calls learn only from calls in the same scope. A benchmark runs each setting
    of one drafter in its own scope, so ``max_step_tokens=1`` (the same key as the default's) does not refresh the
    default's step times, and each entry measures what a process running that setting alone would see. The scope
    is a context variable: a ``generate`` started in another thread inside the ``with`` does not see it (start the
    thread's work in its own ``with``).

What it deliberately does not know
    What the entries mean: :class:`~.rule.BatchPolicy` and :class:`~.budget.CostAwareBudget` write and read them.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import uuid
from collections.abc import Iterator

from .times import Clock

__all__ = ["PolicyMemory", "memory_of", "memory_scope", "target_key", "acceptance_rule"]

_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("hfpd_policy_memory_scope", default=None)


class PolicyMemory:
    """What one owner (a model or a drafter) learned in its calls, and the clock its calls are timed with.

    Attributes:
        clock: read by the batch policy (step times), its node budget (host time per step) and
            :func:`~.budget.forward_cost` (the forward-cost probe) of calls on this model (``time.perf_counter``;
            set a fake one to run a model's calls on a clock of your own). A drafter's is not read: a call is timed
            by its target model's clock.
        policy: per key, the measurements of the owner's last :class:`~.rule.BatchPolicy` under it.
        acceptance: per name, the acceptance counts of the owner's last :class:`~.budget.CostAwareBudget`.
        forward_costs: a model's measured forward-cost points, per probe (device, dtype, sizes).
        token: names the owner in other owners' keys (:func:`target_key`).
        scopes: per :func:`memory_scope` name, the owner's memory in that scope (:meth:`scope`).
    """

    def __init__(self, clock: Clock | None = None):
        self.clock: Clock = clock if clock is not None else time.perf_counter
        self.policy: dict = {}
        self.acceptance: dict = {}
        self.forward_costs: dict = {}
        self.token = uuid.uuid4().hex
        self.scopes: dict[str, PolicyMemory] = {}

    def scope(self, name: str) -> PolicyMemory:
        """The memory of scope ``name`` (made on first use): its own ``policy`` and ``acceptance``; ``clock``,
        ``token`` and ``forward_costs`` read and write this one's."""
        scoped = self.scopes.get(name)
        if scoped is None:
            scoped = self.scopes[name] = _ScopedMemory(self)
        return scoped

    def forget(self) -> None:
        """Drop everything learned, every scope's included (the clock stays)."""
        self.policy.clear()
        self.acceptance.clear()
        self.forward_costs.clear()
        self.scopes.clear()

    def __reduce__(self):
        # a copy of the owner (pickle, deepcopy, torch.save) is another object: it starts afresh, on the wall clock
        return PolicyMemory, ()

    def __repr__(self) -> str:
        return (f"PolicyMemory(policy entries={len(self.policy)}, acceptance entries={len(self.acceptance)}, "
                f"forward costs={len(self.forward_costs)})")


class _ScopedMemory(PolicyMemory):
    """An owner's memory in one :func:`memory_scope`: learned entries of its own, the device facts of ``base``."""

    def __init__(self, base: PolicyMemory):  # (PolicyMemory.__init__ would set the base's clock and token)
        self.base = base
        self.policy = {}
        self.acceptance = {}
        self.scopes = {}

    clock = property(lambda self: self.base.clock, lambda self, value: setattr(self.base, "clock", value))
    token = property(lambda self: self.base.token)
    forward_costs = property(lambda self: self.base.forward_costs)

    def scope(self, name: str) -> PolicyMemory:
        return self.base.scope(name)

    def forget(self) -> None:
        """Drop what this scope learned."""
        self.policy.clear()
        self.acceptance.clear()


def memory_of(owner) -> PolicyMemory:
    """``owner``'s :class:`PolicyMemory` (a model, a drafter: any object with a ``__dict__``), made and set on it on
    first use; inside :func:`memory_scope`, its memory of that scope (:meth:`PolicyMemory.scope`)."""
    memory = vars(owner).get("_hfpd_policy_memory")
    if memory is None:
        memory = PolicyMemory()
        owner._hfpd_policy_memory = memory
    scope = _SCOPE.get()
    return memory if scope is None else memory.scope(scope)


@contextlib.contextmanager
def memory_scope(name: str) -> Iterator[None]:
    """Calls inside learn from, and leave what they learn to, every owner's memory of scope ``name`` only (module
    docstring): ``with memory_scope("max_step_tokens=1"): model.generate(...)``. Scopes do not nest: the inner one
    holds until it ends."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"memory_scope takes a non-empty name (a str), got {name!r}.")
    token = _SCOPE.set(name)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def target_key(model) -> str:
    """A token naming one target model instance in the keys of a drafter's memory (kept in the model's memory: an
    ``id`` could be reused by a later model)."""
    return memory_of(model).token


def acceptance_rule(generation_config, logits_processor) -> tuple:
    """What decides how much of a tree is accepted besides the text: greedy or sampled, and the processors with their
    scalar settings (a temperature, a top-k, a repetition penalty). Calls that differ in it do not share measurements:
    the same drafter that commits five tokens per step greedily commits one or two at temperature 0.8."""
    processors = tuple(
        (type(p).__name__, tuple(sorted((k, v) for k, v in vars(p).items() if isinstance(v, (bool, int, float, str)))))
        for p in (logits_processor or ()))
    return bool(generation_config.do_sample), processors
