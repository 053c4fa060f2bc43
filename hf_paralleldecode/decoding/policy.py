"""The batch policy: each step, how much of its tree the whole batch feeds, from measured committed tokens per second.

Why
    What pays depends on the batch and the device: at batch 1 a wide tree with context matches is nearly free (a
    forward of 21 tokens costs about what one token costs), while at batch 16 on a CPU the same tree costs 16 x 21
    tokens plus a drafter forward over 16 rows and the host work of 16 trees, and a short chain, or no speculation
    at all, commits more tokens per second. No fixed setting is right for every batch, every model and every text.

Shapes
    Every strategy offers a few *shapes* (:class:`Shape`): its configured tree first, then chains of at most 8, 4 and
    2 levels along its first choice (a drafter's chain without context matches, the first context match, a
    Jacobi block cut short), and a *plain* step that feeds the last committed token alone: ordinary decoding, no
    drafter forward. Strategies whose state needs every node of their tree (a lookahead window) offer the
    configured tree and the plain step only. The rows of one step share its shape, because a forward costs what
    its widest row costs (the rows are padded to one width); each row fills the shape with its own best nodes.

The rule
    Each step :class:`BatchPolicy` picks the allowed shape with the highest predicted rate for the ``b`` active rows::

        rate(shape) = b * tokens(shape) / seconds(shape, b)

    * ``tokens(shape)``, committed tokens per row and step, is compared *paired*: on every step of the configured
      tree, the tokens each chain would have committed are read off the same verification
      (:func:`first_child_prefix`: how far the accepted path ran along the tree's first children, which is the
      chain; with sampling the draws are shared, so this holds for sampled steps as well). A chain's tokens are the
      tree's times the ratio of these sums, so shapes are compared on the same text; a plain step commits exactly
      one token. Without any step of the configured tree (a token cap excludes it), shapes are compared on their
      own steps.
    * ``seconds(shape, b)``, the wall time of a step (drafter, verification forward, host work), is measured per
      shape and per batch-size bucket (powers of two of the active rows): it depends on the shape, the batch and the
      device, hardly on the text. A shape is run ``min_samples`` times in a bucket before its time is trusted: the
      configured tree first (once: the paired counts do not depend on the batch size), then the plain step, then
      any shape only while its tokens over a floor of its time (the plain step's time, its own time at a smaller
      batch carried forward by its growth per doubling there, its ratio to the plain step at a smaller batch) beat
      the best rate measured in the bucket (with the margin below): a good tree at batch 1 is not left to measure chains
      that cannot catch up, and a tree that lost at batch 16 is not tried at batch 32. A batch that shrinks (its
      rows finish at different steps) passes through smaller buckets: there a shape's time in a larger bucket
      stands in until it has its own (fewer rows are never slower), and nothing new is measured. A call's first step
      with a drafter forward (the drafter reads the whole prompt then) is not timed once the shape has its samples.
    * Revisits. While another shape is faster, the configured tree is revisited (it feeds the paired counts, and the
      text may change) at doubling gaps (``explore_every`` steps, then twice that, up to ``max_gap``) and only when
      a revisit's predicted loss, its time minus the time the best shape takes to commit as many tokens, is covered
      by an exploration budget: ``explore_share`` of the time of the steps since the last visit. The revisit then
      pays what it took, not its estimate: a drafter that reads the whole prompt on the call's first drafting step,
      or catches up on the tokens committed since its last forward, makes a revisit cost several tree steps, and the
      next one waits until the steps away from the tree have paid for it. Until the tree has
      three steps in the bucket (its time may still hold a warm-up step) the gaps alone decide, if its floor leaves it
      a chance. A tree that
      loses a little is revisited every few dozen steps, one that loses a step's worth of time at a large batch
      rarely. A tree that would win by ``decisive`` (2x) at the fastest step it ever took in the bucket is revisited
      at its gaps whatever the budget, and a step much faster than a shape's estimate (``stale``: 1.5x) replaces its
      window: times measured while another process ran do not lock a shape out. The gap, the budget and the steps
      since the last visit carry over to the next call, like the measurements: a server's short requests do not
      each pay for a revisit.

    The tail. ``generate``'s batch is static: rows that accept more finish first, and the batch runs its last steps
    with fewer rows, on a CPU at nearly a full step's cost. A shape's rate is therefore scaled by
    :meth:`tail_factor`, predicted from the spread of its tokens per row-step (paired, like the tokens), the rows'
    remaining new tokens and the shape's step times at fewer rows: nothing for the plain step or one row, most for
    a deep shape at a batch whose small steps cost what full ones cost.

    A chain must be predicted ``tree_margin`` (5%) faster than the configured tree to replace it: its paired tokens
    flatter it a little. From ``margin_rows`` active rows on, a shape must be predicted ``margin`` faster than the
    plain step: rows that
    speculate fall out of step, and the tail is predicted from a model, while the plain step's cost is certain.

    Measurements carry over to the next call of the same owner (the drafter, or the model) with the same device,
    dtype and shapes, so a server's first call pays the exploration once.

Caps a user sets
    ``tree_budget`` caps the configured tree (so every shape); ``max_step_tokens`` caps the tokens one verification
    forward feeds for the whole batch (rows x nodes per row, the root included), a latency budget per step: shapes
    over it are not used at that batch size (the plain step always is).

Lossless
    The choice uses only earlier steps, never this step's drafts or draws: greedy output stays the model's own and
    sampled output keeps stock sampling's distribution.
"""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass
from statistics import NormalDist

import torch

__all__ = ["Shape", "BatchPolicy", "shapes_from", "first_child_prefix", "path_prefix", "PLAIN", "CHAIN_DEPTHS",
           "target_key"]

#: the depths of the chains every strategy offers besides its configured tree (cut to the configured depth)
CHAIN_DEPTHS = (8, 4, 2)


@dataclass(frozen=True)
class Shape:
    """One tree shape: ``width`` children per node, ``depth`` levels, ``budget`` drafted nodes, context on / off;
    ``drafter=False``: no drafter forward, the first context match alone (a *context chain*)."""

    width: int
    depth: int
    budget: int
    context: bool
    drafter: bool = True

    @property
    def plain(self) -> bool:
        """A step that feeds the last committed token only (ordinary decoding)."""
        return self.depth == 0

    @property
    def label(self) -> str:
        if self.plain:
            return "plain"
        if not self.drafter:
            return f"context chain d{self.depth}"
        kind = "chain" if self.width == 1 else f"tree w{self.width}"
        return f"{kind} d{self.depth} b{self.budget}" + (" +context" if self.context else "")


PLAIN = Shape(1, 0, 0, False)


def shapes_from(width: int, depth: int, budget: int, context: bool, chains: bool = True,
                context_depth: int | None = None) -> list[Shape]:
    """The configured shape first, then (``chains``) chains of at most 8, 4 and 2 levels without context matches,
    (``context_depth``: the tokens of a context match) context chains of at most 8, 4 and 2 tokens without the
    drafter (deduplicated), and the plain step."""
    out = [Shape(width, depth, budget, context)]
    for d in CHAIN_DEPTHS if chains else ():
        chain = Shape(1, min(depth, d, budget), min(depth, d, budget), False)
        if chain not in out and chain.depth > 0:
            out.append(chain)
    for d in CHAIN_DEPTHS if chains and context and context_depth else ():
        chain = Shape(1, min(context_depth, d, budget), min(context_depth, d, budget), True, drafter=False)
        if chain not in out and chain.depth > 0:
            out.append(chain)
    if PLAIN not in out:
        out.append(PLAIN)
    return out


def path_prefix(verdict, nodes: torch.Tensor) -> torch.Tensor:
    """``[batch]``: how many of each row's accepted nodes are, one after the other from the root, the nodes of
    ``nodes`` ``[batch, length]`` (a path from the root's child down, ``-1`` past its end)."""
    path = verdict.path[:, 1:]
    n = min(path.shape[1], nodes.shape[1])
    ok = (nodes[:, :n] >= 0) & (path[:, :n] == nodes[:, :n])
    return ok.long().cumprod(1).sum(1)


def first_child_prefix(tree, verdict) -> torch.Tensor:
    """``[batch]``: how many of each row's accepted nodes are, one after the other from the root, the first child
    (the lowest node index, the first tried) of the node before: what the chain along the tree's first children
    would have accepted on this very step (greedy: the same argmaxes; sampled: the same draws)."""
    parents = tree.parents
    batch, width = parents.shape
    index = torch.arange(width, device=parents.device).expand(batch, width)
    first = torch.full((batch, width + 1), width, dtype=torch.long, device=parents.device)  # width: no child
    first.scatter_reduce_(1, torch.where(parents >= 0, parents, width), index, reduce="amin", include_self=True)
    # the first child of each node on the accepted path: the chain that path would follow
    return path_prefix(verdict, first.gather(1, verdict.path[:, :-1].clamp(min=0)))


@functools.cache
def _expected_max(n: int) -> float:
    """The expected largest of ``n`` standard normal draws (Blom's approximation; 0 for one)."""
    return 0.0 if n < 2 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


_MEMORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> {key: measurements of its last call}


class BatchPolicy:
    """Chooses each step's :class:`Shape` for the batch (module docstring); one per ``generate`` call.

    ``memory``: ``(owner, key)``; the measurements start from the owner's last call under ``key`` (the owner, a
    drafter or a model, is held weakly) and :meth:`finish` stores this call's. ``max_step_tokens``: tokens one
    forward may feed for the whole batch (``None``: no cap).
    """

    #: decayed token sums: each new step scales the old ones by this
    decay = 0.98
    #: row-steps the prior of the paired token sums is worth (see ``__init__``)
    prior = 1.0
    #: steps of a shape in a bucket before its step time is trusted
    min_samples = 2
    #: the last step times of a shape in a bucket that its estimate is made from (see :meth:`seconds`)
    window = 8
    #: the longest gap between visits of a configured tree that keeps losing (``explore_every`` doubles up to it)
    max_gap = 256
    #: the share of step time that revisits of a losing configured tree may lose (see :meth:`choose`)
    explore_share = 0.01
    #: from this many active rows on, a shape must be predicted ``margin`` faster than the plain step to be used:
    #: rows that speculate fall out of step, and a batch that keeps its slowest rows runs its last steps nearly
    #: empty, a cost no per-step rate sees
    margin_rows = 8
    margin = 0.15
    #: a chain must be predicted this much faster than the configured tree to replace it: its tokens are read off
    #: the tree's steps (the accepted path along first children), which flatters it a little (base model's 1B twin,
    #: batch 1: 0.65 of the tree's tokens predicted, 0.61 run alone)
    tree_margin = 0.05
    #: a losing configured tree that would win by this factor at the fastest step time it ever took in the bucket
    #: (:meth:`fastest`) is revisited at its gaps without the budget: its own steps showed it can win by that much,
    #: so what keeps it out is a time measured under worse conditions (another process's burst). At a real model's
    #: cost a batch-1 tree step costs about a plain step and commits several tokens: such a burst must not lock it
    #: out until a 1% budget refills
    decisive = 2.0
    #: a step this many times faster than its shape's estimate replaces the shape's window in its bucket: the
    #: window was measured under conditions that have passed (another process's burst, a warm-up)
    stale = 1.5

    def __init__(self, shapes: list[Shape], explore_every: int = 16, memory: tuple | None = None,
                 max_step_tokens: int | None = None, nodes=None):
        if not shapes:
            raise ValueError("BatchPolicy needs at least one shape.")
        self.shapes = list(shapes)
        self.plain = next((i for i, s in enumerate(self.shapes) if s.plain), None)  # the plain step's index
        self.nodes = nodes  # a budget.CostAwareBudget: which nodes of a row's tree are worth feeding (cost_aware)
        self.explore_every = explore_every
        self.max_step_tokens = max_step_tokens
        self.memory = memory
        known = _MEMORY.get(memory[0], {}).get(memory[1]) if memory is not None else None
        n = len(self.shapes)
        # per shape: decayed sums of committed tokens over the configured tree's steps (the others': what they
        # would have committed on those steps); own: per shape, decayed [committed tokens, row-steps] of its own
        # steps; per (bucket, shape): its last step times (see seconds)
        # (the paired sums start from a prior worth one row-step in which the configured tree commits its whole depth
        # + 1 and every other shape one token: one unlucky first step does not lock the configured tree out, and the
        # others need real evidence to win)
        self.tokens = list(known["tokens"]) if known else [self.prior * (self.shapes[0].depth + 1)] + [self.prior] * (n - 1)
        # the same steps' decayed sums of squared tokens per row and their decayed row-steps (the prior's included):
        # each shape's spread of tokens per row-step, from which its tail is predicted (see tail_factor)
        self.squares = list(known["squares"]) if known else [t * t / self.prior for t in self.tokens]
        self.paired_rows = known["paired_rows"] if known else self.prior
        self.remaining = None  # the active rows' mean remaining new tokens (start_step)
        self.own = [list(v) for v in known["own"]] if known else [[0.0, 0.0] for _ in range(n)]
        self.times = {k: list(v) for k, v in known["times"].items()} if known else {}
        self.best_seen = dict(known.get("best_seen", {})) if known else {}  # per (bucket, shape): its fastest step
        # revisits of a losing configured tree: steps since its last visit, the gap to the next one (doubles while
        # it keeps losing) and the exploration budget in seconds (see choose); carried over like the measurements
        self.since_tree, self.gap, self.budget = known["revisits"] if known else (0, explore_every, 0.0)
        self.used = [0] * n
        self.row_steps = [0] * n  # active rows of the steps of each shape (the fraction of rows that speculated)
        self._pending = None  # (shape index, bucket, start time) of the step being measured
        self._charge = None  # the step being measured is a revisit paid from the budget: its estimated time
        self._drafted = False  # whether a step of this call ran the drafter (see close)
        self._done = False

    @staticmethod
    def bucket(rows: int) -> int:
        return max(int(rows), 1).bit_length() - 1  # 1, 2-3, 4-7, 8-15, ...

    def relative_tokens(self, shape: int) -> float:
        """Tokens ``shape`` commits per row and step, relative to the configured tree (paired once it ran)."""
        if self.own[0][1] > 0 or not any(o[1] > 0 for o in self.own):
            return self.tokens[shape] / self.tokens[0]
        # the tree never ran (a token cap keeps it out): every shape by its own steps, in tokens per row and step
        # (one unit for all shapes, so the rates still compare)
        if self.shapes[shape].plain:
            return 1.0
        own = self.own[shape]
        return own[0] / own[1] if own[1] > 0 else 0.0

    def seconds(self, bucket: int, shape: int) -> float | None:
        """The step time of ``shape`` in ``bucket``: the mean of its last :attr:`window` steps there without the
        slowest one once there are three (a step slowed by a first call's warm-up or another process does not
        stick, while a shape whose steps are often slow, a drafter catching up, is charged for them), ``None``
        unmeasured."""
        samples = self.times.get((bucket, shape))
        if not samples:
            return None
        kept = sorted(samples)[:-1] if len(samples) >= 3 else samples
        return sum(kept) / len(kept)

    def fastest(self, bucket: int, shape: int) -> float:
        """The fastest step ``shape`` ever took in ``bucket`` (its window's included; infinite: none)."""
        samples = self.times.get((bucket, shape), ())
        return min([self.best_seen.get((bucket, shape), float("inf")), *samples])

    def trusted(self, bucket: int, shape: int) -> bool:
        """Whether ``shape`` has run :attr:`min_samples` steps in ``bucket``."""
        return len(self.times.get((bucket, shape), ())) >= self.min_samples

    def inherited(self, bucket: int) -> bool:
        """Whether a larger bucket was explored (its plain step measured): a batch that shrank into ``bucket``."""
        plain = self.plain
        return plain is not None and any(self.trusted(k, plain) for k, i in self.times if k > bucket and i == plain)

    def estimate(self, bucket: int, shape: int, inherited: bool | None = None) -> float | None:
        """The step time the choice uses: the shape's own in ``bucket`` once trusted; before that, in a bucket a
        batch shrank into, the shape's time in a larger bucket (fewer rows are never slower: an upper bound, so the
        batch keeps its choice instead of measuring every shape again in each bucket its finishing rows pass
        through), or its one step here if that was faster; else what there is of its own (``None``: unmeasured).
        ``inherited``: :meth:`inherited`, if known."""
        own = self.seconds(bucket, shape)
        if not self.trusted(bucket, shape) and (self.inherited(bucket) if inherited is None else inherited):
            larger = [self.seconds(k, i) for k, i in self.times if k > bucket and i == shape and self.trusted(k, i)]
            if larger:  # (a first step here counts if it was faster: a slow one may be a warm-up)
                return min(larger + ([own] if own is not None else []))
        return own

    def ratio(self, bucket: int, shape: int) -> float | None:
        """``shape``'s step time over the plain step's in ``bucket``, both trusted (``None``: not known)."""
        if self.plain is None or not (self.trusted(bucket, shape) and self.trusted(bucket, self.plain)):
            return None
        return self.seconds(bucket, shape) / self.seconds(bucket, self.plain)

    def floor(self, bucket: int, shape: int) -> float:
        """What ``shape``'s step time in ``bucket`` is expected to be at least, before it is measured there (0.0:
        nothing known), from smaller buckets and the plain step's time here. A step's time grows with the rows it
        feeds as a convex curve: flat while fixed costs dominate, then linear in the tokens fed (the forward's cost
        by tokens, the drafter's, the host's per row). On such a curve, from one batch size to twice it:

        * the time grows by a factor that does not shrink with the batch, so the shape's own time in the largest
          smaller bucket, carried forward by its growth per doubling between the two largest, bounds it;
        * a shape feeding ``n`` tokens per row leaves the flat part before the plain step does, so its ratio to
          the plain step does not shrink: the plain step's time here times that ratio in a smaller bucket bounds it.

        The floor is the largest of these, of the shape's time at any smaller batch (more rows are never faster), of
        the plain step's time here, and of what the measured shapes here that draft alike and feed fewer nodes say:
        more nodes are never faster, and between shapes of one kind (chains) the time per node does not shrink on
        the convex curve (a chain of 2 and a chain of 4 that took 1.0 and 1.5 s at 64 rows put the chain of 8 at
        2.5 s at least; a tree's host work differs from a chain's, so chains bound a tree only by their time). On this CPU (JF model) the configured
        tree took 36, 56, 89, 174 and 325 ms at 4, 8, 16, 32 and 64 rows: from 4 and 8 rows the floor at 16 is
        88 ms, and from 16 and 32 rows the floor at 64 is 340 ms (the floor rests on that curve; measured times
        scatter by a few percent). A new bucket is then not spent measuring shapes that cannot win there."""
        plain = self.seconds(bucket, self.plain) if self.plain is not None and self.trusted(bucket, self.plain) else None
        smaller = [k for k in range(bucket) if self.trusted(k, shape)]
        out = plain or 0.0
        me = self.shapes[shape]
        narrower = sorted((other.budget + 1, self.seconds(bucket, j), (other.width, other.context) == (me.width, me.context))
                          for j, other in enumerate(self.shapes)
                          if not other.plain and other.drafter == me.drafter and other.budget < me.budget
                          and self.trusted(bucket, j))
        alike = [(n, t) for n, t, same in narrower if same]
        out = max([out] + [t for _, t, _ in narrower])  # more nodes are never faster
        for (n1, t1), (n2, t2) in zip(alike, alike[1:]):  # shapes of one kind (chains): on a convex curve the time
            out = max(out, t2 + (me.budget + 1 - n2) * max(t2 - t1, 0.0) / (n2 - n1))  # per node does not shrink
        if smaller:
            k1 = smaller[-1]
            growth = 1.0
            if len(smaller) > 1:
                k0 = smaller[-2]
                growth = max(1.0, self.seconds(k1, shape) / self.seconds(k0, shape)) ** (1.0 / (k1 - k0))
            out = max([out, self.seconds(k1, shape) * growth ** (bucket - k1)] + [self.seconds(k, shape) for k in smaller])
        ratios = [r for k in smaller if (r := self.ratio(k, shape)) is not None]
        if plain is not None and ratios:
            out = max(out, plain * ratios[-1])
        return out

    def threshold(self, bucket: int, rows: int, rates: dict) -> float:
        """The rate a shape must be predicted to beat to be used: the best of ``rates`` (shape -> rate), and from
        :attr:`margin_rows` rows on ``1 + margin`` times the plain step's."""
        best = max(rates.values()) if rates else 0.0
        if self.plain in rates and rows >= self.margin_rows:
            best = max(best, (1 + self.margin) * rates[self.plain])
        return best

    def optimistic(self, bucket: int, shape: int) -> float:
        """``shape``'s best possible rate in ``bucket``: its tokens over :meth:`floor` (infinite: nothing known)."""
        floor = self.floor(bucket, shape)
        return self.relative_tokens(shape) / floor if floor > 0 else float("inf")

    def hopeful(self, bucket: int, rows: int, shape: int, rates: dict) -> bool:
        """Whether ``shape`` could still beat ``rates`` in ``bucket`` (:meth:`optimistic` over :meth:`threshold`)."""
        return self.optimistic(bucket, shape) > self.threshold(bucket, rows, rates)

    def allowed(self, rows: int) -> list[int]:
        """The shapes a step of ``rows`` active rows may use under ``max_step_tokens`` (the plain step always)."""
        cap = self.max_step_tokens
        return [i for i, s in enumerate(self.shapes) if s.plain or cap is None or rows * (s.budget + 1) <= cap]

    def start_step(self, rows: int, forward_seconds: float, fed: int | None, remaining: float | None = None) -> int:
        """Before a step: the node budget's timings (the target's cumulated forward seconds and the tokens of the
        last forward), the active rows' mean remaining new tokens (``None``: unknown), then :meth:`choose`."""
        if self.nodes is not None:
            self.nodes.observe(forward_seconds, fed)
        self.remaining = remaining
        return self.choose(rows)

    def tail_factor(self, bucket: int, rows: int, shape: int, full: float | None = None) -> float:
        """The share of ``shape``'s per-step rate left over a whole static batch: rows that accept more finish first,
        and the batch's last steps run with fewer rows at nearly a full step's cost (the bench's tail).

        With ``mu`` and ``sigma`` the mean and spread of a row's tokens per step (paired), ``n = remaining / mu``
        steps for a typical row: the rows finish over ``n +- w`` steps, ``w = z * sigma * sqrt(n) / mu`` (``z``: the
        expected largest of ``rows`` standard normals), so the batch runs ``n - w`` full steps and ``2 w`` draining
        ones at the mean time of a step of 1 .. rows - 1 rows (each bucket's estimate, else this one's). The factor is ``n`` full
        steps' time over that. 1.0 for the plain step (every row commits one token) and for one row. ``full``: the
        shape's step time in ``bucket`` if the caller has it (:meth:`estimate`)."""
        s = self.shapes[shape]
        if s.plain or rows < 2 or not self.remaining or self.remaining <= 0:
            return 1.0
        mu = self.tokens[shape] / self.paired_rows
        if self.own[0][1] == 0 or mu <= 0:  # no paired steps: nothing known of the spread
            return 1.0
        sigma = max(self.squares[shape] / self.paired_rows - mu * mu, 0.0) ** 0.5
        n = self.remaining / mu
        w = min(_expected_max(rows) * sigma * n ** 0.5 / mu, n)
        full = self.estimate(bucket, shape) if full is None else full
        if full is None:
            return 1.0
        # a draining batch passes through every row count below this one: the mean step time over 1 .. rows - 1,
        # each from its bucket's estimate (this bucket's where a smaller one is not measured)
        total = 0.0
        for k in range(bucket + 1):
            span = min(2 ** (k + 1), rows) - 2 ** k
            t = self.estimate(k, shape) if k < bucket else full
            total += span * min(t if t is not None else full, full)
        drain = total / (rows - 1)
        # (step time proportional to the rows: no loss; a bucket's time stands for its smallest batch, so the
        # estimate can dip below that, which a tail never gains)
        return min(1.0, n * full / ((n - w) * full + 2 * w * drain))

    def choose(self, rows: int) -> int:
        """The shape (index into ``shapes``) of the next step of a batch of ``rows`` active rows."""
        self.close()
        charge = None  # a revisit paid from the budget: the step time its loss was reckoned with
        b = self.bucket(rows)
        allowed = self.allowed(rows)
        inherited = self.inherited(b)
        # each allowed shape's step time and predicted rate, once per step (the measuring phase reads them too)
        times = {i: self.estimate(b, i, inherited) for i in allowed}
        rate = {i: self.relative_tokens(i) / t * self.tail_factor(b, rows, i, t) for i, t in times.items()
                if t is not None}
        # (one shape: nothing to decide)
        young = allowed[0] if len(allowed) == 1 else self._young(b, rows, allowed, inherited, rate)
        if young is not None:
            pick = young
        else:
            best = max(rate, key=rate.get)
            if best not in (0, self.plain) and 0 in rate and rate[best] < (1 + self.tree_margin) * rate[0]:
                best = 0  # a close race: a chain's paired tokens flatter it a little, the tree's are its own
            if self.plain in rate and rate[best] < self.threshold(b, rows, {self.plain: rate[self.plain]}):
                best = self.plain  # a small predicted gain at a large batch: the plain step's cost is certain
            if best == 0:
                self.gap, self.budget = self.explore_every, 0.0
            # revisit a losing tree (fresh paired counts) once the gap has passed and the budget covers the loss: its
            # time minus the time the best shape takes to commit its tokens; each revisit doubles the gap
            # (a time resting on fewer than three steps may hold a warm-up step: the tree is then revisited at its
            # gaps alone, or one slow step could lock it out for good, unless even its floor loses)
            revisit = False
            if best != 0 and 0 in rate and self.since_tree >= self.gap:
                others = {i: r for i, r in rate.items() if i != 0}
                if len(self.times.get((b, 0), ())) < 3 and self.hopeful(b, rows, 0, others):
                    revisit = True
                elif self.relative_tokens(0) / (fast := self.fastest(b, 0)) * self.tail_factor(b, rows, 0, fast) \
                        >= self.decisive * self.threshold(b, rows, others):
                    revisit = True  # it has been fast enough to win decisively here: re-measure it at its gaps
                else:
                    loss = times[0] * (1.0 - rate[0] / rate[best])
                    revisit = self.budget >= loss
                    if revisit:
                        self.budget -= loss
                        charge = times[0]  # what close() charges beyond: the revisit's measured time is what it cost
                if revisit:
                    self.gap = min(2 * self.gap, self.max_gap)
            pick = 0 if revisit else best
        self._charge = charge
        self.since_tree = 0 if pick == 0 else self.since_tree + 1
        self.used[pick] += 1
        self.row_steps[pick] += int(rows)
        self._pending = (pick, b, time.perf_counter())
        self._done = False
        return pick

    def _young(self, b: int, rows: int, allowed: list[int], inherited: bool, rate: dict) -> int | None:
        """The shape to measure next in bucket ``b``, or ``None`` when every shape worth measuring is measured.

        The configured tree comes first, once (its steps feed the paired counts, which do not depend on the batch
        size), then the plain step of the bucket (the cheapest step there is). Any other shape is measured only
        while it could still win (from :attr:`margin_rows` rows the narrowest such shape first, whose time then
        floors the wider ones; below, the most promising): its tokens over :meth:`floor` (the plain step's time in this bucket, its own time
        in a smaller bucket carried forward, its ratio to the plain step there) must beat the best rate measured in the
        bucket, with the margin from :attr:`margin_rows` rows on (:meth:`threshold`). A good tree at batch 1 is not
        left to measure chains that cannot catch up, and a tree that lost at batch 16 is not tried at batch 32.

        In a bucket a batch shrank into (``inherited``), nothing new is measured: a shape timed in the larger
        bucket is known by that time (:meth:`estimate`), one that was not worth timing there is not timed here.
        ``rate``: the predicted rates :meth:`choose` computed this step (every measured shape has one)."""
        def young(i):
            return not self.trusted(b, i) and not (inherited and self.estimate(b, i, True) is not None)
        paired = 0 in allowed
        if paired and self.own[0][1] == 0:  # the tree has never run
            return 0
        plain = self.plain if self.plain in allowed else None
        if plain is not None and young(plain):
            return plain
        rest = [i for i in allowed if young(i)] if not inherited else []
        if not paired:  # no paired counts: a chain is known by its own steps only
            return rest[0] if rest else None
        measured = [i for i in allowed if not young(i)]
        if not measured:
            return rest[0] if rest else None
        rates = {i: rate[i] for i in measured}
        bar = self.threshold(b, rows, rates)
        optimistic = {i: self.optimistic(b, i) for i in rest}  # (each floor once)
        hopeful = [i for i in rest if optimistic[i] > bar]
        if not hopeful:
            return None
        if rows >= self.margin_rows:  # a large batch measures the cheapest hopeful shape first: its time floors the
            return min(hopeful, key=lambda i: self.shapes[i].budget)  # wider ones (:meth:`floor`)
        return max(hopeful, key=optimistic.get)

    @property
    def index(self) -> int:
        """The index of the step's shape (0, the configured one, before any :meth:`choose`)."""
        return self._pending[0] if self._pending is not None else 0

    @property
    def current(self) -> Shape:
        """The shape of the step being run (the configured one before any :meth:`choose`)."""
        return self.shapes[self.index]

    def observe(self, tree, verdict) -> None:
        """After the step's verification: the tokens it committed and, on a step of the configured tree, what every
        other shape would have committed on it (:func:`first_child_prefix`)."""
        if self.nodes is not None:
            self.nodes.learn(tree, verdict)
        if self._pending is None:
            return
        pick = self._pending[0]
        host = getattr(verdict, "host", None)
        rows = len(host[1]) if host is not None else verdict.num_accepted.numel()
        total = sum(host[1]) + rows if host is not None else float((verdict.num_accepted + 1).sum())
        own = self.own[pick]
        own[0] = self.decay * own[0] + total
        own[1] = self.decay * own[1] + rows
        if pick == 0:  # paired counts
            committed = verdict.num_accepted + 1
            prefix = first_child_prefix(tree, verdict)
            context = None  # the first context match's path (tree.context_path), for context chains
            self.tokens[0] = self.decay * self.tokens[0] + float(committed.sum())
            self.squares[0] = self.decay * self.squares[0] + float((committed * committed).sum())
            self.paired_rows = self.decay * self.paired_rows + committed.numel()
            for i, shape in enumerate(self.shapes[1:], 1):
                if not shape.drafter:
                    if context is None:
                        context = (path_prefix(verdict, tree.context_path) if tree.context_path is not None
                                   else torch.zeros_like(prefix))
                    would = context.clamp(max=shape.depth) + 1
                else:
                    would = prefix.clamp(max=shape.depth) + 1
                self.tokens[i] = self.decay * self.tokens[i] + float(would.sum())
                self.squares[i] = self.decay * self.squares[i] + float((would * would).sum())
        self._done = True

    def close(self) -> None:
        """End the step being measured: its time runs from :meth:`choose` to here (the next step's start)."""
        if self._pending is None or not self._done:
            return
        pick, b, start = self._pending
        seconds = max(time.perf_counter() - start, 1e-9)
        shape = self.shapes[pick]
        # the call's first step with a drafter forward also ran the drafter over the whole prompt, a cost paid once
        # per call: it does not set the shape's step time once the shape has its samples here (a tree revisited
        # once per call would otherwise be timed only on such steps, look slower than it is and stay locked out)
        drafts = shape.drafter and not shape.plain
        setup = drafts and not self._drafted
        self._drafted = self._drafted or drafts
        if not (setup and self.trusted(b, pick)):
            t = self.times.setdefault((b, pick), [])
            if self.trusted(b, pick) and seconds * self.stale < self.seconds(b, pick):
                t.clear()  # the window's steps ran under conditions that have passed
            t.append(seconds)
            self.best_seen[(b, pick)] = min(self.best_seen.get((b, pick), seconds), seconds)
            del t[: -self.window]
        if pick != 0:  # the exploration budget grows with the time spent away from the configured tree
            self.budget += self.explore_share * seconds
        elif self._charge is not None:
            # a revisit's loss was reckoned with the tree's estimated time; it pays what the step took: a drafter
            # reading the whole prompt (the call's first drafting step, left out of the step times) or catching up
            # on the tokens committed since its last forward is part of what a revisit costs (the budget may go
            # below zero; the steps away from the tree refill it)
            self.budget -= seconds - self._charge
            self._charge = None
        self._done = False

    def finish(self) -> None:
        """At the end of the call: close the last step and keep the measurements for the owner's next call."""
        self.close()
        if self.nodes is not None:
            self.nodes.remember()
        if self.memory is not None:
            owner, key = self.memory
            _MEMORY.setdefault(owner, {})[key] = {"tokens": list(self.tokens), "own": [list(o) for o in self.own],
                                                  "times": {k: list(v) for k, v in self.times.items()},
                                                  "best_seen": dict(self.best_seen),
                                                  "squares": list(self.squares), "paired_rows": self.paired_rows,
                                                  "revisits": (self.since_tree, self.gap, self.budget)}

    @property
    def stats(self) -> dict:
        total = max(sum(self.row_steps), 1)
        plain = sum(n for s, n in zip(self.shapes, self.row_steps) if s.plain)
        nodes = {} if self.nodes is None else self.nodes.stats
        return {**nodes, "shape_steps": {s.label: n for s, n in zip(self.shapes, self.used) if n},
                "shape_row_steps": {s.label: n for s, n in zip(self.shapes, self.row_steps) if n},
                "speculated_row_share": 1.0 - plain / total}


def check_policy_settings(adaptive, max_step_tokens) -> None:
    """``adaptive`` (True / False) and ``max_step_tokens`` (``None`` or an integer >= 1, with ``adaptive`` only)."""
    from ..engine.run import check_bool_setting, check_int_setting

    check_bool_setting("adaptive", adaptive)
    if max_step_tokens is not None:
        check_int_setting("max_step_tokens", max_step_tokens, 1)
        if not adaptive:
            raise ValueError("`max_step_tokens` is applied by the batch policy: pass adaptive=True (the default) "
                             "with it, or drop it.")


def batch_policy(run, shapes: list[Shape], owner, adaptive: bool, max_step_tokens: int | None = None, nodes=None):
    """The :class:`BatchPolicy` of a call: ``shapes`` when ``adaptive``, else the configured one only; ``nodes``: a
    :class:`~.budget.CostAwareBudget` that cuts each row's tree node by node (``cost_aware=True``). ``None`` when
    there is nothing to decide. Its measurements carry over per ``owner`` (a drafter, or the model), strategy,
    device, dtype, shapes, acceptance rule (:func:`acceptance_rule`) and target model (:func:`target_key`: a drafter
    shared by two models, a model and its cost twin say, learns each one's cost curve and acceptance apart)."""
    if not adaptive and nodes is None:
        return None
    shapes = list(shapes) if adaptive else list(shapes[:1])
    key = (run.name, str(run.rows.device), str(run.model.dtype), tuple(shapes),
           acceptance_rule(run.generation_config, run.logits_processor), target_key(run.model))
    return BatchPolicy(shapes, memory=(owner, key), max_step_tokens=max_step_tokens, nodes=nodes)


def target_key(model) -> str:
    """A token naming one target model instance for the measurements it owns (kept on the instance: an ``id`` could
    be reused by a later model)."""
    token = model.__dict__.get("_hfpd_target_key")
    if token is None:
        import uuid

        token = uuid.uuid4().hex
        object.__setattr__(model, "_hfpd_target_key", token)
    return token


def acceptance_rule(generation_config, logits_processor) -> tuple:
    """What decides how much of a tree is accepted besides the text: greedy or sampled, and the processors with their
    scalar settings (a temperature, a top-k, a repetition penalty). Calls that differ in it do not share measurements:
    the same drafter that commits five tokens per step greedily commits one or two at temperature 0.8."""
    processors = tuple(
        (type(p).__name__, tuple(sorted((k, v) for k, v in vars(p).items() if isinstance(v, (bool, int, float, str)))))
        for p in (logits_processor or ()))
    return bool(generation_config.do_sample), processors
