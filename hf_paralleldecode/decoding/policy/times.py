"""Step times: each shape's measured wall time per step and batch-size bucket, and what can be read off them.

The clock
    A step is timed on a :data:`Clock`, a callable giving seconds as a float: ``time.perf_counter`` unless the model's
    memory (:class:`~.memory.PolicyMemory`) holds another, so a test runs the policy on a clock it advances itself.
    A step's time runs from the policy's choice to the next one: the drafter, the verification forward and the host
    work, hardly the text.

Buckets
    Times are kept per shape and per batch-size bucket (powers of two of the active rows: 1, 2-3, 4-7, ...): a step's
    time depends on the shape, the batch and the device. A shape is trusted in a bucket after
    ``min_samples`` steps there (:class:`~.tuning.PolicyTuning`); its estimate is the mean of its last ``window``
    steps without the slowest one once there are three, and a step much faster than the estimate (``stale``)
    replaces the window, below ``margin_rows`` rows also before the shape is trusted (a warm-up's steps, each faster
    than the last, are not averaged into its time); below ``margin_rows`` a trusted window found stale also sends
    the bucket's other shapes back to be measured (what slowed it slowed them). A batch that shrinks passes through
    smaller buckets, where a shape's time in a larger bucket stands in (fewer rows are never slower), and a shape not
    yet measured in a bucket is bounded from below by what is known (:meth:`StepTimes.floor`).

Switches
    A drafting step after steps that did not draft also does the drafter's setup (the whole prompt on a call's first
    one, the plain steps' tokens after them). Its time is kept apart, per kind, and what it took beyond the shape's
    time in step is what a switch costs (:meth:`StepTimes.overhead`); the rule spreads it over the steps a switch buys.

What it deliberately does not know
    Tokens, rates, the rule (:mod:`.rule`); which shape a step ran (the rule tells :meth:`StepTimes.record`).
"""

from __future__ import annotations

from collections.abc import Callable

from .shapes import Shape
from .tuning import PolicyTuning

__all__ = ["Clock", "StepTimes", "bucket"]

#: a clock: seconds from any origin, as a float (``time.perf_counter``, or a fake one in tests)
Clock = Callable[[], float]


def bucket(rows: int) -> int:
    """The batch-size bucket of ``rows`` active rows: 0 for 1, 1 for 2-3, 2 for 4-7, 3 for 8-15, ..."""
    return max(int(rows), 1).bit_length() - 1


class StepTimes:
    """Per (bucket, shape index): the last step times (``times``) and the fastest step ever taken (``best_seen``).

    ``known``: the state a previous call left (:meth:`state`), to start from.
    """

    def __init__(self, shapes: list[Shape], tuning: PolicyTuning, known: dict | None = None):
        self.shapes = shapes
        self.plain = next((i for i, s in enumerate(shapes) if s.plain), None)  # the plain step's index
        self.tuning = tuning
        self.times: dict[tuple[int, int], list[float]] = (
            {k: list(v) for k, v in known["times"].items()} if known else {})
        self.best_seen: dict[tuple[int, int], float] = dict(known.get("best_seen", {})) if known else {}
        # per (bucket, shape): the fastest step that did not also read the prompt into the drafter (see floor)
        self.clean: dict[tuple[int, int], float] = dict(known.get("clean", {})) if known else {}
        # per (bucket, shape) without a step in its window yet: the fastest setup step (see record), its stand-in
        self.setup: dict[tuple[int, int], float] = dict(known.get("setup", {})) if known else {}
        # per (bucket, shape): every step it ran, setup steps included (see runs)
        self.run_counts: dict[tuple[int, int], int] = dict(known.get("runs", {})) if known else {}
        # per (bucket, shape, kind): the last setup steps' times ("first": the call's first drafting step, which read
        # the prompt into the drafter; "lag": a drafting step after plain steps), what a switch costs (see overhead)
        self.switches: dict[tuple[int, int, str], list[float]] = (
            {k: list(v) for k, v in known.get("switches", {}).items()} if known else {})
        self.large = bucket(tuning.margin_rows)  # the first bucket where a shape's own first steps floor it
        # per bucket: the plain step's new steps while its window is renewed (see record: fresh), not yet in use
        self.renewal: dict[int, list[float]] = {}

    def state(self) -> dict:
        """What a later call starts from (``known``)."""
        return {"times": {k: list(v) for k, v in self.times.items()}, "best_seen": dict(self.best_seen),
                "clean": dict(self.clean), "setup": dict(self.setup), "runs": dict(self.run_counts),
                "switches": {k: list(v) for k, v in self.switches.items()}}

    def record(self, bucket: int, shape: int, seconds: float, setup: bool | str = False, bursts: bool = False,
               fresh: bool = False) -> None:
        """A step of ``shape`` in ``bucket`` took ``seconds``. ``setup``: a step whose drafter forward also did work a
        switch to drafting pays once, ``"first"`` (the call's first drafting step read the whole prompt; ``True``
        means it too) or ``"lag"`` (a drafting step after plain steps caught up on their tokens). It never joins the
        window: its time is kept apart (:meth:`overhead`: what a switch costs, which the rule spreads over the steps
        the switch buys) and stands in for the shape's time only while the window is empty. Charged to the shape's
        window instead, from 8 rows the switch cost kept winning chains out (the 8.4M JF model at 16 rows timed a
        chain of 2 at 33 ms on such steps where it takes about 20 ms in step, never measured the chain of 4, and ran
        plain steps beside a chain of 4 alone 1.14x faster). One much faster than the window still replaces it: the
        window is stale. ``bursts``: a shape that runs in short bursts, each a switch (the configured tree from
        ``margin_rows`` rows, which runs there only on revisits): its setup steps also join a window not yet trusted,
        where what a switch costs is part of every run it has (kept apart, the tree at 16 and 32 rows was never
        trusted, floored nothing at 64, and was measured there: two steps at ten plain steps' cost each). ``fresh``:
        a step of the plain step back after a while (:meth:`~.rule.BatchPolicy._refresh`): its window is old, and
        ``min_samples`` such steps in a row replace it (until then the old one stays in use: a batch that shrinks
        into another bucket midway keeps a trusted time here)."""
        key = (bucket, shape)
        self.run_counts[key] = self.run_counts.get(key, 0) + 1
        if fresh and not setup:
            new = self.renewal.setdefault(bucket, [])
            new.append(seconds)
            self.best_seen[key] = min(self.best_seen.get(key, seconds), seconds)
            self.clean[key] = min(self.clean.get(key, seconds), seconds)
            if len(new) >= self.tuning.min_samples:
                self.times[key] = self.renewal.pop(bucket)
            return
        window = self.times.get(key)
        faster = bool(window) and seconds * self.tuning.stale < self.seconds(bucket, shape)
        if setup and not faster and not (bursts and bucket >= self.large and not self.trusted(bucket, shape)):
            kept = self.switches.setdefault((bucket, shape, "first" if setup is True else str(setup)), [])
            kept.append(seconds)
            del kept[: -self.tuning.window]
            if not window:
                self.setup[key] = min(self.setup.get(key, seconds), seconds)
                self.best_seen[key] = min(self.best_seen.get(key, seconds), seconds)
            return
        self.setup.pop(key, None)
        t = self.times.setdefault(key, [])
        if faster and (self.trusted(bucket, shape) or bucket < self.large):
            # the window's steps ran under conditions that have passed: another process's burst, or a warm-up (on a
            # GPU a shape's first steps in a process can take 10x its later ones, first lazy initialisations, then
            # new allocations: a window of two such steps, trusted, floored every wider shape and locked all out).
            # Before the window is trusted only below margin_rows rows: from there a step is mostly the forward's
            # compute, and measuring a shape again costs several plain steps (the 8.4M base model at 32 rows went
            # from 0.97x stock to 0.88x re-measuring shapes whose first steps had been slower)
            if bucket < self.large and self.trusted(bucket, shape):
                # what made the window slow held for every shape timed here: below margin_rows, where a step is
                # cheap, the others are measured again (kept, the JF 1B twin at batch 1 compared a tree re-timed at
                # 0.12 s with chains and a plain step timed at 0.3-0.48 s in the process's first calls, and ran the
                # tree on every step, 20% slower than the chain of 2)
                for other in [k for k in self.times if k[0] == bucket and k[1] != shape]:
                    del self.times[other]
            t.clear()
        t.append(seconds)
        self.best_seen[key] = min(self.best_seen.get(key, seconds), seconds)
        if not setup:
            self.clean[key] = min(self.clean.get(key, seconds), seconds)
        del t[: -self.tuning.window]

    def renewal_dropped(self, bucket: int) -> None:
        """A renewal of the plain step's window in ``bucket`` ended before ``min_samples`` steps: its old window
        stays."""
        self.renewal.pop(bucket, None)

    def overhead(self, bucket: int, kind: str) -> float:
        """What a switch of ``kind`` (:meth:`record`) adds to a drafting step in ``bucket``: over the shapes with a
        trusted window and such setup steps there, the median setup step's time less the shape's time in step,
        averaged (never below zero). 0.0 while nothing is known: the first switch is then taken at the shape's time
        and measured."""
        extra = []
        for (k, shape, what), kept in self.switches.items():
            if k == bucket and what == kind and kept and self.trusted(bucket, shape):
                median = sorted(kept)[(len(kept) - 1) // 2]
                extra.append(median - self.seconds(bucket, shape))
        return max(sum(extra) / len(extra), 0.0) if extra else 0.0

    def runs(self, bucket: int, shape: int) -> int:
        """How many steps ``shape`` ran in ``bucket``, setup steps included (which may not be in its window)."""
        return max(self.run_counts.get((bucket, shape), 0), len(self.times.get((bucket, shape), ())))

    def seconds(self, bucket: int, shape: int) -> float | None:
        """The step time of ``shape`` in ``bucket``: the mean of its last ``window`` steps there without the
        slowest one once there are three (a step slowed by a first call's warm-up or another process does not
        stick, while a shape whose steps are often slow, a drafter catching up, is charged for them), ``None``
        unmeasured."""
        samples = self.times.get((bucket, shape))
        if not samples:
            return self.setup.get((bucket, shape))
        kept = sorted(samples)[:-1] if len(samples) >= 3 else samples
        return sum(kept) / len(kept)

    def fastest(self, bucket: int, shape: int) -> float:
        """The fastest step ``shape`` ever took in ``bucket`` (its window's included; infinite: none)."""
        samples = self.times.get((bucket, shape), ())
        return min([self.best_seen.get((bucket, shape), float("inf")), *samples])

    def trusted(self, bucket: int, shape: int) -> bool:
        """Whether ``shape`` has run ``min_samples`` steps in ``bucket``."""
        return len(self.times.get((bucket, shape), ())) >= self.tuning.min_samples

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

    def drain(self, bucket: int, shape: int, full: float) -> list[float | None]:
        """``shape``'s step time in each bucket below ``bucket``, from one row up, for the tail of a batch that drains
        through them: its own trusted time where it has one; else read off the step-time curve by tokens fed, between the
        plain step's times (a step of ``r`` rows feeds ``r`` tokens) and ``full``, the shape's time in ``bucket``
        (``rows x (budget + 1)`` tokens there). A chain at 16 rows of a 1B model's bf16 CPU cost took 0.26 s and a
        plain step 0.14 s: at 8 rows it feeds 24 tokens, and the curve puts it near 0.17 s, not 0.26 (a host-bound
        model's flat curve keeps it near ``full``). ``None``: nothing to read it from (``full`` stands in)."""
        nodes = self.shapes[shape].budget + 1
        plain = {} if self.plain is None else {
            k: t for k in range(bucket + 1) if (t := self.seconds(k, self.plain)) is not None}
        rows = 2 ** bucket  # (a bucket's times stand for its smallest batch)
        out: list[float | None] = []
        for k in range(bucket):
            own = self.seconds(k, shape) if self.trusted(k, shape) else None  # (not a larger bucket's time)
            if own is not None or bucket not in plain or self.shapes[shape].plain:
                out.append(own)
                continue
            fed = 2 ** k * nodes
            if fed >= rows:  # between the plain step here (rows tokens) and the shape here (rows x nodes)
                t = plain[bucket] + (full - plain[bucket]) * (fed - rows) / max(rows * nodes - rows, 1)
            else:  # fewer tokens than a plain step here feeds: the plain step of the bucket feeding about as many
                below = [plain[j] for j in range(bucket) if j in plain and 2 ** j <= fed]
                t = below[-1] if below else plain[bucket]
            out.append(min(max(t, plain.get(k, 0.0)), full))
        return out

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
        the plain step's time here, from ``margin_rows`` rows on of the shape's own fastest step here over ``stale``
        (there a step is mostly the forward's compute: a warm-up adds little, and one step of a tree that lost by 3x
        at 16 rows of a 1B model's CPU cost, a second of a call of 14, is not taken twice more to be sure; a step that
        also read the prompt into the drafter counts less what such a switch is known to cost here, :meth:`overhead`,
        and not at all before that is known: the 1B base twin's tree took 2.4 s on such a step, 0.955 s in step), and
        of what the measured shapes here that draft alike
        and feed fewer nodes say:
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
        narrower = sorted((other.budget + 1, self.seconds(bucket, j), other.kind == me.kind)
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
        if (bucket, shape) in self.clean and bucket >= self.large:
            out = max(out, self.clean[(bucket, shape)] / self.tuning.stale)
        if bucket >= self.large:  # a setup step less what a switch of its kind is known to cost here, likewise
            for kind in ("first", "lag"):
                kept = self.switches.get((bucket, shape, kind))
                if kept and (extra := self.overhead(bucket, kind)) > 0.0:
                    out = max(out, (min(kept) - extra) / self.tuning.stale)
        return out
