"""Context n-gram drafting (``decoding="prompt_lookup"``): continuations of the current suffix found in the
row's own prompt and generated text, merged as a tree and verified in one forward.

What it does
    Code and edits repeat themselves. Each step, for every row, the last ``n`` tokens of its
    context (its prompt without padding, plus what it has committed) are looked up in that same
    context, for ``n`` from ``max_ngram_size`` down to 1. Every earlier occurrence gives a candidate
    continuation: the ``num_tokens`` tokens that followed it. Longer matches come first, and within a
    length the most recent occurrence comes first. Up to ``max_matches`` distinct candidates are
    merged into a trie under the last committed token, cut at ``tree_budget`` drafted nodes, and
    verified by the shared tree verifier. It is lossless, greedy or sampled, and batched, like every
    strategy here; transformers' own prompt lookup (``prompt_lookup_num_tokens``) is batch-1 only
    and drafts a single chain.

Cost
    Matching is a few tensor comparisons per row and n-gram size; nothing is stored between steps
    (with ``cost_aware=True``, the budget keeps its acceptance counts and timings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.run import Proposer, decode_call
from ..engine.settings import CALL_LENGTH, NEW_TOKENS, STEP_TOKENS, StrategySettings, decoding_strategy
from ..engine.tree import PackedTree, pack_trees, root_tree
from .policy import CostAwareBudget, batch_policy, check_policy_settings, shapes_from

__all__ = ["prompt_lookup", "PromptLookupSettings", "context_candidates", "NgramIndex", "ContextNgrams",
           "ComposedTreeProposer", "GUESSES", "POOL", "CONTEXT"]


@dataclass
class PromptLookupSettings(StrategySettings):
    """Settings of context n-gram (prompt lookup) decoding (:func:`hf_paralleldecode.prompt_lookup`)."""

    num_tokens: int | None = field(
        default=None,
        metadata={"help": "tokens drafted after each match (transformers' ``prompt_lookup_num_tokens``). This, "
                          "``max_matches`` and ``tree_budget`` default to the device preset "
                          "(:func:`hf_paralleldecode.hardware_preset`; CPU: 10, 4, 32).", "minimum": 1,
                  "bound": NEW_TOKENS},
    )
    max_ngram_size: int = field(
        default=3,
        metadata={"help": "longest suffix looked up; shorter ones down to 1 are tried too. At most the call's "
                          "prompt + ``max_new_tokens`` (a longer suffix never matches): a larger value is lowered to "
                          "it.",
                  "minimum": 1, "bound": CALL_LENGTH},
    )
    max_matches: int | None = field(
        default=None, metadata={"help": "distinct continuations merged into the tree per step.", "minimum": 1,
                                "bound": CALL_LENGTH},
    )
    tree_budget: int | None = field(
        default=None,
        metadata={"help": "drafted nodes per step at most (the verification forward feeds at most "
                          "``tree_budget + 1`` tokens).", "minimum": 1, "bound": STEP_TOKENS},
    )
    cost_aware: bool = field(
        default=False,
        metadata={"help": "feed only the nodes whose expected gain pays for their cost on this device "
                          "(``hf_paralleldecode.decoding.policy.budget``), under the ``tree_budget`` cap."},
    )
    adaptive: bool = field(
        default=True,
        metadata={"help": "let the batch policy (:mod:`hf_paralleldecode.decoding.policy`) pick each step's shape for "
                          "the whole batch from measured committed tokens per second: every match (the configured "
                          "tree), the first match cut to 8, 4 or 2 tokens, or a plain step (the measurements carry "
                          "over to the model's next call). ``False`` feeds the configured tree every step."},
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata={"help": "with ``adaptive``, the most tokens one verification forward may feed for the whole batch "
                          "(rows x nodes per row, roots included). ``None``: no cap.", "minimum": 1},
    )

    def check(self) -> None:
        check_policy_settings(self.adaptive, self.max_step_tokens)


def context_candidates(context: torch.Tensor, num_tokens: int, max_ngram_size: int, max_matches: int) -> list[list[int]]:
    """Continuations of ``context``'s suffix found earlier in ``context`` (1-D, CPU), best first.

    For ``n = max_ngram_size .. 1``: every position ``p`` with ``context[p:p+n] == context[-n:]``
    and at least one token after the match (the suffix itself excluded) gives
    ``context[p+n : p+n+num_tokens]``; longer ``n`` first, later ``p`` first, duplicates dropped.
    """
    return NgramIndex(context.tolist(), max_ngram_size).candidates(num_tokens, max_matches)


#: proposer ids of candidates in budgeted trees: a Jacobi chain / lookahead window, the n-gram pool, context n-grams
GUESSES, POOL, CONTEXT = 0, 1, 2


class NgramIndex:
    """One row's context (a host list that only grows) with the start positions of each of its n-grams
    (``n <= max_ngram_size``): :meth:`candidates` answers :func:`context_candidates` with dictionary
    lookups instead of a scan of the whole context per step."""

    def __init__(self, tokens: list[int], max_ngram_size: int):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram_size
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> start positions, increasing
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        toks, starts = self.tokens, self.starts
        old = len(toks)
        toks.extend(new)
        for n in range(1, self.max_ngram + 1):
            first = max(old - n + 1, 0)  # the first start whose n-gram ends in the new tokens
            for p, gram in enumerate(zip(*(toks[first + i:] for i in range(n))), first):  # tuples built in C
                starts.setdefault(gram, []).append(p)

    def candidates(self, num_tokens: int, max_matches: int) -> list[list[int]]:
        """:func:`context_candidates` of the context (same matches, same order)."""
        toks = self.tokens
        length = len(toks)
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            for p in reversed(self.starts.get(tuple(toks[length - n:]), ())):
                if p + n >= length:  # the suffix itself: nothing follows it
                    continue
                cont = tuple(toks[p + n: p + n + num_tokens])
                if cont not in seen:
                    seen.add(cont)
                    out.append(list(cont))
                    if len(out) == max_matches:
                        return out
        return out

    def chain(self, num_tokens: int, max_matches: int) -> list[int]:
        """One continuation for a drafter that proposes chains (a serving engine's): the path of the trie of
        :meth:`candidates` that most of them share, depth by depth (a tie goes to the better-ranked candidate)."""
        alive = self.candidates(num_tokens, max_matches)
        out: list[int] = []
        for d in range(num_tokens):
            votes: dict[int, list[int]] = {}  # token -> [candidates agreeing, -rank of the best of them]
            for rank, cand in enumerate(alive):
                if len(cand) > d:
                    votes.setdefault(cand[d], [0, -rank])[0] += 1
            if not votes:
                break
            token = max(votes, key=lambda t: votes[t])
            out.append(token)
            alive = [c for c in alive if len(c) > d and c[d] == token]
        return out


class ContextNgrams:
    """The context n-gram source any proposer can add to its tree: per active row, continuations of the
    row's suffix found in its prompt and committed tokens (:func:`context_candidates`), best first.

    Each row keeps an :class:`NgramIndex` of its context, fed the row's newly committed tokens from the
    commit log's host lists: no tensor is read per step. A row's index is built at its first lookup, so a call
    whose steps never draft from the context (the batch policy's plain steps at a large batch) never indexes its
    prompts."""

    def __init__(self, run, num_tokens: int, max_ngram_size: int, max_matches: int):
        self.run = run
        self.num_tokens, self.max_ngram, self.max_matches = num_tokens, max_ngram_size, max_matches
        self.steps = self.matched = 0
        self.index: dict[int, NgramIndex] = {}  # row -> its index, built at the row's first lookup
        self.fed: dict[int, int] = {}  # committed tokens already in each row's index

    def candidates(self, counts: list[int]) -> list[list[list[int]]]:
        """Per active row: up to ``max_matches`` continuations. ``counts``: each active row's committed
        tokens (the caller's host copy)."""
        log = self.run.log
        out = []
        for r, count in zip(self.run.row_ids, counts):
            index = self.index.get(r)
            if index is None:
                index = self.index[r] = NgramIndex(self.run.prompt_tokens(r), self.max_ngram)
                self.fed[r] = 0
            if count > self.fed[r]:
                index.extend(log.host_tokens(r)[self.fed[r]: count])
                self.fed[r] = count
            room = int(log.max_new_tokens) - count  # a depth-d path commits d + 1 tokens
            found = index.candidates(min(self.num_tokens, room), self.max_matches)
            self.steps += 1
            self.matched += bool(found)
            out.append(found)
        return out

    @property
    def stats(self) -> dict:
        return {"context_matched_step_share": self.matched / max(self.steps, 1)}


class ComposedTreeProposer(Proposer):
    """What a proposer needs to compose context n-grams into its tree under one node budget: the
    context source, the node cap and the cost-aware budget (``lookahead``, ``jacobi_forcing``, ``prompt_lookup``)."""

    context: ContextNgrams | None = None
    max_nodes: int | None = None

    def compose(self, run, context_matches: int, context_tokens: int, context_ngram_size: int,
                tree_budget: int | None, cost_aware: bool, mandatory=()) -> None:
        """Set up the pieces; ``mandatory``: source ids always fed (``GUESSES`` for Jacobi-style updates)."""
        self.context = (ContextNgrams(run, context_tokens, context_ngram_size, context_matches)
                        if context_matches else None)
        self.max_nodes = None if tree_budget is None else tree_budget + 1
        # the node budget (cost_aware): the proposer hands it to its batch policy, which the loop talks to
        self.node_budget = (CostAwareBudget(run.model, num_sources=3, mandatory_sources=mandatory,
                                            device=run.rows.device, memory=(run.model, run.name))
                            if cost_aware else None)

    def context_candidates(self, counts: list[int]) -> list[list[list[int]]]:
        """Per active row: the context continuations (none when the source is off)."""
        return self.context.candidates(counts) if self.context is not None else [[] for _ in counts]

    def pack(self, roots: torch.Tensor, candidates, sources) -> PackedTree:
        if self.plain_step:  # the roots alone, as stock decoding feeds them (one empty candidate per row)
            return root_tree(roots)
        run = self.run
        return pack_trees(roots, candidates, max_nodes=self.max_nodes, sources=sources, budget=self.cost_budget,
                          root_list=[run.log.last_token(r) for r in run.row_ids])

    def with_context_stats(self, stats: dict) -> dict:
        return stats if self.context is None else {**stats, **self.context.stats}


class ContextNgramProposer(ComposedTreeProposer):
    """Each step: every active row's context suffix matches, merged as a trie (see module docstring)."""

    def __init__(self, run, num_tokens: int, max_ngram_size: int, max_matches: int, tree_budget: int, cost_aware: bool,
                 adaptive: bool = True, max_step_tokens: int | None = None):
        self.run = run
        self.compose(run, max_matches, num_tokens, max_ngram_size, tree_budget, cost_aware)
        # shapes: every match merged (the configured tree), the first match cut to 8 / 4 / 2 tokens, a plain step
        self.policy = batch_policy(run, shapes_from(max_matches, num_tokens, tree_budget, True), run.model, adaptive,
                                   max_step_tokens, self.node_budget)

    @property
    def stats(self) -> dict:
        return self.with_context_stats({})

    def propose(self):
        roots = self.run.roots()  # [active], on the device: no copy
        if self.plain_step:
            return root_tree(roots)
        cands = self.context_candidates(self.run.log.host_counts(self.run.row_ids))
        if not self.configured_step:  # a chain: the first match, cut to the shape's depth
            cands = [c[:1] and [c[0][: self.shape.depth]] for c in cands]
        return self.pack(roots, cands, [[CONTEXT] * len(c) for c in cands])

    def update(self, tree, verdict) -> None:
        """Nothing to learn: the next step reads the committed tokens from the commit log."""


def _run(model, settings: PromptLookupSettings, call):
    preset, s = settings.with_preset(model, call.name)
    return decode_call(
        model, call, lambda run: ContextNgramProposer(run, s.num_tokens, s.max_ngram_size, s.max_matches, s.tree_budget,
                                                      s.cost_aware, s.adaptive, s.max_step_tokens),
        {**s.to_dict(), "hardware_preset": preset})


prompt_lookup = decoding_strategy("prompt_lookup", PromptLookupSettings, _run, doc="""
    Lossless context n-gram (prompt lookup) decoding, greedy or sampled, batched; a ``custom_generate`` callable.

    The settings are :class:`PromptLookupSettings`.
    """)
