"""Speculative decoding with a learned drafter: it drafts a token tree, the target verifies it in one forward.

Any drafter kind, one proposer (:class:`DraftProposer`), which grows the tree, applies the user's
processors to ``q``, merges context n-grams, budgets and packs. It knows drafters only through the
:class:`~hf_paralleldecode.drafters.base.Drafter` interface: a drafter's per-call state gives either
per-depth marginals for a block (DFlash heads, JetSpec's released heads, DEER diffusion drafters) or
the children of given nodes conditioned on their branch (tree-causal heads, EAGLE-3), as logits over
the target's vocabulary. Loading and recognising checkpoints is :mod:`hf_paralleldecode.drafters.loading`.

Per step (rows run independently; ``cache.py`` explains how they share one cache)
    1. The head receives the target features of the tokens committed last step (from the
       verification forward itself, through :class:`~.target.HiddenStateTaps`: never an extra
       target forward) and keeps them as context keys/values in its own cache, so the prefix is
       never re-projected. After the prefill the context is the prompt.
    2. The tree is grown best-first under the cumulative draft log-probability
       (:class:`~.draft_tree.TreeBuilder`; JetSpec Algorithm 1, Eq. 15) within ``tree_budget``
       drafted nodes, ``tree_width`` children per node and ``tree_depth`` levels:
       * marginals (block drafters): ONE drafter forward gives per-depth marginals; a node's
         children come from the marginal of the next depth (DDTree's product of marginals;
         ``tree_width=1`` gives DFlash's chain).
       * branches (causal drafters): nodes are evaluated in *waves*: each wave is one drafter
         forward over the nodes the builder needs, so a tree costs one drafter forward per wave,
         at most ``tree_waves`` (default ``tree_depth``; ``stats["drafter_forwards_per_step"]``).
       The user's logits processors shape ``q`` along each node's own path, as they shape ``p``.
       With sampling, children are drawn without replacement from the processed ``q`` (Gumbel
       top-``W``) and the tree carries ``q``; greedy trees take the top-``W`` children.
    3. The target verifies the tree in one forward (``verify.py``: exact match when greedy,
       multi-draft rejection sampling with ``q`` when sampling) and keeps the accepted path's KV;
       the head keeps the accepted path's features and drops its block slots.

Statistics: ``output.draft_stats`` (a :class:`~hf_paralleldecode.drafters.base.DraftStats`), also flat
in ``output.stats``: ``mean_accepted_length`` (also ``tau``: accepted drafted tokens + 1 per drafting step, the
convention of the JetSpec and DFlash papers), ``max_accepted_length``, ``accepted_lengths`` (per drafting step,
per active row), ``drafter_forwards_per_step``, ``drafter_seconds``, ``drafter_tokens_per_forward``
(input slots per drafter forward), ``drafting_cost`` (c = (T_draft / N) / T_verify, JetSpec Appendix
G, with N the drafted nodes) and ``draft_host_seconds``. A plain step the batch policy chose drafts nothing: it
is not a drafting step (``stats["shape_steps"]["plain"]`` counts those), so these describe the drafter, not
how often the policy used it.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from ..drafters.base import Drafter, DraftStats, check_state, target_vocab_size
from ..drafters.context import DrafterContext, DraftNodes, DraftStep
from ..drafters.loading import check_drafter_dtype, drafter_run_dtype, load_drafter
from ..engine.contract import check_draft_logits
from ..engine.draft_tree import TreeBuilder
from ..engine.processors import prefix_independent, process_prefixes
from ..engine.run import Proposer, decode_call
from ..engine.settings import (
    CALL_LENGTH,
    NEW_TOKENS,
    STEP_TOKENS,
    TREE_LEVELS,
    VOCAB,
    StrategySettings,
    decoding_strategy,
)
from ..engine.target import HiddenStateTaps
from ..engine.tree import PackedTree, root_tree, tree_from_parents
from .policy import CostAwareBudget, batch_policy, check_policy_settings, shapes_from, target_key
from .prompt_lookup import CONTEXT, GUESSES, ContextNgrams

__all__ = ["speculative", "SpeculativeSettings"]


def _check_drafter(value) -> None:
    """``drafter``: a drafter object, a folder / Hub repo id / shipped alias (a str or a path), or a Hub bundle's
    ``(repo id, subfolder)`` (what :func:`~hf_paralleldecode.drafters.loading.load_drafter` takes)."""
    import os

    if isinstance(value, (Drafter, str, os.PathLike)) or (
            isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        return
    raise ValueError(f"`drafter` must be a drafter (hf_paralleldecode.DraftHead, Eagle3Drafter, DiffusionDrafter), "
                     f"the folder / Hub repo id / shipped alias of one (a str or a path), or None, got {value!r} "
                     f"({type(value).__name__}).")


@dataclass
class SpeculativeSettings(StrategySettings):
    """Settings of speculative decoding with a learned drafter (:func:`hf_paralleldecode.speculative`)."""

    drafter: Drafter | str | None = field(
        default=None,
        metadata={"help": "a :class:`hf_paralleldecode.DraftHead` built for this model, a "
                          ":class:`hf_paralleldecode.DiffusionDrafter` sharing its vocabulary (DEER), the folder / Hub "
                          'repo id of either, or a shipped alias (``"default-jetspec"``, ``"default-dflash"``, '
                          '``"default-deer"``). It is moved to the model' "'s device and dtype; a head is bound to "
                          "the model. A drafter for another vocabulary or tokenizer is refused before any forward.",
                  "check": _check_drafter},
    )
    tree_budget: int | None = field(
        default=None,
        metadata={"help": "B, drafted nodes per step (the verification forward feeds B + 1 tokens); default: the "
                          "device preset (:func:`hf_paralleldecode.hardware_preset`): 16 on CPU, where the shipped "
                          "heads were fastest at B=16 (docs/methods/speculative.md), 128 to 256 on GPUs at batch 1.",
                  "minimum": 1, "bound": STEP_TOKENS},
    )
    tree_width: int = field(default=8, metadata={"help": "W, children per node (1 = a chain).", "minimum": 1,
                                                 "bound": VOCAB})
    tree_depth: int | None = field(
        default=None,
        metadata={"help": "N, levels below the root (default: the drafter's ``block_size``). A diffusion drafter "
                          "feeds ``tree_depth`` masks per step (its block size at inference, at most its "
                          "``block_size``).", "minimum": 1, "bound": TREE_LEVELS},
    )
    tree_waves: int | None = field(
        default=None,
        metadata={"help": "branch-expanding drafters only (``tree_causal`` heads, EAGLE-3): drafter forwards per step "
                          "at most (default: ``tree_depth``). Exact best-first insertion evaluates a node only once it "
                          "is in the tree, so a confident chain takes one wave per level and the tree is capped near "
                          "``tree_waves x tree_width`` nodes; more waves let large budgets fill (tau keeps rising with "
                          "the budget) at one head forward each.", "minimum": 1, "bound": STEP_TOKENS},
    )
    denoise_steps: int | None = field(
        default=None,
        metadata={"help": "diffusion drafters only: denoising forwards per draft (default: the drafter's "
                          "``denoise_steps``, 1 = DEER's one step); each further step unmasks the most confident "
                          "remaining positions.", "minimum": 1},
    )
    context_matches: int | None = field(
        default=0,
        metadata={"help": "continuations of the row's suffix found in its prompt and output (context n-grams, as "
                          '``decoding="prompt_lookup"``) merged into the head' "'s tree; they share ``tree_budget`` "
                          "(up to half of it is kept for them). 0 = none. With ``do_sample=True`` a step with context "
                          "candidates is verified by sample-then-match (lossless for any tree; rejection sampling "
                          "needs every child drawn from ``q``, and the choice of rule may not depend on the draws).",
                  "minimum": 0, "bound": CALL_LENGTH},
    )
    context_tokens: int | None = field(
        default=10, metadata={"help": "tokens of each context continuation.", "minimum": 1, "bound": NEW_TOKENS},
    )
    context_ngram_size: int = field(
        default=3, metadata={"help": "longest suffix looked up in the context.", "minimum": 1, "bound": CALL_LENGTH},
    )
    drafter_dtype: str | torch.dtype | None = field(
        default=None,
        metadata={"help": 'the dtype the drafter runs in (``"bfloat16"``, ``"float16"``, ``"float32"``, a '
                          '``torch.dtype``, or ``"target"``: the model' "'s); a drafter object (given, or the model's "
                          "attached one) is cast to it in place, a drafter folder loads the copy cached for that "
                          "dtype. The draft only proposes, so the output does not depend on it (greedy stays exact). "
                          "Default: the device preset's: " '``"bfloat16"`` on CPUs with native bf16 matrix units '
                          '(AVX512-BF16 / AMX), where a drafter forward costs about half of an fp32 one, else '
                          '``"target"``.', "check": check_drafter_dtype},
    )
    cost_aware: bool = field(
        default=False,
        metadata={"help": "feed only the drafted nodes whose expected gain pays for their cost on this device "
                          "(:mod:`hf_paralleldecode.decoding.policy.budget`): the tree is grown within ``tree_budget`` as "
                          "usual, then cut to the best nodes by the product along their path of how often nodes of "
                          "their ``q`` bucket (context nodes: their match rank) and depth were accepted (in this run, "
                          "starting from the drafter's previous call), as many as maximise tokens per second under "
                          "the forward cost measured on this device. ``tree_budget`` becomes a cap (a GPU keeps wide "
                          "trees, a CPU narrow ones). With ``do_sample=True`` every step is verified by "
                          "sample-then-match (lossless for any tree): the cut depends on the drawn tokens' values, so "
                          "rejection sampling would be biased."},
    )
    adaptive: bool = field(
        default=True,
        metadata={"help": "let the batch policy (:mod:`hf_paralleldecode.decoding.policy`) pick each step's shape for "
                          "the whole batch from measured committed tokens per second: the configured tree, a chain of "
                          "at most 8, 4 or 2 levels without context matches, or a plain step without a drafter "
                          "forward; greedy and sampled (the measurements carry over to the drafter's next call). "
                          "``False`` feeds the configured tree every step."},
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata={"help": "with ``adaptive``, the most tokens one verification forward may feed for the whole batch "
                          "(rows x nodes per row, roots included): a latency cap per step. ``None``: no cap.",
                  "minimum": 1},
    )

    def check(self) -> None:
        check_policy_settings(self.adaptive, self.max_step_tokens)


def drafter_conflict(drafter, max_length: int) -> str | None:
    """Why ``drafter`` (an object, not a path) cannot draft a generation of ``max_length`` tokens, or ``None``;
    run by the strategy and by ``enable()``'s pre-check (``speculative.drafter_conflict``)."""
    if not isinstance(drafter, Drafter):
        return None  # a path: the strategy loads it and asks again
    try:
        drafter.check_length(max_length)
    except ValueError as err:
        return f"cannot draft this call: {err}"
    return None


def _check_settings(model, drafter, tree_depth, tree_waves, denoise_steps=None, dtype=None):
    if drafter is None:
        raise ValueError(
            'decoding="speculative" needs a drafter: pass drafter=<a drafter object, folder, Hub repo id or shipped '
            'alias> (hf_paralleldecode.load_drafter(...), DraftHead.for_target(model), "default-deer"), or load a '
            "bundle with hfpd.load_model(dir) that names one."
        )
    # a path: the drafter cached for this device and dtype (never moved); checked against the model, whose depth
    # its taps may depend on
    drafter = load_drafter(drafter, device=model.device, dtype=dtype or model.dtype).bind(model)
    depth = drafter.default_depth if tree_depth is None else tree_depth
    drafter.check_settings(depth, tree_waves, denoise_steps)
    return drafter, depth


class DraftProposer(Proposer):
    """Trees from a learned drafter's per-call state (a :class:`~hf_paralleldecode.drafters.base.DrafterState`)."""

    #: a drafted node's statistics key under ``cost_aware``: the drafter's nodes by the bucket of their own
    #: ``q`` (``q >= 0.8``, ``0.4``, ``0.1``, below), context nodes by the rank of the match that made them
    Q_BUCKETS = (0.8, 0.4, 0.1)
    #: the prior acceptance of each bucket (its middle ``q``, worth two verdicts): a run starts from the drafter's
    #: own confidence, not from 1/2 at every depth (which would undervalue a confident deep chain until learned)
    Q_PRIOR = (0.9, 0.6, 0.25, 0.05)
    #: offer the batch policy context chains (the first context match alone, no drafter forward) as well: off, since
    #: they did not pay on the project's CPU and every shape offered costs exploration steps
    context_chains = False

    def __init__(self, run, drafter, state, vocab, budget, width, depth, waves, context_matches=0, context_tokens=10,
                 context_ngram_size=3, cost_aware=False, adaptive=True, max_step_tokens=None):
        self.run, self.drafter, self.state, self.vocab = run, drafter, check_state(drafter, state), vocab
        self.context = (ContextNgrams(run, context_tokens, context_ngram_size, context_matches)
                        if context_matches else None)
        nodes = None
        if cost_aware:
            # the drafter's calibration carries over from its last call on the same target
            nodes = CostAwareBudget(run.model, num_sources=CONTEXT + 1, device=run.rows.device,
                                    memory=(drafter, ("speculative", target_key(run.model))))
            for bucket, mean in enumerate(() if nodes.carried else self.Q_PRIOR):
                nodes.acceptance.set_prior(nodes.key(GUESSES, bucket), mean)
        self.context_steps = 0  # steps whose tree held context nodes
        self.budget, self.width, self.depth = budget, width, depth
        # the batch's tree shape per step (decoding/policy/); measurements carry over per drafter and device
        context = self.context is not None
        shapes = shapes_from(width, depth, budget, context, context_depth=context_tokens if context and self.context_chains
                             else None)
        self.policy = batch_policy(run, shapes, drafter, adaptive, max_step_tokens, nodes)
        self.waves = waves  # branch-expanding drafters: forwards per step at most
        self.sample = bool(run.generation_config.do_sample)
        self.roots = run.log.tokens[run.rows, 0].clone()  # [active] the first token, committed by the prefill
        self.steps, self.drafted_nodes, self.accepted, self.row_steps, self.host = 0, 0, 0, 0, 0.0
        self._skipped_seen = 0  # the drafter's skipped tokens at its last drafting step (see propose)
        self.accepted_lengths: list[list[int]] = []  # per step, per active row: accepted + 1

    def select(self, kept):
        self.roots = self.roots[kept]
        self.state.select(kept)

    # ---- children distributions --------------------------------------------------------------
    def _children(self, logits, prefixes, rows):
        """Processed ``q`` and the children lists (try order) for ``n`` nodes: ``logits [n, V]``."""
        run = self.run
        # prefixes is None only for processors that ignore them (process_prefixes then never reads them)
        scores = process_prefixes(run.logits_processor, logits, prefixes or [], rows, run.prompt.shape[0],
                                  run.placeholder_prefix)
        logq = torch.log_softmax(scores, dim=-1)
        keys = logq
        if self.sample:
            keys = logq - torch.empty_like(logq).exponential_().log()  # Gumbel: draws without replacement
        top = keys.topk(min(self.width, keys.shape[-1]), dim=-1)
        top_logq = logq.gather(1, top.indices)
        # the tokens and their log-probabilities in one read (float64 holds every token id exactly)
        both = torch.stack([top.indices.to(torch.float64), top_logq.to(torch.float64)]).tolist()
        kids = [[(int(t), lq) for t, lq in zip(ts, ls) if math.isfinite(lq)] for ts, ls in zip(*both)]
        return (logq.exp() if self.sample else None), kids

    # ---- one step ---------------------------------------------------------------------------------
    def propose(self) -> PackedTree:
        run = self.run
        t_start = time.perf_counter()
        drafter_before = self.state.seconds
        shape = self.shape
        self.step = DraftStep.from_run(run, self.roots, self.depth if shape is None else shape.depth)
        if self.plain_step:  # the roots alone: no drafter forward, no tree (the drafter catches up later)
            self.state.end_step()
            self.host += time.perf_counter() - t_start
            return root_tree(self.roots)
        counts = run.log.host_counts(run.row_ids)
        budgets = [run.log.max_new_tokens - c for c in counts]
        roots = [run.log.last_token(r) for r in run.row_ids]  # (self.roots on the host: no read)
        width, depth, budget, context = self.width, self.depth, self.budget, self.context is not None
        drafting = True
        if shape is not None:
            width, depth, budget, context, drafting = shape.width, shape.depth, shape.budget, shape.context, shape.drafter
        found = self.context.candidates(counts) if context else None
        if not drafting:  # a context chain: the first match alone, no drafter forward
            found = [[f[0][:depth]] if f else [] for f in found]
        # the context matches share the tree budget: up to half of it is kept for them (their distinct
        # prefixes: tokens that several matches share count once)
        reserve = [min(len({tuple(c[: k + 1]) for c in f for k in range(len(c))}), budget // 2) for f in found] \
            if found else [0] * len(roots)
        builders = [TreeBuilder(r, budget - k, width, max(min(depth, b), 0) if drafting else 0, exact=not self.sample)
                    for r, b, k in zip(roots, budgets, reserve)]
        self.step_budget = budget
        histories = run.lazy_histories()  # built only when a processor reads prefixes
        row_ids = run.row_ids
        q_store: dict[tuple[int, int], torch.Tensor] = {}
        if self.drafter.expansion == "branches":
            self._grow_branches(builders, histories, row_ids, q_store)
        else:
            self._grow_marginals(builders, histories, row_ids, q_store)
        self.state.end_step()
        if drafting:  # (a context chain's step leaves the count to the next drafting step)
            if self.state.skipped_tokens > self._skipped_seen and self.policy is not None:
                self.policy.lagged()  # the drafter's context had a hole: its drafts are not the shape's in step
            self._skipped_seen = self.state.skipped_tokens
        self.drafted_nodes += sum(len(bld.tokens) - 1 for bld in builders)  # the head's nodes (drafting_cost)
        context_ranks = [{} for _ in builders]  # per row: context node -> rank of the match that made it
        first_paths = [[] for _ in builders]  # per row: the nodes of the first match (the policy's context chains)
        added = found is not None and self._add_context(builders, found, context_ranks, first_paths)
        self.context_steps += int(added)
        nodes = [(bld.tokens, bld.parents, bld.depth) for bld in builders]
        keys = None
        if self.cost_budget is not None:
            keys = [self._node_keys(bld, ranks) for bld, ranks in zip(builders, context_ranks)]
            nodes, keys = self._trim(nodes, keys)
        tree = self._pack(nodes, q_store, sample_then_match=self._sample_then_match(found))
        if added and keys is None:
            longest = max(map(len, first_paths))
            tree.context_path = torch.tensor([p + [-1] * (longest - len(p)) for p in first_paths],
                                             device=tree.tokens.device)
        if keys is not None:
            width = tree.tokens.shape[1]
            tree.node_keys = torch.tensor([k + [-1] * (width - len(k)) for k in keys], device=tree.tokens.device)
        self.steps += 1
        self.host += time.perf_counter() - t_start - (self.state.seconds - drafter_before)
        return tree

    def _sample_then_match(self, found) -> bool:
        """With sampling: whether this step's tree is verified by sample-then-match (lossless for any tree)
        instead of multi-draft rejection sampling with ``q`` (lossless only averaged over every draw).

        The choice must not depend on this step's draws, or the draws that get rejection sampling would be a
        biased subset. So it is made from what is known before drafting: the step has context candidates (a
        context node is not drawn from ``q``; whether it merges with a draw depends on the draw), or the tree
        is cut by a cost-aware budget (which keeps a node according to its drawn value)."""
        return self.cost_budget is not None or (found is not None and any(found))

    @staticmethod
    def _flat(wanted) -> list[tuple[int, int]]:
        return [(i, v) for i, nodes in enumerate(wanted) for v in nodes]

    def _evaluate(self, builders, flat, logits, histories, row_ids, q_store):
        """Give every wanted node ``flat[k] = (row, node)`` its children from raw ``logits[k]`` ``[V]``."""
        prefixes = None  # processors blind to the prefix (or none): no per-node prefixes to build
        if not prefix_independent(self.run.logits_processor or []):
            prefixes = [torch.cat([histories[i], torch.tensor([builders[i].tokens[u] for u in builders[i].path(v)],
                                                              dtype=torch.long, device=histories[i].device)])
                        for i, v in flat]
        q, kids = self._children(logits, prefixes, [row_ids[i] for i, _ in flat])
        for k, (i, v) in enumerate(flat):
            builders[i].give(v, kids[k])
            if q is not None:
                q_store[(i, v)] = q[k]

    def _grow_marginals(self, builders, histories, row_ids, q_store):
        """Per-depth marginals ``[b, D, V]`` from one drafter step (a DFlash head, a diffusion drafter): a
        node at depth ``d`` takes its children from the marginal of depth ``d + 1``."""
        b = len(builders)
        if all(bld.max_depth == 0 for bld in builders):
            return  # nothing to draft this step (a plain step, or every row at its last token): no drafter forward
        marginals = self.state.marginals(self.step)  # [b, D, V] for depths 1..D
        check_draft_logits(marginals, "marginals(step)", self.drafter.describe(), [b, self.step.depth], self.vocab,
                           at_least=max(bld.max_depth for bld in builders),
                           rows="a row per active row, then the depths 1 .. step.depth")
        bs = marginals.shape[1]
        shared = None
        if not self.sample and prefix_independent(self.run.logits_processor or []):
            # greedy, processors blind to the prefix: every node of a depth has the same children
            flat = [(i, d) for i in range(b) for d in range(bs)]
            _, kids = self._children(marginals.reshape(b * bs, -1), None, [row_ids[i] for i, _ in flat])
            shared = {key: kids[k] for k, key in enumerate(flat)}
        while True:
            wanted = [bld.wanted() for bld in builders]
            if not any(wanted):
                return
            if shared is not None:
                for i, nodes in enumerate(wanted):
                    for v in nodes:
                        builders[i].give(v, shared[(i, builders[i].depth[v])])
                continue
            flat = self._flat(wanted)
            logits = torch.stack([marginals[i, builders[i].depth[v]] for i, v in flat])
            self._evaluate(builders, flat, logits, histories, row_ids, q_store)

    def _grow_branches(self, builders, histories, row_ids, q_store):
        """Causal drafters: each wave, the drafter evaluates the nodes the builders want (their children given
        their branch), at most ``tree_waves`` waves per step."""
        waves = 0
        while True:
            wanted = [bld.wanted() for bld in builders]
            if not any(wanted):
                return
            if waves == self.waves:  # wave cap: unevaluated nodes stay leaves
                for bld in builders:
                    bld.freeze()
                continue
            wave = self._wave(builders, wanted)
            logits = self.state.expand(self.step, wave)
            check_draft_logits(logits, "expand(step, nodes)", self.drafter.describe(), [len(wave.host.rows)],
                               self.vocab, rows="a row per node of the wave, in the order of nodes.rows")
            waves += 1
            self._evaluate(builders, self._flat(wanted), logits, histories, row_ids, q_store)

    def _wave(self, builders, wanted) -> DraftNodes:
        """The ``wanted`` nodes of every row's tree, flat (what a branch-expanding drafter evaluates)."""
        rows, index, nodes, parents, tokens, depths = [], [], [], [], [], []
        for i, wave in enumerate(wanted):
            bld = builders[i]
            for k, v in enumerate(wave):
                rows.append(i)
                index.append(k)
                nodes.append(v)
                parents.append(bld.parents[v])
                tokens.append(bld.tokens[v])
                depths.append(bld.depth[v])
        return DraftNodes(rows, index, nodes, parents, tokens, depths, self.step.root_pos, len(builders))

    def _add_context(self, builders, found, ranks, first_paths) -> bool:
        """Insert each row's context continuations into its head tree (a trie: shared prefixes merge)
        within ``tree_budget`` drafted nodes; True when a node was added. ``ranks``: per row, filled with
        each added node's match rank; ``first_paths``: per row, filled with the nodes of the first match."""
        added = False
        for bld, cands, row_ranks, first in zip(builders, found, ranks, first_paths):
            child = {(p, t): v for v, (p, t) in enumerate(zip(bld.parents, bld.tokens)) if v}
            for rank, cand in enumerate(cands):
                node = 0
                for tok in cand:
                    if (node, tok) not in child:
                        if len(bld.tokens) > self.step_budget:
                            break
                        child[(node, tok)] = len(bld.tokens)
                        row_ranks[len(bld.tokens)] = rank
                        bld.tokens.append(tok)
                        bld.parents.append(node)
                        bld.depth.append(bld.depth[node] + 1)
                        added = True
                    node = child[(node, tok)]
                    if rank == 0:
                        first.append(node)
        return added

    def _node_keys(self, bld, context_ranks: dict) -> list[int]:
        """Each node's statistics key (:data:`Q_BUCKETS`; the root's is unused)."""
        key = self.cost_budget.key
        keys = [-1]
        for v in range(1, len(bld.tokens)):
            if v in context_ranks:
                keys.append(key(CONTEXT, context_ranks[v]))
                continue
            q = math.exp(bld.score[v] - bld.score[bld.parents[v]])
            keys.append(key(GUESSES, sum(q < edge for edge in self.Q_BUCKETS)))
        return keys

    def _trim(self, nodes, keys):
        """The nodes the cost-aware budget keeps (:meth:`~.budget.CostAwareBudget.trim`), renumbered, and their keys.
        (No ``q`` follows them: a cost-aware step is verified by sample-then-match, see :meth:`_sample_then_match`.)"""
        kept = self.cost_budget.trim(keys, [p for _, p, _ in nodes], [d for _, _, d in nodes])
        out, out_keys = [], []
        for (tokens, parents, depth), row_keys, row_kept in zip(nodes, keys, kept):
            new = {v: j for j, v in enumerate(row_kept)}
            out.append(([tokens[v] for v in row_kept], [new.get(parents[v], -1) for v in row_kept],
                        [depth[v] for v in row_kept]))
            out_keys.append([row_keys[v] for v in row_kept])
        return out, out_keys

    def _pack(self, nodes, q_store, sample_then_match: bool = False) -> PackedTree:
        """``nodes``: per row, ``(tokens, parents, depth)`` (node 0 the root, parents first)."""
        q = None
        if self.sample and not sample_then_match:
            q = torch.zeros(len(nodes), max(len(tokens) for tokens, _, _ in nodes), self.vocab, device=self.roots.device)
            for (i, v), dist in q_store.items():
                q[i, v] = dist
        return tree_from_parents(self.roots, [n[0] for n in nodes], [n[1] for n in nodes], [n[2] for n in nodes], q=q)

    def update(self, tree, verdict) -> None:
        self.state.update(self.step, tree, verdict)
        self.roots = verdict.tokens.gather(1, verdict.num_accepted[:, None]).squeeze(1)
        if self.plain_step:  # nothing drafted: not a step of the drafter's statistics
            return
        lengths = [n + 1 for n in (verdict.host[1] if verdict.host is not None else verdict.num_accepted.tolist())]
        self.accepted_lengths.append(lengths)
        self.accepted += sum(lengths)
        self.row_steps += len(lengths)

    @property
    def draft_stats(self) -> DraftStats:
        steps = max(self.steps, 1)
        per_verify = max(self.run.target.seconds, 1e-12) / max(self.run.num_forward_passes, 1)
        per_node = self.state.seconds / steps / max(self.drafted_nodes / steps, 1e-12)  # T_draft / N
        longest = max((max(step) for step in self.accepted_lengths if step), default=0)
        return DraftStats(
            drafter=self.drafter.kind, tau=self.accepted / max(self.row_steps, 1), max_accepted_length=longest,
            accepted_lengths=self.accepted_lengths, steps=self.steps, drafter_forwards=self.state.forwards,
            drafter_seconds=self.state.seconds, drafter_fed_tokens=self.state.fed_tokens,
            drafted_nodes=self.drafted_nodes, drafting_cost=per_node / per_verify, draft_host_seconds=self.host,
            drafter_skipped_tokens=self.state.skipped_tokens,
        )

    @property
    def stats(self) -> dict:
        steps = max(self.steps, 1)
        context = {} if self.context is None else {**self.context.stats, "context_step_share": self.context_steps / steps}
        return {**self.draft_stats.as_stats(), **context}


def _run(model, settings: SpeculativeSettings, call):
    preset, s = settings.with_preset(model, call.name)
    dtype = drafter_run_dtype(s.drafter_dtype, model)
    drafter, depth = _check_settings(model, s.drafter, s.tree_depth, s.tree_waves, s.denoise_steps, dtype)
    reason = drafter_conflict(drafter, int(call.generation_config.max_length))
    if reason is not None:
        raise ValueError(f"decoding='speculative' {reason}")
    if drafter.device != model.device or drafter.dtype != dtype:  # a drafter object given or attached: in place
        drafter.to(device=model.device, dtype=dtype)
    vocab = target_vocab_size(model)
    stats = dict(tree_budget=s.tree_budget, tree_width=s.tree_width, tree_depth=depth,
                 context_matches=s.context_matches, context_tokens=s.context_tokens,
                 context_ngram_size=s.context_ngram_size, hardware_preset=preset,
                 drafter_dtype=str(dtype).removeprefix("torch."), cost_aware=s.cost_aware, adaptive=s.adaptive,
                 max_step_tokens=s.max_step_tokens, **drafter.run_settings(depth, denoise_steps=s.denoise_steps))
    waves = s.tree_waves or depth
    if drafter.expansion == "branches":
        stats["tree_waves"] = waves
    taps = HiddenStateTaps(model, drafter.tap_layers) if drafter.tap_layers else contextlib.nullcontext()

    def proposer(run):
        context = DrafterContext.from_run(run, taps if drafter.tap_layers else None, vocab)
        return DraftProposer(run, drafter, drafter.start(context, depth, denoise_steps=s.denoise_steps), vocab,
                             s.tree_budget, s.tree_width, depth, waves, s.context_matches, s.context_tokens,
                             s.context_ngram_size, s.cost_aware, s.adaptive, s.max_step_tokens)

    with taps:  # hooks removed on exit
        return decode_call(model, call, proposer, stats)


speculative = decoding_strategy("speculative", SpeculativeSettings, _run, doc="""
    Lossless speculative decoding with a draft head (JetSpec / DFlash); a ``custom_generate`` callable.

    Greedy output equals stock greedy output (token for token in fp32); with ``do_sample=True`` the output is
    distributed as stock sampling (multi-draft rejection sampling with the head's ``q``). The settings are
    :class:`SpeculativeSettings`.
    """)
speculative.drafter_conflict = drafter_conflict  # the pre-check of enable()'s generate asks it too
