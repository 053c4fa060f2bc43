"""The rule: each step, the shape the whole batch feeds, from measured committed tokens per second.

Why
    What pays depends on the batch and the device: at batch 1 a wide tree with context matches is nearly free (a
    forward of 21 tokens costs about what one token costs), while at batch 16 on a CPU the same tree costs 16 x 21
    tokens plus a drafter forward over 16 rows and the host work of 16 trees, and a short chain, or no speculation
    at all, commits more tokens per second. No fixed setting is right for every batch, every model and every text.

The rule
    Each step :class:`BatchPolicy` picks the allowed shape (:mod:`.shapes`) with the highest predicted rate for the
    ``b`` active rows::

        rate(shape) = b * tokens(shape) / seconds(shape, b)

    * ``tokens(shape)``, committed tokens per row and step, is compared *paired*: on every step of the configured
      tree, the tokens each chain would have committed are read off the same verification
      (:func:`~.shapes.first_child_prefix`). A chain's tokens are the tree's times the ratio of these sums, so
      shapes are compared on the same text; a plain step commits exactly one token. Without any step of the
      configured tree (a token cap excludes it), shapes are compared on their own steps.
    * ``seconds(shape, b)``, the wall time of a step, is measured per shape and per batch-size bucket
      (:class:`~.times.StepTimes`). A shape is run ``min_samples`` times in a bucket before its time is trusted: the
      configured tree first (once: the paired counts do not depend on the batch size), then the plain step, then
      any shape only while its tokens over a floor of its time (:meth:`~.times.StepTimes.floor`) beat the best rate
      measured in the bucket (with the margin below): a good tree at batch 1 is not left to measure chains that
      cannot catch up, and a tree that lost at batch 16 is not tried at batch 32. In a bucket a shrinking batch
      passes through, nothing new is measured. A call's first step with a drafter forward (the drafter reads the
      whole prompt then), or one after more plain steps than the drafter catches up on (:meth:`BatchPolicy.lagged`),
      is a setup step: it never joins a shape's window (it stands in for its time only while there is none; the
      configured tree from ``margin_rows`` rows is the exception, which runs there only on revisits, each a switch);
      what it took beyond the shape's time in step is what a switch to drafting costs
      (:meth:`~.times.StepTimes.overhead`), and a drafting shape taken after a step that did not draft pays it,
      spread over the steps it is expected to run (:meth:`BatchPolicy.switch`): a chain that wins in step is switched
      to early in a call, not for its last two steps.
    * Tokens. What the configured tree's steps say of the text's predictability is kept in line with the other
      speculating shapes' own steps (:meth:`BatchPolicy._level`): at a large batch the tree may run only on a call's
      first steps, the least predictable text. A chain's step is exact for shorter chains of its drafter and, for a
      deeper one, on every row that stopped short of its depth; on the rows that accepted its whole depth the deeper
      chain is credited what it was seen to commit beyond that depth on such rows (:meth:`BatchPolicy._beyond`).
      The sums decay per row-step, and by at least ``step_decay`` a step (:meth:`BatchPolicy.decay`): a large batch's
      step outweighs the steps before it, but not the whole history.
    * Revisits. While another shape is faster, the configured tree is revisited (it feeds the paired counts, and the
      text may change), and while the plain step is the fastest, the speculating shape predicted to lose least (the
      tree or a chain: at a large batch a tree step may cost a dozen plain steps), at doubling gaps
      (``explore_every`` steps, then twice that, up to ``max_gap``) and only when
      a revisit's predicted loss, its time minus the time the best shape takes to commit as many tokens, is covered
      by an exploration budget: ``explore_share`` of the time of the steps since the last visit. The revisit then
      pays what it took, not its estimate: a drafter that reads the whole prompt on the call's first drafting step,
      or catches up on the tokens committed since its last forward, makes a revisit cost several tree steps, and the
      next one waits until the steps away from the tree have paid for it. Until the tree has three steps in the
      bucket (its time may still hold a warm-up step) the gaps alone decide, if its floor leaves it a chance (from
      ``margin_rows`` rows also what its visits are seen to cost, reads included: :meth:`BatchPolicy.optimistic`; and
      not in a bucket a shrinking batch passes through, where its time in a larger one stands in). A tree that loses a
      little is revisited every few dozen steps, one that loses a step's worth of time at a large batch rarely. A
      tree that would win by ``decisive`` (2x) at the fastest step it ever took in the bucket is revisited at its gaps
      whatever the budget, and a step much faster than a shape's estimate (``stale``: 1.5x) replaces its window:
      times measured while another process ran do not lock a shape out. The gap, the budget and the steps since the
      last visit carry over to the next call, like the measurements: a server's short requests do not each pay for a
      revisit.
    * The plain step's refresh. From ``margin_rows`` rows nothing else re-times the plain step while another shape
      is taken: after ``explore_every`` steps in a bucket since its last step there, it runs again once
      ``explore_share`` of those steps' time covers the predicted loss of ``min_samples`` plain steps, and those
      steps restart its window (:meth:`BatchPolicy._refresh`), as does any return of the plain step after as many
      steps away. A window timed during another process's burst no longer keeps a speculating shape on for good.
    * The tail. A shape's rate is scaled by :meth:`BatchPolicy.tail_factor` (:mod:`.tail`), predicted from the
      spread of its tokens per row-step (paired, like the tokens), the rows' remaining new tokens and the shape's
      step times at fewer rows.

    A chain must be predicted ``tree_margin`` (5%) faster than the configured tree to replace it: its paired tokens
    flatter it a little; from ``margin_rows`` rows, a narrower chain within ``tree_margin`` of the best chain is
    taken instead of it (a deeper chain's paired tokens flatter it more). From ``margin_rows`` active rows on, a shape
    must be predicted ``margin`` (5%) faster than the plain step to be used (the tail is predicted from a model, while
    the plain step's cost is certain), and its floor ``explore_margin`` (15%) faster to be measured at all: at a large
    batch a step that loses costs several plain steps, and a floor is only a bound. The constants are one
    :class:`~.tuning.PolicyTuning`.

    Measurements carry over to the next call of the same owner (the drafter, or the model) with the same device,
    dtype and shapes (:mod:`.memory`), so a server's first call pays the exploration once.

Caps a user sets
    ``tree_budget`` caps the configured tree (so every shape); ``max_step_tokens`` caps the tokens one verification
    forward feeds for the whole batch (rows x nodes per row, the root included), a latency budget per step: shapes
    over it are not used at that batch size (the plain step always is).

Lossless
    The choice uses only earlier steps, never this step's drafts or draws: greedy output stays the model's own and
    sampled output keeps stock sampling's distribution.
"""

from __future__ import annotations

import time

from . import tail
from .memory import acceptance_rule, memory_of, target_key
from .shapes import Shape, first_child_prefix_host, path_prefix, verdict_counts
from .times import Clock, StepTimes, bucket
from .tuning import PolicyTuning

__all__ = ["BatchPolicy", "batch_policy", "check_policy_settings"]


class BatchPolicy:
    """Chooses each step's :class:`~.shapes.Shape` for the batch (module docstring); one per ``generate`` call.

    ``memory``: ``(owner, key)``; the measurements start from the owner's last call under ``key`` (the owner, a
    drafter or a model, keeps them in its :class:`~.memory.PolicyMemory`) and :meth:`finish` stores this call's.
    ``max_step_tokens``: tokens one forward may feed for the whole batch (``None``: no cap). ``nodes``: a
    :class:`~.budget.CostAwareBudget` the policy drives (``cost_aware``). ``tuning``: the rule's constants.
    ``clock``: what step times are read from (``time.perf_counter``).
    """

    def __init__(self, shapes: list[Shape], explore_every: int = 16, memory: tuple | None = None,
                 max_step_tokens: int | None = None, nodes=None, tuning: PolicyTuning | None = None,
                 clock: Clock | None = None):
        if not shapes:
            raise ValueError("BatchPolicy needs at least one shape.")
        self.shapes = list(shapes)
        self.tuning = tuning if tuning is not None else PolicyTuning()
        self.clock = clock if clock is not None else time.perf_counter
        self.nodes = nodes  # a budget.CostAwareBudget: which nodes of a row's tree are worth feeding (cost_aware)
        self.explore_every = explore_every
        self.max_step_tokens = max_step_tokens
        self.memory = memory
        known = memory_of(memory[0]).policy.get(memory[1]) if memory is not None else None
        n = len(self.shapes)
        prior = self.tuning.prior
        # per shape: decayed sums of committed tokens over the configured tree's steps (the others': what they
        # would have committed on those steps); own: per shape, decayed [committed tokens, row-steps] of its own
        # steps; the step times per (bucket, shape): self.steps
        # (the paired sums start from a prior worth one row-step in which the configured tree commits its whole depth
        # + 1 and every other shape one token: one unlucky first step does not lock the configured tree out, and the
        # others need real evidence to win)
        self.tokens = list(known["tokens"]) if known else [prior * (self.shapes[0].depth + 1)] + [prior] * (n - 1)
        # the same steps' decayed sums of squared tokens per row and their decayed row-steps (the prior's included):
        # each shape's spread of tokens per row-step, from which its tail is predicted (see tail_factor)
        self.squares = list(known["squares"]) if known else [t * t / prior for t in self.tokens]
        self.paired_rows = known["paired_rows"] if known else prior
        # per pair (j, i) of drafter chains, j shallower: decayed [sum, rows] of what chain i commits beyond chain j's
        # depth on the rows where chain j accepted its whole depth (see _beyond): what a chain's step says of a deeper one
        self.chains = [i for i, s in enumerate(self.shapes)
                       if i and not s.plain and s.width == 1 and s.drafter and not s.context]
        self.beyond = {k: list(v) for k, v in known.get("beyond", {}).items()} if known else {}
        self.remaining = None  # the active rows' mean remaining new tokens (start_step)
        self.own = [list(v) for v in known["own"]] if known else [[0.0, 0.0] for _ in range(n)]
        self.steps = StepTimes(self.shapes, self.tuning, known)
        self.plain = self.steps.plain  # the plain step's index (None: not offered)
        # revisits of a losing configured tree: steps since its last visit, the gap to the next one (doubles while
        # it keeps losing) and the exploration budget in seconds (see choose); carried over like the measurements
        self.since_tree, self.gap, self.budget = known["revisits"] if known else (0, explore_every, 0.0)
        # per bucket: [steps, seconds] run there since the plain step's last step there (see _refresh); carried over
        self.plain_since = {k: list(v) for k, v in known.get("plain_since", {}).items()} if known else {}
        self.used = [0] * n
        self.row_steps = [0] * n  # active rows of the steps of each shape (the fraction of rows that speculated)
        self._pending = None  # (shape index, bucket, start time) of the step being measured
        self._observed = (0, 0.0)  # (active rows, committed tokens) of the step being measured (observe)
        # each measured step of the call: [shape label, active rows, committed tokens, seconds, setup] (stats)
        self.trace: list[list] = []
        self._charge = None  # the step being measured is a revisit paid from the budget: its estimated time
        self._fresh = False  # the step being measured is the plain step back after a while: it renews its window
        self._renewing = None  # (bucket, plain steps still owed) while the plain step's window is being renewed
        self._drafted = False  # whether a step of this call ran the drafter (see close)
        self._lagged = False  # the step's drafter had skipped committed tokens (see lagged)
        self._in_step = False  # whether the last step ran the drafter (else a drafting step is a switch: see switch)
        self._done = False

    bucket = staticmethod(bucket)

    @property
    def times(self) -> dict:
        """Per (bucket, shape): the shape's last step times there (:class:`~.times.StepTimes`)."""
        return self.steps.times

    @times.setter
    def times(self, value: dict) -> None:
        self.steps.times = value

    @property
    def best_seen(self) -> dict:
        """Per (bucket, shape): the fastest step the shape ever took there."""
        return self.steps.best_seen

    def seconds(self, bucket: int, shape: int) -> float | None:
        """:meth:`~.times.StepTimes.seconds`."""
        return self.steps.seconds(bucket, shape)

    def estimate(self, bucket: int, shape: int, inherited: bool | None = None) -> float | None:
        """:meth:`~.times.StepTimes.estimate`."""
        return self.steps.estimate(bucket, shape, inherited)

    def floor(self, bucket: int, shape: int) -> float:
        """:meth:`~.times.StepTimes.floor`."""
        return self.steps.floor(bucket, shape)

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

    def threshold(self, bucket: int, rows: int, rates: dict, explore: bool = True) -> float:
        """The rate a shape must be predicted to beat: the best of ``rates`` (shape -> rate), and from ``margin_rows``
        rows on ``1 + explore_margin`` times the plain step's for a shape to be measured (``explore``: its rate is
        then its floor's, a bound), ``1 + margin`` times it for a measured shape to be used."""
        best = max(rates.values()) if rates else 0.0
        if self.plain in rates and rows >= self.tuning.margin_rows:
            margin = self.tuning.explore_margin if explore else self.tuning.margin
            best = max(best, (1 + margin) * rates[self.plain])
        return best

    def optimistic(self, bucket: int, shape: int) -> float:
        """``shape``'s best possible rate in ``bucket``: its tokens over its floor (infinite: nothing known). From
        ``margin_rows`` rows the configured tree runs only on revisits, each a switch whose drafter reads the prompt
        or the tokens since its last forward; the floor leaves those reads out (they are not its time in step), but
        every visit pays one, so its fastest step there, reads included, over ``stale`` floors it too: on the 8.4M
        JF model at 16 rows a floor of 19 ms kept a tree whose visits took 67-100 ms hopeful, and it was measured
        and revisited beside 9 ms plain steps (0.95x stock where plain steps alone ran at 0.99x)."""
        floor = self.steps.floor(bucket, shape)
        if shape == 0 and bucket >= self.steps.large and (fast := self.steps.fastest(bucket, 0)) < float("inf"):
            floor = max(floor, fast / self.tuning.stale)
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
        last forward, on this policy's clock), the active rows' mean remaining new tokens (``None``: unknown), then
        :meth:`choose`."""
        if self.nodes is not None:
            self.nodes.observe(forward_seconds, fed, now=self.clock())
        self.remaining = remaining
        return self.choose(rows)

    def tail_factor(self, bucket: int, rows: int, shape: int, full: float | None = None) -> float:
        """The share of ``shape``'s per-step rate left over a whole static batch (:func:`~.tail.tail_factor`), from
        the spread of its paired tokens per row-step and its step times at fewer rows (:meth:`~.times.StepTimes.drain`:
        measured, else read off the plain step's curve by tokens fed). 1.0 for the plain step (every
        row commits one token), for one row, and while nothing is known of the spread or the rows' remaining tokens.
        ``full``: the shape's step time in ``bucket`` if the caller has it (:meth:`estimate`)."""
        s = self.shapes[shape]
        if s.plain or rows < 2 or not self.remaining or self.remaining <= 0:
            return 1.0
        mu = self.tokens[shape] / self.paired_rows
        if self.own[0][1] == 0 or mu <= 0:  # no paired steps: nothing known of the spread
            return 1.0
        sigma = max(self.squares[shape] / self.paired_rows - mu * mu, 0.0) ** 0.5
        full = self.steps.estimate(bucket, shape) if full is None else full
        if full is None:
            return 1.0
        return tail.tail_factor(rows, self.remaining, mu, sigma, full, self.steps.drain(bucket, shape, full))

    def switch(self, bucket: int, shape: int) -> float:
        """What a step of ``shape`` in ``bucket`` pays beyond its time in step, per step of the run it starts: the
        drafter's setup (:meth:`~.times.StepTimes.overhead`; the prompt on the call's first drafting step, the plain
        steps' tokens after them) over the steps the shape is expected to run, the rows' remaining new tokens over its
        tokens per row-step (the time-to-go of a server's request is not known: ``explore_every`` steps then). 0.0 for
        a shape that drafts nothing (the plain step, a context chain) or when the drafter is in step."""
        s = self.shapes[shape]
        if s.plain or not s.drafter or (self._drafted and self._in_step):
            return 0.0
        extra = self.steps.overhead(bucket, "lag" if self._drafted else "first")
        if extra <= 0.0:
            return 0.0
        per_row = self.tokens[shape] / self.paired_rows if self.own[0][1] > 0 else self.relative_tokens(shape)
        steps = self.remaining / max(per_row, 1.0) if self.remaining else float(self.explore_every)
        return extra / max(steps, 1.0)

    def choose(self, rows: int) -> int:
        """The shape (index into ``shapes``) of the next step of a batch of ``rows`` active rows."""
        self.close()
        self._lagged = False
        tuning, steps = self.tuning, self.steps
        charge = None  # a revisit paid from the budget: the step time its loss was reckoned with
        b = bucket(rows)
        allowed = self.allowed(rows)
        inherited = steps.inherited(b)
        # each allowed shape's step time and predicted rate, once per step (the measuring phase reads them too); a
        # drafting shape after steps that did not draft also pays the switch, spread over the steps it buys
        if self._renewing is not None:  # a renewal of the plain step's window goes on while the batch stays here
            if self._renewing[0] == b and self._renewing[1] > 0 and self.plain in allowed:
                self._renewing, self._charge = (b, self._renewing[1] - 1), None
                return self._start(self.plain, rows, b, fresh=True)
            steps.renewal_dropped(self._renewing[0])  # (the batch shrank into another bucket: the old window stays)
            self._renewing = None
        times = {i: steps.estimate(b, i, inherited) for i in allowed}
        rate = {i: self.relative_tokens(i) / (t + self.switch(b, i)) * self.tail_factor(b, rows, i, t)
                for i, t in times.items() if t is not None}
        # (one shape: nothing to decide; a large batch's first steps of a call, once the plain step is timed, measure
        # no new speculating shape and revisit no tree: they take the best shape measured so far)
        early = rows >= tuning.margin_rows and sum(self.used) < tuning.explore_after and self.plain in rate
        young = allowed[0] if len(allowed) == 1 else self._young(b, rows, allowed, inherited, rate)
        if early and young != self.plain:
            young = None
        if young is not None:
            pick = young
        else:
            best = max(rate, key=rate.get)
            if best not in (0, self.plain) and 0 in rate and rate[best] < (1 + tuning.tree_margin) * rate[0]:
                best = 0  # a close race: a chain's paired tokens flatter it a little, the tree's are its own
            if best not in (0, self.plain) and rows >= tuning.margin_rows:
                # between chains the deeper one's paired tokens flatter it more, and its rows fall further out of
                # step: from margin_rows rows a narrower chain within tree_margin of the best is taken instead
                close = [i for i, r in rate.items() if i not in (0, self.plain)
                         and self.shapes[i].budget < self.shapes[best].budget
                         and r * (1 + tuning.tree_margin) >= rate[best]]
                if close:
                    best = min(close, key=lambda i: self.shapes[i].budget)
            if self.plain in rate and rate[best] < self.threshold(b, rows, {self.plain: rate[self.plain]},
                                                                  explore=False):
                best = self.plain  # a small predicted gain at a large batch: the plain step's cost is certain
            if best == 0:
                self.gap, self.budget = self.explore_every, 0.0
            # revisit a losing tree (fresh paired counts) once the gap has passed and the budget covers the loss: its
            # time minus the time the best shape takes to commit its tokens; each revisit doubles the gap
            # (a time resting on fewer than three steps may hold a warm-up step: the tree is then revisited at its
            # gaps alone, or one slow step could lock it out for good, unless even its floor loses)
            revisit, target = False, 0
            # what a revisit may take: the configured tree; while the plain step wins, also the speculating shape
            # that loses least (at a large batch the tree may cost a dozen plain steps, and a chain measured on a
            # call's first steps, the least predictable text, is never re-measured otherwise: the base model's 1B
            # twin at 64 rows in fp32 ran plain steps beside a chain of 2 alone 1.07x faster)
            targets = [i for i in rate if i != self.plain] if best == self.plain else [0] if 0 in rate else []
            if best != 0 and targets and self.since_tree >= self.gap and not early:
                others = {i: r for i, r in rate.items() if i != 0}
                if 0 in rate and steps.runs(b, 0) < 3 and not inherited and self.hopeful(b, rows, 0, others):
                    # (not in a bucket a shrinking batch passes through, where nothing is measured: the 8.4M JF
                    # model at 16 rows ran its tree at 14, 9, 5 and 4 rows at a call's end, 40-80 ms a step)
                    revisit = True
                elif 0 in rate and self.relative_tokens(0) / (fast := steps.fastest(b, 0)) \
                        * self.tail_factor(b, rows, 0, fast) >= tuning.decisive * self.threshold(b, rows, others):
                    revisit = True  # it has been fast enough to win decisively here: re-measure it at its gaps
                else:
                    loss = {i: times[i] * max(1.0 - rate[i] / rate[best], 0.0) for i in targets}  # (margins)
                    target = min(loss, key=loss.get)
                    revisit = self.budget >= loss[target]
                    if revisit:
                        self.budget -= loss[target]
                        charge = times[target]  # what close() charges beyond: the revisit's measured time is its cost
                if revisit:
                    self.gap = min(2 * self.gap, tuning.max_gap)
            pick = target if revisit else best
            if not revisit and self._refresh(b, rows, times, rate, pick, inherited):
                pick = self.plain
        # from margin_rows rows, the plain step back in a bucket after explore_every steps away (a refresh, or its
        # own choice): its next min_samples steps renew its window (the old one stays until they are all timed)
        fresh = (pick == self.plain and rows >= tuning.margin_rows and not inherited
                 and self.plain_since.get(b, (0, 0.0))[0] >= self.explore_every)
        if fresh:
            self._renewing = (b, tuning.min_samples - 1)
        self._charge = charge
        return self._start(pick, rows, b, fresh)

    def _start(self, pick: int, rows: int, b: int, fresh: bool = False) -> int:
        """Start the step of shape ``pick`` (the bookkeeping of :meth:`choose`); ``fresh``: a step that renews the
        plain step's window. The gap to the next revisit counts from a tree step or a revisit paid from the budget
        (``_charge``, set by :meth:`choose`)."""
        self._fresh = fresh
        self.since_tree = 0 if pick == 0 or self._charge is not None else self.since_tree + 1
        self.used[pick] += 1
        self.row_steps[pick] += int(rows)
        self._pending = (pick, b, self.clock())
        self._done = False
        return pick

    def _refresh(self, b: int, rows: int, times: dict, rate: dict, best: int, inherited: bool) -> bool:
        """Whether to time the plain step again in bucket ``b`` instead of ``best``, a shape that speculates. From
        ``margin_rows`` rows nothing else refreshes the plain step's window while another shape is taken, and a window
        timed while another process ran kept a speculating shape on for whole calls (the 8.4M base model at 16 rows:
        the window said 40-45 ms where the plain step took 31 ms, and a chain of 2, 8% slower per token than the plain
        step there, ran three calls in a row). So after ``explore_every`` steps in the bucket since its last step
        there, the plain step runs again once ``explore_share`` of those steps' time covers the predicted loss of
        ``min_samples`` plain steps and the switch back to drafting (rarely where it is predicted to lose much, at
        once in a close race), and its new steps replace its window. Not in a bucket a shrinking batch passes through
        (nothing is measured there); a call's first steps, which measure no new shape (``explore_after``), may refresh
        it: its step is known, and what it loses there is least."""
        plain, tuning = self.plain, self.tuning
        if (plain is None or plain not in rate or best == plain or rows < tuning.margin_rows or inherited
                or not self.steps.trusted(b, plain)):
            return False
        steps, seconds = self.plain_since.get(b, (0, 0.0))
        if steps < self.explore_every:
            return False
        loss = tuning.min_samples * times[plain] * max(0.0, 1.0 - rate[plain] / rate[best])
        if self.shapes[best].drafter:  # the drafter then catches up on the plain steps' tokens
            loss += self.steps.overhead(b, "lag")
        return tuning.explore_share * seconds >= loss

    def _young(self, b: int, rows: int, allowed: list[int], inherited: bool, rate: dict) -> int | None:
        """The shape to measure next in bucket ``b``, or ``None`` when every shape worth measuring is measured.

        The configured tree comes first, once (its steps feed the paired counts, which do not depend on the batch
        size), then the plain step of the bucket (the cheapest step there is). Any other shape is measured only
        while it could still win (from ``margin_rows`` rows the narrowest such shape first, whose time then
        floors the wider ones, and before it a narrower untimed one of its kind whose time would raise its floor;
        below, the most promising): its tokens over its floor (the plain step's time in this bucket, its own time
        in a smaller bucket carried forward, its ratio to the plain step there) must beat the best rate measured in the
        bucket, with the margin from ``margin_rows`` rows on (:meth:`threshold`). A good tree at batch 1 is not
        left to measure chains that cannot catch up, and a tree that lost at batch 16 is not tried at batch 32.

        In a bucket a batch shrank into (``inherited``), nothing new is measured: a shape timed in the larger
        bucket is known by that time (:meth:`estimate`), one that was not worth timing there is not timed here.
        ``rate``: the predicted rates :meth:`choose` computed this step (every measured shape has one)."""
        steps = self.steps

        def young(i):
            return not steps.trusted(b, i) and not (inherited and steps.estimate(b, i, True) is not None)
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
        if rows >= self.tuning.margin_rows:  # a large batch measures the cheapest hopeful shape first: its time
            first = min(hopeful, key=lambda i: self.shapes[i].budget)  # floors the wider ones (StepTimes.floor)
            me = self.shapes[first]
            # and before it a narrower one of its kind, hopeful or not: timed, it raises the wider one's floor by
            # their time per node (a chain of 8 may be hopeful over the chain of 2's time where the chain of 4 is not)
            alike = [i for i in rest if not self.shapes[i].plain and self.shapes[i].budget < me.budget
                     and self.shapes[i].kind == me.kind]
            return min(alike, key=lambda i: self.shapes[i].budget) if alike else first
        return max(hopeful, key=optimistic.get)

    @property
    def index(self) -> int:
        """The index of the step's shape (0, the configured one, before any :meth:`choose`)."""
        return self._pending[0] if self._pending is not None else 0

    @property
    def current(self) -> Shape:
        """The shape of the step being run (the configured one before any :meth:`choose`)."""
        return self.shapes[self.index]

    def lagged(self) -> None:
        """The step being run drafted from a drafter that skipped committed tokens (a capped catch-up after a run of
        plain steps: a hole in its context). Its drafts are worse than the shape's in step, and its drafter forward
        also caught up: once the configured tree has run, such a step feeds the paired token counts (and their
        level) only when it commits more than the shape is valued at (the hole held it back, if anything), and its
        time is a setup step's, like the call's first drafting step (:meth:`~.times.StepTimes.record`). On the 8.4M
        JF model at 32 rows the tree's revisits after plain runs committed 5 tokens a row-step where it commits 6.6
        in step, which valued the plain step 1.3x over every speculating shape; left out whatever they committed,
        the JF model's 1B twin at batch 1 lost every revisit and ran plain steps beside a tree alone 1.6x faster."""
        self._lagged = True

    def observe(self, tree, verdict) -> None:
        """After the step's verification: the tokens it committed and, on a step of the configured tree, what every
        other shape would have committed on it (:func:`~.shapes.first_child_prefix`)."""
        if self.nodes is not None:
            self.nodes.learn(tree, verdict)
        if self._pending is None:
            return
        pick = self._pending[0]
        nums = verdict_counts(verdict)  # accepted per row, host ints (the engine read them with the verdict)
        rows = len(nums)
        total = sum(nums) + rows
        decay = self.decay(rows)
        # a lagged step's drafts had a hole in their context: fewer tokens than the shape's in step are not counted
        # (the hole may explain them), more are (a bound the shape beats in step). A first step of the tree counts:
        # nothing else is known
        lagged = self._lagged and self.own[0][1] > 0 and total <= rows * self.tokens[pick] / self.paired_rows
        own = self.own[pick]
        own[0] = decay * own[0] + total
        own[1] = decay * own[1] + rows
        if pick == 0 and not lagged:  # paired counts
            committed = [n + 1 for n in nums]
            prefix = first_child_prefix_host(tree, verdict)
            context = None  # the first context match's path (tree.context_path), for context chains
            self._beyond(prefix, None, decay)
            self.tokens[0] = decay * self.tokens[0] + sum(committed)
            self.squares[0] = decay * self.squares[0] + sum(c * c for c in committed)
            self.paired_rows = decay * self.paired_rows + rows
            for i, shape in enumerate(self.shapes[1:], 1):
                if not shape.drafter:
                    if context is None:
                        context = (path_prefix(verdict, tree.context_path).tolist() if tree.context_path is not None
                                   else [0] * rows)
                    would = [min(c, shape.depth) + 1 for c in context]
                else:
                    would = [min(p, shape.depth) + 1 for p in prefix]
                self.tokens[i] = decay * self.tokens[i] + sum(would)
                self.squares[i] = decay * self.squares[i] + sum(w * w for w in would)
        elif pick != 0 and not self.shapes[pick].plain and not lagged and self.own[0][1] > 0:
            self._level(pick, nums, decay)
        self._observed = (int(rows), float(total))
        self._done = True

    def decay(self, rows: int) -> float:
        """What a step of ``rows`` active rows scales the decayed token sums by: ``decay`` per row-step, at least
        ``step_decay`` (a step's rows share one stretch of text; :class:`~.tuning.PolicyTuning`)."""
        return max(self.tuning.decay ** max(int(rows), 1), self.tuning.step_decay)

    def _beyond(self, prefix: list[int], limit: int | None, decay: float) -> None:
        """Learn, per pair of drafter chains (shallower ``j``, deeper ``i``), what chain ``i`` commits beyond ``j``'s
        depth on rows where ``j`` accepted its whole depth, from rows whose accepted prefix along the drafter's chain
        is ``prefix`` (exact up to ``limit`` levels: a chain's own step, whose rows stop at its depth; ``None``: a step
        of the configured tree, exact at any depth); ``decay``: the step's (:meth:`decay`)."""
        for j in self.chains:
            dj = self.shapes[j].depth
            full = [p for p in prefix if p >= dj]
            for i in self.chains:
                di = self.shapes[i].depth
                if di <= dj or (limit is not None and di > limit):
                    continue
                kept = self.beyond.setdefault((j, i), [0.0, 0.0])
                kept[0] = decay * kept[0] + float(sum(min(p, di) - dj for p in full))
                kept[1] = decay * kept[1] + len(full)

    def _level(self, pick: int, accepted: list[int], decay: float) -> None:
        """A step of a speculating shape other than the configured tree, whose rows accepted ``accepted`` drafted
        tokens: one more paired step. A chain's step says exactly what every shorter chain of its kind would have
        committed on it (its accepted prefix, cut to their depth) and the plain step one token; a deeper chain of its
        drafter commits the same on the rows that stopped short of its depth, and on the others its depth + 1 plus what
        the deeper chain was seen to commit beyond it on such rows (:meth:`_beyond`; scaled like the rest, the ratio of
        a chain of 4 to a chain of 2 stayed at what the tree's first steps had seen, 1.15, where it was 1.33 in step,
        and the JF model's 1B twin at batch 4 ran the chain of 2 beside a chain of 4 alone 1.14x faster); every other
        shape (the tree, a deeper chain before that is known) commits its share scaled as the step's own shape's tokens
        were against the paired sums (at most its depth + 1). At a large batch the tree may run only on a call's first steps, where the text
        is the least predictable (the 8.4M JF model at 16 rows: the tree 3.7-5.2 tokens a row-step on its first three
        steps, 8.6-9.9 after; a chain of 4 against a chain of 2, 1.2-1.3x there and 1.4-1.5x after), and sums read
        there alone valued every speculating shape 20-30% low against the plain step, and deeper chains low against
        shorter ones, for good: the base model's 1B twin at 16 rows ran plain steps at 0.98x stock beside a chain of 2
        alone at 1.06x."""
        paired = self.paired_rows
        me = self.shapes[pick]
        chain = me.width == 1 and not me.context  # (its accepted prefix is every shorter chain's of its kind)
        rows = len(accepted)
        expected = self.tokens[pick] / paired
        if expected <= 0 or rows == 0:
            return
        scale = (sum(accepted) + rows) / rows / expected
        mine = pick in self.chains
        if mine:
            self._beyond(accepted, me.depth, decay)
        for i, shape in enumerate(self.shapes):
            deeper = self.beyond.get((pick, i), (0.0, 0.0))  # (kept for pairs of drafter chains only)
            if shape.plain:
                tokens = squares = float(rows)
            elif chain and i != 0 and shape.width == 1 and shape.drafter == me.drafter and not shape.context \
                    and shape.depth <= me.depth:
                would = [min(a, shape.depth) + 1 for a in accepted]  # exact: a shorter chain of the same kind
                tokens, squares = float(sum(would)), float(sum(w * w for w in would))
            elif deeper[1] > 0:
                # a deeper chain of the same drafter: exact on the rows that stopped short of this chain's depth, and
                # on those that reached it this chain's depth + 1 plus what it was seen to commit beyond it there
                extra = me.depth + 1 + deeper[0] / deeper[1]
                would = [a + 1 if a < me.depth else extra for a in accepted]
                tokens, squares = float(sum(would)), float(sum(w * w for w in would))
            else:
                mean = min(self.tokens[i] / paired * scale, shape.depth + 1.0)
                spread = self.squares[i] * paired / max(self.tokens[i], 1e-12) ** 2  # second moment over mean^2
                tokens, squares = rows * mean, rows * mean * mean * spread
            self.tokens[i] = decay * self.tokens[i] + tokens
            self.squares[i] = decay * self.squares[i] + squares
        self.paired_rows = decay * paired + rows

    def close(self) -> None:
        """End the step being measured: its time runs from :meth:`choose` to here (the next step's start)."""
        if self._pending is None or not self._done:
            return
        pick, b, start = self._pending
        seconds = max(self.clock() - start, 1e-9)
        shape = self.shapes[pick]
        # the call's first step with a drafter forward also ran the drafter over the whole prompt, a cost paid once
        # per call, and a lagged one caught up: setup steps (StepTimes.record decides where their time counts)
        drafts = shape.drafter and not shape.plain
        setup = ("first" if not self._drafted else "lag" if self._lagged else False) if drafts else False
        self._drafted = self._drafted or drafts
        self._in_step = drafts
        self.steps.record(b, pick, seconds, setup=setup, bursts=pick == 0, fresh=self._fresh)
        self.trace.append([shape.label, *self._observed, seconds, setup or None])
        if pick == self.plain:
            self.plain_since[b] = [0, 0.0]
        else:
            since = self.plain_since.setdefault(b, [0, 0.0])
            since[0], since[1] = since[0] + 1, since[1] + seconds
        if self._charge is None and pick != 0:
            # the exploration budget grows with the time spent away from the configured tree and from revisits
            self.budget += self.tuning.explore_share * seconds
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
            memory_of(owner).policy[key] = {
                "tokens": list(self.tokens), "own": [list(o) for o in self.own], **self.steps.state(),
                "squares": list(self.squares), "paired_rows": self.paired_rows,
                "beyond": {k: list(v) for k, v in self.beyond.items()},
                "revisits": (self.since_tree, self.gap, self.budget),
                "plain_since": {k: list(v) for k, v in self.plain_since.items()}}

    @property
    def stats(self) -> dict:
        total = max(sum(self.row_steps), 1)
        plain = sum(n for s, n in zip(self.shapes, self.row_steps) if s.plain)
        nodes = {} if self.nodes is None else self.nodes.stats
        return {**nodes, "shape_steps": {s.label: n for s, n in zip(self.shapes, self.used) if n},
                "shape_row_steps": {s.label: n for s, n in zip(self.shapes, self.row_steps) if n},
                "speculated_row_share": 1.0 - plain / total,
                # what each step was: [shape, active rows, committed tokens, seconds from this step's choice to the
                # next one's, setup ("first": the drafter read the prompt; "lag": it caught up; None)]
                "step_trace": [list(t) for t in self.trace]}


def check_policy_settings(adaptive, max_step_tokens) -> None:
    """``adaptive`` (True / False) and ``max_step_tokens`` (``None`` or an integer >= 1, with ``adaptive`` only)."""
    from ...engine.run import check_bool_setting, check_int_setting

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
    device, dtype, shapes, acceptance rule (:func:`~.memory.acceptance_rule`) and target model
    (:func:`~.memory.target_key`: a drafter shared by two models, a model and its cost twin say, learns each one's
    cost curve and acceptance apart). Its steps are timed on the target model's clock (:class:`~.memory.PolicyMemory`)."""
    if not adaptive and nodes is None:
        return None
    shapes = list(shapes) if adaptive else list(shapes[:1])
    key = (run.name, str(run.rows.device), str(run.model.dtype), tuple(shapes),
           acceptance_rule(run.generation_config, run.logits_processor), target_key(run.model))
    return BatchPolicy(shapes, memory=(owner, key), max_step_tokens=max_step_tokens, nodes=nodes,
                       clock=memory_of(run.model).clock)
