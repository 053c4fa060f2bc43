"""The batch policy's tuning constants, in one typed object.

The defaults are what the project measured (the JF model and the 1B cost twins on a CPU, the docs' tables); a
test or a user passes another :class:`PolicyTuning` to :class:`~.rule.BatchPolicy` to see what a constant does.

What it deliberately does not know
    How they are used: :mod:`.rule` (the choice and the revisits), :mod:`.times` (the step times).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["PolicyTuning"]


@dataclass(frozen=True)
class PolicyTuning:
    """The constants of :class:`~.rule.BatchPolicy`, each field with its ``help``; checked on construction.

    ``PolicyTuning(margin=0.3)`` keeps every other default.
    """

    decay: float = field(default=0.98, metadata={"help": (
        "Decayed token sums, per row-step: a step of b active rows scales the old sums by decay ** b, and by no less "
        "than step_decay (1.0: every row-step counts alike).")})
    step_decay: float = field(default=0.9, metadata={"help": (
        "The least a step scales the decayed token sums by, however many rows it holds: a step's rows share one "
        "stretch of text, so a large batch's step is not worth a whole history (the JF model's 1B twin at 64 rows "
        "in fp32, decay 0.98 a step: two steps of a chain of 4 at 4.0 tokens a row-step left it valued at 3.1 "
        "from the steps before, and the plain step ran the rest of the call; 0.87x a chain of 2 alone).")})
    prior: float = field(default=1.0, metadata={"help": (
        "Row-steps the prior of the paired token sums is worth: one in which the configured tree commits its whole "
        "depth + 1 and every other shape one token, so one unlucky first step does not lock the tree out and the "
        "others need real evidence to win.")})
    min_samples: int = field(default=2, metadata={"help": (
        "Steps of a shape in a batch-size bucket before its step time is trusted.")})
    window: int = field(default=8, metadata={"help": (
        "The last step times of a shape in a bucket that its estimate is made from (at least min_samples).")})
    max_gap: int = field(default=256, metadata={"help": (
        "The longest gap, in steps, between visits of a configured tree that keeps losing (explore_every doubles "
        "up to it).")})
    explore_share: float = field(default=0.01, metadata={"help": (
        "The share of step time that revisits of a losing configured tree may lose (the exploration budget).")})
    margin_rows: int = field(default=8, metadata={"help": (
        "From this many active rows on, a shape must be predicted `margin` faster than the plain step to be used: "
        "rows that speculate fall out of step, and a batch that keeps its slowest rows runs its last steps nearly "
        "empty, a cost no per-step rate sees.")})
    margin: float = field(default=0.05, metadata={"help": (
        "How much faster than the plain step a shape must be predicted from `margin_rows` rows on (0.05: 5%). The "
        "tail the rows' finishing apart costs is predicted apart (tail_factor); 15% kept the base model's 1B twin "
        "at batch 16 on plain steps (chain of 2 predicted 1.13x, 1.21x run alone).")})
    explore_margin: float = field(default=0.15, metadata={"help": (
        "How much faster than the plain step a shape's floor (its best possible rate) must be, from `margin_rows` "
        "rows on, for the shape to be measured at all: there a losing step costs several plain steps (the 8.4M "
        "models at batch 64 measured a chain of 8 with 5%: 0.96x stock).")})
    tree_margin: float = field(default=0.05, metadata={"help": (
        "How much faster than the configured tree a chain must be predicted to replace it: its tokens are read off "
        "the tree's steps (the accepted path along first children), which flatters it a little (base model's 1B "
        "twin, batch 1: 0.65 of the tree's tokens predicted, 0.61 run alone).")})
    decisive: float = field(default=2.0, metadata={"help": (
        "A losing configured tree that would win by this factor at the fastest step time it ever took in the bucket "
        "is revisited at its gaps without the budget: only a time measured under worse conditions (another "
        "process's burst) keeps it out.")})
    stale: float = field(default=1.5, metadata={"help": (
        "A step this many times faster than its shape's estimate replaces the shape's window in its bucket: the "
        "window was measured under conditions that have passed (another process's burst, a warm-up).")})
    explore_after: int = field(default=3, metadata={"help": (
        "From `margin_rows` rows, once the plain step is timed in the bucket, the steps of a call before a new "
        "speculating shape is measured or the tree revisited (0: from its first step): a call's first steps draft "
        "the least predictable text, so counts read there value every speculating shape low (the 8.4M JF model at "
        "16 rows: a chain of 4 commits 2.1 tokens a row-step on a call's first step, 4.3-4.6 from its sixth).")})

    def __post_init__(self):
        def bad(name, need):
            raise ValueError(f"PolicyTuning.{name} must be {need}, got {getattr(self, name)!r}: "
                             f"{self.help(name)} (default {PolicyTuning.__dataclass_fields__[name].default!r}).")

        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "explore_after" else 1
            if f.type in (int, "int") and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                bad(f.name, f"an integer >= {least}")
            if f.type in (float, "float") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                               or not value >= 0):
                bad(f.name, "a number >= 0")
        if not 0 < self.decay <= 1:
            bad("decay", "in (0, 1]")
        if not 0 < self.step_decay <= 1:
            bad("step_decay", "in (0, 1]")
        if self.prior <= 0:
            bad("prior", "> 0")
        if self.window < self.min_samples:
            bad("window", f"at least min_samples ({self.min_samples}), or no shape's time is ever trusted")
        if self.explore_margin < self.margin:
            bad("explore_margin", f"at least margin ({self.margin}): a shape measured on a smaller hope than its use "
                "needs is measured in vain")
        if self.decisive < 1:
            bad("decisive", ">= 1")
        if self.stale < 1:
            bad("stale", ">= 1")

    @classmethod
    def help(cls, name: str) -> str:
        """The ``help`` of field ``name``."""
        return cls.__dataclass_fields__[name].metadata["help"]
