"""Cost-aware tree budgets: a drafted node enters the verification forward only when its expected gain pays for it.

The rule
    A step that feeds ``w`` tokens per row at batch ``b`` costs ``T(b * w) + h``: the forward (``T``,
    measured on the device at hand, :class:`ForwardCost`) plus the host work of a step (``h``,
    followed as the run goes). It commits ``1 + E[accepted]`` tokens per row, and
    ``E[accepted] = sum of P(node accepted)`` over the drafted nodes (the nodes of one depth exclude
    each other, so their probabilities add up). ``P(node)`` is the product along the node's path of
    ``c(source, rank, depth)`` of each node on it: how often a node created by that proposer's
    candidate of that rank, at that depth, was accepted when its parent was
    (:class:`AcceptanceModel`, learned from the verdicts of the run, prior Beta(1, 1)).

    Nodes a proposer needs whatever they are worth (a Jacobi block or lookahead window: its update
    reads their logits) are *mandatory*. The optional ones are taken best first (``P`` never grows
    along a path, so parents come before children) and their number ``k`` maximises the tokens per
    second of the step::

        sum over rows of (1 + sum P of the row's mandatory and first k optional nodes)
        ---------------------------------------------------------------------------------
                       T(b * (widest mandatory part + k + 1)) + h

    A CPU, whose forward cost grows with every token, keeps few candidates; a GPU, flat up to its
    roofline knee, keeps many. ``tree_budget`` stays a hard cap on top.

Timing and memory
    The budget is driven by its :class:`~.rule.BatchPolicy`, which reads the one clock of the call (the target
    model's, :class:`~.memory.PolicyMemory`) and hands the budget each step's start; the forward-cost probe reads
    the same clock. The measured forward-cost points are kept in the model's memory, the acceptance counts in their
    owner's (the model, or the drafter), for the next call.

What it deliberately does not know
    Where candidates come from; :func:`~hf_paralleldecode.engine.tree.pack_candidates` applies the choice.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...attention import decoding_attention, get_attention_priority
from .memory import memory_of

__all__ = ["ForwardCost", "AcceptanceModel", "CostAwareBudget", "forward_cost", "time_forwards", "ForwardTimes"]

#: token counts the forward is timed at (per forward, all rows together); linear in between and beyond
MEASURED_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ForwardCost:
    """``T(n)``: seconds of one target forward feeding ``n`` new tokens (all rows together).

    Measured points ``(n, seconds)``, linear interpolation between them and linear extrapolation
    past the last two (:func:`forward_cost` measures them; a preset can give them).
    """

    def __init__(self, points: list[tuple[int, float]]):
        if len(points) < 2:
            raise ValueError("ForwardCost needs at least two (tokens, seconds) points.")
        pts = sorted((int(n), float(s)) for n, s in points)
        best = 0.0
        self.points = []
        for n, s in pts:  # a forward never gets cheaper with more tokens: smooth timing noise away
            best = max(best, s)
            self.points.append((n, best))
        self.scale = 1.0  # observed / predicted, followed during a run (see observe)

    def observe(self, tokens: int, seconds: float) -> None:
        """Correct the level of the curve with a forward actually timed in the run (moving average of
        observed / predicted): the calibration's shape, the run's level."""
        predicted = self._curve(tokens)
        if predicted > 0:
            self.scale = 0.9 * self.scale + 0.1 * seconds / predicted

    def __call__(self, tokens: int) -> float:
        return self.scale * self._curve(tokens)

    def _curve(self, tokens: int) -> float:
        pts = self.points
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if tokens <= n1 or (n1, s1) == pts[-1]:
                slope = (s1 - s0) / (n1 - n0)
                return max(s0 + slope * (tokens - n0), 0.0) if tokens >= n0 else s0
        return pts[-1][1]  # pragma: no cover - the loop always returns

    def to_dict(self) -> dict:
        return {"tokens": [n for n, _ in self.points], "seconds": [s for _, s in self.points]}


class ForwardTimes(NamedTuple):
    """What :func:`time_forwards` measured."""

    #: ``[(n, seconds)]``: the median forward of ``n`` tokens a row after the prefix, for each ``n`` asked
    points: list[tuple[int, float]]
    #: seconds of the prefix's prefill (the median of the prefills made); ``None`` when there is no prefix
    prefill: float | None


@torch.no_grad()
def time_forwards(model, context: int = 64, repeats: int = 5, tokens=MEASURED_TOKENS, batch: int = 1,
                  warmups: int = 1, reuse_prefix: bool = False, clock=None) -> ForwardTimes:
    """``points``: the median of ``repeats`` forwards of ``n`` tokens a row for ``batch`` rows (``n`` in
    ``tokens``), each after a ``context``-token prefix held in a cache, after ``warmups`` untimed ones; timed on
    ``clock`` (default ``time.perf_counter``) with a device sync on CUDA, under the attention priority of decoding
    calls (:func:`hf_paralleldecode.attention.decoding_attention`). Nothing is remembered: :func:`forward_cost`
    keeps its curve in the model's memory.

    By default every forward gets a freshly prefilled cache. ``reuse_prefix=True`` prefills once and crops the cache
    back to the prefix after each forward: the same forwards, without a prefill each (at 64 rows of a 1B model in
    fp32 on a CPU one prefill costs minutes). The prefills are timed too (``prefill``). It needs a cache that crops, so a model with a recurrent state
    (Mamba, RWKV, linear attention) is refused. ``context=0`` times forwards from an empty cache: prefills.
    """
    import time

    from ...compat import DynamicCache, cache_kwargs, has_recurrent_state

    context, batch, repeats, warmups = int(context), int(batch), int(repeats), int(warmups)
    if context < 0 or batch < 1 or repeats < 1 or warmups < 0 or not tokens or min(tokens) < 1:
        raise ValueError(f"time_forwards needs context >= 0, batch >= 1, repeats >= 1, warmups >= 0 and token "
                         f"counts >= 1; got context={context}, batch={batch}, repeats={repeats}, warmups={warmups}, "
                         f"tokens={tuple(tokens)}.")
    if reuse_prefix and has_recurrent_state(model):
        raise ValueError(f"reuse_prefix=True crops the cache back to the prefix after each forward, which cannot "
                         f"rewind the recurrent state of {type(model).__name__}; time it with reuse_prefix=False.")
    clock = clock or time.perf_counter
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 2
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    generator = torch.Generator().manual_seed(0)  # the user's global RNG stays untouched
    longest = max(tokens)
    ids = torch.randint(0, vocab, (batch, context + longest), generator=generator).to(device)

    prefills = []

    def prefilled():
        cache = DynamicCache()
        if context:
            sync()
            t0 = clock()
            model(input_ids=ids[:, :context], use_cache=True, **cache_kwargs(model, cache))
            sync()
            prefills.append(clock() - t0)
        return cache

    points = []
    with decoding_attention(device):  # the attention order decoding calls run with (cuDNN's after the others)
        cache = prefilled() if reuse_prefix else None
        for n in tokens:
            times = []
            for _ in range(repeats + warmups):
                if not reuse_prefix:
                    cache = prefilled()
                sync()
                t0 = clock()
                model(input_ids=ids[:, context:context + n], use_cache=True, **cache_kwargs(model, cache))
                sync()
                times.append(clock() - t0)
                if reuse_prefix:
                    cache.crop(-n)  # back to the prefix (a negative count: the same call on every tested release)
            timed = sorted(times[warmups:])
            points.append((int(n), timed[len(timed) // 2]))
    return ForwardTimes(points, sorted(prefills)[len(prefills) // 2] if prefills else None)


def forward_cost(model, context: int = 64, repeats: int = 5, tokens=MEASURED_TOKENS, batch: int = 1,
                 warmups: int = 1) -> ForwardCost:
    """Measure (once per model, device and dtype; kept in the model's :class:`~.memory.PolicyMemory`) ``T(n)`` for
    ``n`` in :data:`MEASURED_TOKENS`.

    Each point is the median of ``repeats`` forwards of ``n`` tokens (``n`` in ``tokens``) after a
    ``context``-token prefix held in a cache, timed with a device sync on CUDA, for ``batch`` rows (``n`` tokens
    each), after ``warmups`` untimed ones, on the model's clock, with the attention priority of decoding calls
    (:func:`time_forwards`, each forward on a freshly prefilled cache). Costs a few dozen forwards.
    On a model with a learned position table (GPT-2's ``n_positions``) the probe stays inside it: the prefix
    shrinks to a quarter of the table at most and sizes that would not fit are not measured.
    """
    from ...engine.support import position_table_size

    table = position_table_size(model)
    if table is not None:
        context = min(int(context), table // 4)
        tokens = tuple(n for n in tokens if context + n <= table) or (1,)
    device = next(model.parameters()).device
    key = (str(device), str(next(model.parameters()).dtype), int(context), tuple(tokens), int(batch), int(warmups),
           str(get_attention_priority()))
    memory = memory_of(model)
    known = memory.forward_costs
    if key in known:
        return ForwardCost(known[key])  # a fresh level per run, the measured shape
    points = time_forwards(model, context=context, repeats=repeats, tokens=tokens, batch=batch, warmups=warmups,
                           clock=memory.clock).points
    known[key] = ForwardCost(points).points
    return ForwardCost(points)


class AcceptanceModel:
    """``c(source, depth)``: acceptance of a drafted node given its parent was accepted, learned online.

    ``conditionals(sources, length)`` gives each candidate token's ``c``; ``update(tree, verdict)``
    counts, for every node a candidate created, whether it was accepted when its parent was.
    """

    def __init__(self, num_sources: int, max_depth: int = 64, prior: tuple[float, float] = (1.0, 1.0), device=None):
        self.hits = torch.full((num_sources, max_depth), prior[0], device=device)
        self.trials = torch.full((num_sources, max_depth), prior[0] + prior[1], device=device)

    def carry(self, hits: torch.Tensor, trials: torch.Tensor, cap: float) -> None:
        """Start from counts learned before (another call), each cell scaled down to at most ``cap`` trials:
        their rates, with a weight the run's own verdicts soon outweigh."""
        scale = (cap / trials).clamp(max=1.0)
        self.hits = (hits * scale).to(self.hits.device)
        self.trials = (trials * scale).to(self.trials.device)

    def set_prior(self, key: int, mean: float, strength: float = 2.0) -> None:
        """Start ``key`` (every depth) from a prior of mean ``mean`` worth ``strength`` verdicts."""
        self.hits[key] = mean * strength
        self.trials[key] = strength

    def rates(self) -> torch.Tensor:
        return self.hits / self.trials  # [sources, depth]

    def conditionals(self, sources: torch.Tensor, length: int) -> torch.Tensor:
        """``[batch, candidates, length]``: ``c`` of each candidate token's key at its depth (``sources``
        ``[batch, candidates]``); a node's ``P`` is the product of these along its path."""
        rates = self.rates()
        if length > rates.shape[1]:
            rates = torch.cat([rates, rates[:, -1:].expand(-1, length - rates.shape[1])], dim=1)
        return rates[sources.clamp(min=0), :length]

    def update(self, tree, verdict) -> None:
        """Count the drafted nodes of ``tree`` by key and depth: node by node when the tree carries
        ``node_keys`` (:meth:`CostAwareBudget.trim`), else its fresh candidate nodes
        (:func:`~.tree.pack_candidates`) by the candidates' keys."""
        batch, width = tree.tokens.shape
        accepted = torch.zeros((batch, width + 1), dtype=torch.bool, device=tree.tokens.device)
        accepted.scatter_(1, torch.where(verdict.path >= 0, verdict.path, width), True)
        accepted = accepted[:, :width]
        if tree.node_keys is not None:
            keys = tree.node_keys
            parent_ok = accepted.gather(1, tree.parents.clamp(min=0))
            tried = (keys >= 0) & (tree.parents >= 0) & parent_ok
            depth = (tree.depth - 1).clamp(min=0, max=self.hits.shape[1] - 1)
            self._count(keys.clamp(min=0), depth, tried, tried & accepted)
            return
        sources = tree.candidate_sources
        if sources is None or tree.candidate_index is None or tree.candidate_index.shape[-1] == 0:
            return
        node = tree.candidate_index.clamp(min=0)
        fresh = tree.candidate_fresh
        length = fresh.shape[-1]
        parent_ok = accepted.gather(1, tree.parents.clamp(min=0)).gather(1, node.flatten(1)).view_as(node)
        tried = fresh & parent_ok
        hit = tried & accepted.gather(1, node.flatten(1)).view_as(node)
        depth = torch.arange(length, device=node.device).clamp(max=self.hits.shape[1] - 1)
        self._count(sources.clamp(min=0)[..., None], depth, tried, hit)

    def _count(self, keys, depth, tried, hit) -> None:
        """Add ``tried`` / ``hit`` (bool) to the counts of ``(keys, depth)`` (broadcast together)."""
        index = (keys * self.hits.shape[1] + depth).expand_as(tried).flatten()
        self.trials.view(-1).index_add_(0, index, tried.flatten().to(self.trials.dtype))
        self.hits.view(-1).index_add_(0, index, hit.flatten().to(self.hits.dtype))


class CostAwareBudget:
    """Chooses how many optional nodes each step feeds (module docstring); one per ``generate`` call.

    ``mandatory_sources``: the source ids whose candidates are always fed. ``stats`` reports the
    average optional nodes chosen and the forward cost used.
    """

    #: candidates of one source are told apart by their rank in the row (the first context match is
    #: right far more often than the fourth); ranks from this one on share their statistics
    max_rank: int = 4

    #: trials per (key, depth) cell that a call carries over from the previous call of the same owner
    carried_trials: float = 32.0

    def __init__(self, model, num_sources: int, mandatory_sources=(), cost: ForwardCost | None = None, device=None,
                 memory: tuple | None = None):
        """``memory``: ``(owner, name)``. The acceptance statistics start from those of ``owner``'s last call
        under ``name`` (at most :attr:`carried_trials` verdicts per cell; :attr:`carried` says whether any were),
        and :meth:`remember` stores this call's, in the owner's :class:`~.memory.PolicyMemory` (a model, a
        drafter)."""
        self.cost = cost if cost is not None else forward_cost(model)
        self.acceptance = AcceptanceModel(num_sources * self.max_rank, device=device)
        self.memory = memory
        known = memory_of(memory[0]).acceptance.get(memory[1]) if memory is not None else None
        self.carried = known is not None and known[0].shape == self.acceptance.hits.shape
        if self.carried:
            self.acceptance.carry(*known, self.carried_trials)
        self.mandatory_sources = tuple(mandatory_sources)
        self.host_seconds = 0.0  # moving average of the host work per step
        self._last = None  # (clock, forward seconds) at the previous step's start
        self.steps = 0
        self.chosen = 0

    def key(self, source: int, rank: int) -> int:
        """Statistics key of a source's candidate (or node) of ``rank``: ranks from ``max_rank - 1`` on share one."""
        return source * self.max_rank + min(rank, self.max_rank - 1)

    def keys(self, sources: list[int]) -> list[int]:
        """Statistics key of each of a row's candidates: :meth:`key` of its source and rank within its source."""
        seen: dict[int, int] = {}
        out = []
        for s in sources:
            rank = seen.get(s, 0)
            seen[s] = rank + 1
            out.append(self.key(s, rank))
        return out

    def is_mandatory(self, keys: torch.Tensor) -> torch.Tensor:
        """``keys`` (from :meth:`keys`) that belong to a mandatory source."""
        mandatory = torch.tensor(self.mandatory_sources, dtype=keys.dtype, device=keys.device)
        return torch.isin(torch.div(keys, self.max_rank, rounding_mode="floor"), mandatory)

    def learn(self, tree, verdict) -> None:
        """After a verification: what each source's nodes achieved (see :class:`AcceptanceModel`)."""
        self.acceptance.update(tree, verdict)

    def remember(self) -> None:
        """At the end of a call: keep its statistics for the owner's next call (see ``memory``)."""
        if self.memory is not None:
            owner, name = self.memory
            memory_of(owner).acceptance[name] = (self.acceptance.hits.clone(), self.acceptance.trials.clone())

    def observe(self, forward_seconds: float, tokens: int | None, now: float) -> None:
        """Before a step: the target's cumulated forward time, the tokens the last forward fed and the clock's
        reading (the policy's). Updates the host time per step (step time minus forward) and the forward cost's
        level."""
        if self._last is not None:
            step_forward = forward_seconds - self._last[1]
            host = max(now - self._last[0] - step_forward, 0.0)
            self.host_seconds = host if self.steps <= 1 else 0.8 * self.host_seconds + 0.2 * host
            if tokens:
                self.cost.observe(tokens, step_forward)
        self._last = (now, forward_seconds)

    def choose(self, optional: torch.Tensor, mandatory_gain: torch.Tensor, mandatory_width: torch.Tensor) -> int:
        """``k`` optional nodes per row (see the rule). ``optional`` ``[batch, n]``: each row's optional
        node values, best first (``-inf`` past the row's last, or past what a node cap leaves room
        for); ``mandatory_gain`` / ``mandatory_width`` ``[batch]``: sum of P and count of the row's
        mandatory nodes."""
        batch, n = optional.shape
        values = optional.clamp(min=0).nan_to_num(0.0)
        available = (optional > float("-inf")).sum(1)  # [batch]
        gains = torch.cat([values.new_zeros(batch, 1), values.cumsum(1)], dim=1)  # [batch, n + 1]
        ks = torch.arange(n + 1, device=optional.device)
        widths = (mandatory_width[:, None] + torch.minimum(ks[None], available[:, None])).amax(0) + 1  # [n + 1]
        tokens = (1 + mandatory_gain[:, None] + gains).sum(0)  # [n + 1]
        t = torch.tensor([self.cost(batch * int(w)) for w in widths.tolist()], dtype=tokens.dtype,
                         device=tokens.device)
        k = int((tokens.cpu() / (t.cpu() + self.host_seconds)).argmax())
        self.steps += 1
        self.chosen += k
        return k

    def trim(self, rows_keys: list[list[int]], rows_parents: list[list[int]], rows_depth: list[list[int]]) -> list[list[int]]:
        """The nodes worth feeding of already grown trees (all nodes optional; node 0 is the root, parents
        before children): per row, the kept nodes in their original order, the root first.

        A node's value is the product of ``c(key, depth)`` along its path (``rows_keys``: each node's
        statistics key, the root's ignored); nodes are taken best first (a parent before its
        children) and :meth:`choose` says how many. Pack the kept nodes with their keys as
        ``PackedTree.node_keys`` so that :meth:`learn` counts them node by node.
        """
        rates = self.acceptance.rates().tolist()
        last = len(rates[0]) - 1
        orders, values = [], []
        for keys, parents, depth in zip(rows_keys, rows_parents, rows_depth):
            value = [1.0] * len(keys)
            for v in range(1, len(keys)):
                value[v] = value[parents[v]] * rates[keys[v]][min(depth[v] - 1, last)]
            order = sorted(range(1, len(keys)), key=lambda v: (-value[v], v))  # ties: the parent (lower index) first
            orders.append(order)
            values.append([value[v] for v in order])
        width = max(map(len, values))
        optional = torch.tensor([row + [float("-inf")] * (width - len(row)) for row in values], dtype=torch.float64)
        zeros = torch.zeros(len(values), dtype=torch.float64)
        k = self.choose(optional, zeros, zeros.long())
        return [[0] + sorted(order[:k]) for order in orders]

    @property
    def stats(self) -> dict:
        return {
            "budget_optional_nodes_per_step": self.chosen / max(self.steps, 1),
            "budget_host_ms_per_step": 1e3 * self.host_seconds,
            "budget_carried_statistics": self.carried,
            "forward_cost": self.cost.to_dict(),
        }
