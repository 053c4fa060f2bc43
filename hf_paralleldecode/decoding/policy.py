"""The batch's tree shape per step: committed tokens per second predicted from paired acceptance and step times.

Why
    What pays depends on the batch: at batch 1 a wide tree with context matches is nearly free (a forward
    of 21 tokens costs about what one token costs), while at batch 16 on a CPU the same tree costs 16 x 21
    tokens plus a drafter forward over 16 rows and the host work of 16 trees, and a short chain commits
    more tokens per second. No fixed setting is right for every batch.

The rule
    :class:`ShapePolicy` holds a few *shapes*: the configured tree, chains (one child per node, no
    context matches) of at most 8, 4 and 2 levels, and a plain step that drafts nothing (no drafter
    forward; the drafter catches up on the committed tokens at its next forward) (:func:`shapes_from`). Each step it picks the shape with the
    highest predicted rate for the active rows ``b``::

        rate(shape) = b * tokens(shape) / seconds(shape, b)

    * ``tokens(shape)``, committed tokens per row and step, is compared *paired*: on every step that ran
      the configured tree, the tokens each chain would have committed are read off the same verification
      (the accepted length along the tree's first-child path, which is the chain the drafter would have
      drafted). A chain's tokens are the tree's times the ratio of these sums, so the shapes are compared
      on the same text (steps of a chain alone would compare it on other text).
    * ``seconds(shape, b)``, the wall time of a step (drafter, verification forward, host work), is
      measured per shape and per batch-size bucket (powers of two of the active rows). It depends on the
      shape and the batch, hardly on the text. A shape is run ``min_samples`` times in a bucket before its
      time is trusted, and the configured tree every ``explore_every`` steps (it feeds the paired counts).
    Measurements carry over to the next call with the same drafter, device and dtype. Greedy decoding
    only: with sampling the chains' counterfactual acceptance is not observable, and the configured tree
    is used (as when ``adaptive=False``).

Lossless
    The choice uses only earlier steps, never this step's drafts: greedy output stays the model's own.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

__all__ = ["Shape", "ShapePolicy", "shapes_from", "first_child_chain"]


@dataclass(frozen=True)
class Shape:
    """One tree shape: ``width`` children per node, ``depth`` levels, ``budget`` drafted nodes, context on / off."""

    width: int
    depth: int
    budget: int
    context: bool

    @property
    def label(self) -> str:
        if self.depth == 0:
            return "plain"
        kind = "chain" if self.width == 1 else f"tree w{self.width}"
        return f"{kind} d{self.depth} b{self.budget}" + (" +context" if self.context else "")


def shapes_from(width: int, depth: int, budget: int, context: bool) -> list[Shape]:
    """The configured shape first, then chains of at most 8, 4 and 2 levels without context matches
    (deduplicated), and a plain step (no drafter forward, the target's next token only)."""
    out = [Shape(width, depth, budget, context)]
    for d in (8, 4, 2, 0):
        chain = Shape(1, min(depth, d, budget), min(depth, d, budget), False)
        if chain not in out:
            out.append(chain)
    return out


def first_child_chain(builder, limit: int) -> list[int]:
    """The nodes of ``builder``'s tree along the drafter's first choice at each level (at most ``limit``): the chain
    a one-child drafting of the same drafter would have drafted, as far as the tree holds it."""
    child = {(p, t): v for v, (p, t) in enumerate(zip(builder.parents, builder.tokens)) if v}
    out, node = [], 0
    while len(out) < limit and builder.children.get(node):
        nxt = child.get((node, builder.children[node][0][0]))
        if nxt is None:
            break
        out.append(nxt)
        node = nxt
    return out


_MEMORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> {key: measurements of its last call}


class ShapePolicy:
    """Chooses each step's :class:`Shape` for the batch (module docstring); one per ``generate`` call.

    ``memory``: ``(owner, key)``; the measurements start from the owner's last call under ``key`` (the owner, a
    drafter, is held weakly) and :meth:`remember` stores this call's.
    """

    #: decayed sums: each new measurement of a quantity scales the old ones by this
    decay = 0.98
    #: steps of a shape in a bucket before its step time is trusted
    min_samples = 2

    def __init__(self, shapes: list[Shape], explore_every: int = 16, memory: tuple | None = None):
        if not shapes:
            raise ValueError("ShapePolicy needs at least one shape.")
        self.shapes = list(shapes)
        self.explore_every = explore_every
        self.memory = memory
        known = _MEMORY.get(memory[0], {}).get(memory[1]) if memory is not None else None
        # per shape: decayed sums of committed tokens over the configured tree's steps (the chains': what they would
        # have committed on those steps); per (bucket, shape): [seconds, steps]
        self.tokens = list(known["tokens"]) if known else [0.0] * len(self.shapes)
        self.times = {k: list(v) for k, v in known["times"].items()} if known else {}
        self.steps = 0
        self.since_tree = 0
        self.used = [0] * len(self.shapes)
        self._pending = None  # (shape index, bucket, start time) of the step being measured
        self._done = False

    @staticmethod
    def bucket(rows: int) -> int:
        return max(int(rows), 1).bit_length() - 1  # 1, 2-3, 4-7, 8-15, ...

    def relative_tokens(self, shape: int) -> float:
        """Tokens ``shape`` commits per step, relative to the configured tree on the same steps (paired)."""
        return self.tokens[shape] / self.tokens[0] if self.tokens[0] > 0 else 0.0

    def seconds(self, bucket: int, shape: int) -> float | None:
        seconds, steps = self.times.get((bucket, shape), (0.0, 0.0))
        return seconds / steps if steps > 0 else None

    def choose(self, rows: int) -> int:
        """The shape (index into ``shapes``) of the next step of a batch of ``rows`` active rows."""
        b = self.bucket(rows)
        self.steps += 1
        young = [i for i in range(len(self.shapes)) if self.times.get((b, i), (0, 0))[1] < self.min_samples
                 or self.tokens[0] == 0]
        if young:
            pick = young[0]
        elif self.since_tree >= self.explore_every:
            pick = 0
        else:
            pick = max(range(len(self.shapes)), key=lambda i: self.relative_tokens(i) / self.seconds(b, i))
        self.since_tree = 0 if pick == 0 else self.since_tree + 1
        self.used[pick] += 1
        self._pending = (pick, b, time.perf_counter())
        self._done = False
        return pick

    def observe(self, committed: list[int], chains: dict[int, list[int]] | None = None) -> None:
        """After the step's verification: ``committed`` tokens per active row (accepted + 1) and, for a step of the
        configured tree, ``chains``: per other shape, the tokens each row's chain would have committed."""
        if self._pending is None:
            return
        if chains is not None:  # a step of the configured tree: paired counts
            self.tokens[0] = self.decay * self.tokens[0] + sum(committed)
            for shape, counts in chains.items():
                self.tokens[shape] = self.decay * self.tokens[shape] + sum(counts)
        self._done = True

    def close(self) -> None:
        """End the step being measured: its time runs from :meth:`choose` to here (the next step's start)."""
        if self._pending is None or not self._done:
            return
        pick, b, start = self._pending
        t = self.times.setdefault((b, pick), [0.0, 0.0])
        t[0] = self.decay * t[0] + max(time.perf_counter() - start, 1e-9)
        t[1] = self.decay * t[1] + 1
        self._pending = None

    def remember(self) -> None:
        if self.memory is not None:
            owner, key = self.memory
            _MEMORY.setdefault(owner, {})[key] = {"tokens": list(self.tokens),
                                                  "times": {k: list(v) for k, v in self.times.items()}}

    @property
    def stats(self) -> dict:
        return {"shape_steps": {s.label: n for s, n in zip(self.shapes, self.used) if n}}
