"""Lookahead decoding: a 2D Jacobi window produces n-grams; a pool of them is verified in the same forward.

Reference: Fu et al., *Break the Sequential Dependency of LLM Inference Using Lookahead Decoding*
(ICML 2024); ``docs/methods/lookahead.md``.

Algorithm (per row)
    State: a window of up to ``N - 1`` levels x ``W`` columns and an n-gram pool (``ngram_pool``).
    Level ``l``, column ``c`` guesses the token at position ``p0 + c + l`` (``p0`` = position after
    the last committed token, the *root*). Column ``c`` is therefore the chain
    ``level0[0..c], level1[c], ..., level_top[c]``: the whole lookahead branch is a token tree
    under the root, exactly LADE's mask (level 0 causal, later levels see level 0 up to their
    column and their own column in earlier levels). The verification branch adds up to ``G``
    stored continuations keyed by the root token. Both branches are merged into ONE
    :class:`~hf_paralleldecode.engine.tree.PackedTree` and go through the general tree
    verifier (greedy, or sample-then-match) in one forward; any matching path is exact, so level 0
    (a Jacobi guess) can be accepted too.

    After the forward, the target's choice at the top node of each column is the column's next
    token: with a full window (``N - 1`` levels) the column's n-gram ``(level0[c], ...,
    level_top[c], new[c])`` enters the pool, levels move up by one and the new tokens become the
    top level; while filling (warm-up, ``N - 2`` steps) the new tokens are added as a new level.
    Every level is then shifted by the tokens just committed so that columns stay aligned with
    their positions, and the freed columns are refilled with tokens drawn from the row's context.

Settings: ``window_size`` (W), ``ngram_size`` (N), ``guess_set_size`` (G, candidates verified per
step and continuations kept per key), ``pool_from_prompt`` (seed the pool with the prompt's
n-grams), ``lookahead_seed`` (reproducible refills).

Lossless: acceptance is the general tree verifier (greedy, or sample-then-match when ``do_sample=True``) with
per-node logits processors: greedy output equals stock greedy output (token for token in fp32), sampled output
is distributed as stock sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.ngram_pool import NgramPool
from ..engine.run import decode_call
from ..engine.settings import (
    CALL_LENGTH,
    NEW_TOKENS,
    NGRAM_TOKENS,
    SEED_MAX,
    STEP_TOKENS,
    StrategySettings,
    decoding_strategy,
)
from .policy import batch_policy, check_policy_settings, shapes_from
from .prompt_lookup import CONTEXT, GUESSES, POOL, ComposedTreeProposer

__all__ = ["lookahead", "LookaheadSettings"]


@dataclass
class LookaheadSettings(StrategySettings):
    """Settings of lookahead decoding (:func:`hf_paralleldecode.lookahead`)."""

    window_size: int | None = field(
        default=None,
        metadata={"help": "W, columns of the lookahead window (n-grams produced per step). This and every setting "
                          "defaulting to ``None`` come from the device preset "
                          "(:func:`hf_paralleldecode.hardware_preset`; CPU: W=5, N=4, G=5, 2 context matches).",
                  "minimum": 1, "bound": NEW_TOKENS},
    )
    ngram_size: int | None = field(
        default=None, metadata={"help": "N, length of the n-grams (the window has N - 1 levels); >= 2.", "minimum": 2,
                                "bound": NGRAM_TOKENS},
    )
    guess_set_size: int | None = field(
        default=None,
        metadata={"help": "G, n-grams verified per step and kept per first token (0 = no verification branch: the "
                          "window's level 0 is still verified, as a Jacobi guess).", "minimum": 0,
                  "bound": CALL_LENGTH},
    )
    pool_from_prompt: bool = field(
        default=True, metadata={"help": "seed the pool with the prompt's n-grams (good for code and edits)."},
    )
    lookahead_seed: int = field(
        default=0,
        metadata={"help": "seed of the generator that refills window columns from the context (0 to 2**64 - 1).",
                  "minimum": 0, "maximum": SEED_MAX},
    )
    context_matches: int | None = field(
        default=None,
        metadata={"help": "continuations of the row's suffix found in its prompt and output (context n-grams, as "
                          '``decoding="prompt_lookup"``) added to the tree each step; 0 = none (CPU preset 2: '
                          "measured faster on both embedded models and both prompt sets).", "minimum": 0,
                  "bound": CALL_LENGTH},
    )
    context_tokens: int = field(
        default=10, metadata={"help": "tokens of each context continuation.", "minimum": 1, "bound": NEW_TOKENS},
    )
    context_ngram_size: int = field(
        default=3, metadata={"help": "longest suffix looked up in the context.", "minimum": 1, "bound": CALL_LENGTH},
    )
    tree_budget: int | None = field(
        default=None,
        metadata={"help": "drafted nodes per step at most (``None``: no cap); window columns come first.",
                  "minimum": 1, "bound": STEP_TOKENS},
    )
    cost_aware: bool = field(
        default=False,
        metadata={"help": "feed the optional nodes (context and pool candidates) only when their expected gain pays "
                          "for their cost on this device (``hf_paralleldecode.decoding.policy.budget``)."},
    )
    adaptive: bool = field(
        default=True,
        metadata={"help": "let the batch policy (:mod:`hf_paralleldecode.decoding.policy`) pick, each step, between "
                          "the window with its candidates and a plain step for the whole batch, from measured "
                          "committed tokens per second (the measurements carry over to the model's next call). "
                          "``False`` feeds the window every step."},
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata={"help": "with ``adaptive``, the most tokens one forward may feed for the whole batch.", "minimum": 1},
    )

    def check(self) -> None:
        check_policy_settings(self.adaptive, self.max_step_tokens)


class LookaheadProposer(ComposedTreeProposer):
    """Windows (per original row) and the shared n-gram pools; builds each step's candidates."""

    def __init__(self, run, window: int, ngram: int, guesses: int, pool_from_prompt: bool, seed: int,
                 context_matches: int = 0, context_tokens: int = 10, context_ngram_size: int = 3,
                 tree_budget: int | None = None, cost_aware: bool = False, adaptive: bool = False,
                 max_step_tokens: int | None = None):
        self.run, self.W, self.N, self.G = run, window, ngram, guesses
        self.compose(run, context_matches, context_tokens, context_ngram_size, tree_budget, cost_aware,
                     mandatory=(GUESSES,))  # the window: its update reads those nodes
        # shapes: the window with context and pool candidates (configured) or a plain step; the window needs
        # every one of its nodes, so there is no shorter chain
        nodes = window * (ngram - 1) + context_matches * context_tokens + guesses * (ngram - 1)
        budget = nodes if tree_budget is None else min(nodes, tree_budget)
        self.policy = batch_policy(run, shapes_from(window + context_matches + guesses, ngram - 1, budget, True,
                                                    chains=False), run.model, adaptive, max_step_tokens,
                                   self.node_budget)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        batch = run.prompt.shape[0]
        self.pool = NgramPool(batch, max_per_key=guesses)
        if pool_from_prompt and guesses > 0:
            for r in range(batch):
                tokens = run.prompt_tokens(r) + run.log.host_tokens(r)[:1]
                self.pool.add_sequence(r, tokens, ngram)
        fill = run.context_draw(window, self.generator)
        self.levels: dict[int, list[list[int]]] = {r: [fill[i]] for i, r in enumerate(run.row_ids)}
        self.ages: dict[int, list[int]] = {r: [0] * window for r in run.row_ids}  # updates since refill
        self.roots: dict[int, int] = {r: int(run.log.tokens[r, 0]) for r in run.row_ids}  # last committed

    @property
    def stats(self) -> dict:
        return self.with_context_stats({"pool_entries": sum(self.pool.size(r) for r in range(self.run.prompt.shape[0]))})

    def propose(self):
        """Window columns first (their nodes are read back in ``update``), then context matches and pool n-grams."""
        log = self.run.log
        if self.plain_step:
            return self.pack(self.run.roots(), [[] for _ in self.run.row_ids], [])
        counts = log.host_counts(self.run.row_ids)
        context = self.context_candidates(counts)
        roots, cands, sources = [], [], []
        for i, (r, count) in enumerate(zip(self.run.row_ids, counts)):
            root = self.roots[r]
            max_depth = int(log.max_new_tokens) - count  # a depth-d path commits d + 1 tokens
            levels = self.levels[r]
            window = [levels[0][: c + 1] + [lv[c] for lv in levels[1:]] for c in range(self.W)]
            found = context[i]
            guesses = self.pool.get(r, root, self.G)
            roots.append(root)
            cands.append([c[:max_depth] for c in window + found + guesses])
            sources.append([GUESSES] * len(window) + [CONTEXT] * len(found) + [POOL] * len(guesses))
        return self.pack(self.run.roots(), cands, sources)

    def update(self, tree, verdict) -> None:
        """Collect n-grams, move levels up, slide by the committed tokens, refill freed columns.

        A column whose top node the token budget cut (end of generation) gets no new token this
        step and is refilled. A refilled column holds context tokens, not Jacobi output, in every
        level: its n-grams enter the pool only after ``N - 2`` updates made its levels genuine.
        """
        accepted_l, committed = verdict.nums, verdict.committed
        fills = self.run.context_draw(self.W, self.generator)
        if self.plain_step:  # one token committed, no window node fed: every level slides by one column
            for i, r in enumerate(self.run.row_ids):
                self.roots[r] = committed[i][0]
                self.levels[r] = [lv[1:] + fills.tail(i, len(lv) - 1) for lv in self.levels[r]]
                self.ages[r] = self.ages[r][1:] + [0]
            return
        choices_l = verdict.choices.tolist()
        for i, r in enumerate(self.run.row_ids):
            levels, ages, fill = self.levels[r], self.ages[r], fills[i]
            self.roots[r] = committed[i][accepted_l[i]]  # the bonus token is the next root
            depth = len(levels)  # column c is c + depth tokens long (level 0 up to c, then one per level)
            cols = tree.candidate_nodes[i][: self.W]
            new = [choices_l[i][col[-1]] if len(col) == c + depth else None for c, col in enumerate(cols)]
            if depth == self.N - 1:  # full window: harvest n-grams, levels move up
                for c in range(self.W):
                    if new[c] is not None and ages[c] >= self.N - 2:
                        self.pool.add(r, levels[0][c], [lv[c] for lv in levels[1:]] + [new[c]])
                levels, drop = levels[1:] + [new], accepted_l[i]  # slide by committed - 1
            else:  # warm-up: one more level
                levels, drop = levels + [new], accepted_l[i] + 1  # slide by committed
            ages = [a + 1 for a in ages[drop:]] + [0] * min(drop, self.W)
            levels = [lv[drop:] + fill[len(lv[drop:]) :] for lv in levels]
            for c, tok in enumerate(levels[-1]):
                if tok is None:  # cut by the budget: refill
                    levels[-1][c], ages[c] = fill[c], 0
            self.levels[r], self.ages[r] = levels, ages


def _run(model, settings: LookaheadSettings, call):
    preset, s = settings.with_preset(model, call.name)
    return decode_call(
        model, call,
        lambda run: LookaheadProposer(run, s.window_size, s.ngram_size, s.guess_set_size, s.pool_from_prompt,
                                      s.lookahead_seed, s.context_matches, s.context_tokens, s.context_ngram_size,
                                      s.tree_budget, s.cost_aware, s.adaptive, s.max_step_tokens),
        {**{k: v for k, v in s.to_dict().items() if k not in ("pool_from_prompt", "lookahead_seed")},
         "hardware_preset": preset})


lookahead = decoding_strategy("lookahead", LookaheadSettings, _run, doc="""
    Lossless lookahead decoding (greedy or sampled); a ``custom_generate`` callable.

    The settings are :class:`LookaheadSettings`.
    """)
