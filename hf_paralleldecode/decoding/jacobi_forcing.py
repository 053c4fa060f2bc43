"""Jacobi Forcing decoding: multiblock Jacobi iteration plus rejection recycling, in one forward per step.

Reference: Hu et al., *Fast and Accurate Causal Parallel Decoding using Jacobi Forcing* (2025);
``docs/methods/jacobi_forcing.md``.

Algorithm (per row)
    The row keeps one *chain* of guesses for consecutive positions after its last committed token
    (the root), split into up to ``K = num_blocks`` blocks of ``n = block_size`` positions. The
    first block is *real-active*: its tokens are verified and committed. The later blocks are
    *pseudo-active*: they follow the real-active block's unconverged guesses in the same chain,
    so they are Jacobi-updated under that noisy prefix, and they are committed only once every
    earlier position is. A new pseudo-active block is appended when the newest block has
    converged past ``activation_ratio`` (r) of its positions (converged = its leading positions
    reproduced by the Jacobi update). When the real-active block is complete the next block is
    promoted and verified under the committed prefix like any other position: nothing of the
    pseudo-active work is thrown away at block boundaries.

    Rejection recycling: after every iteration the updated (unconverged) chain feeds an n-gram
    pool (``ngram_pool``) keyed by first token; each step up to ``pool_size`` stored continuations
    of the root token are verified together with the chain. Chain and candidates are merged into
    one token tree and go through the general tree verifier (greedy, or sample-then-match) in ONE
    forward; the longest accepted path wins. The pool lives for the whole call.

    With ``num_blocks=1``, ``pool_size=0`` and ``context_matches=0`` this reduces to plain Jacobi iteration.

Defaults (``None``): the paper's GPU configuration ``n=64, K=2, r=0.85, pool_size=4`` on CUDA, and
on CPU the configuration in :data:`CPU_DEFAULTS` (see ``docs/methods/jacobi_forcing.md`` for how it
was measured). ``ngram_size`` defaults to ``max(block_size, 2)`` (recycled candidates as long as a block).

Lossless: every committed token is the target's choice given the committed prefix (its argmax when
greedy, a draw from its processed distribution when sampling), as in :func:`hf_paralleldecode.jacobi`:
greedy output equals stock greedy output (token for token in fp32), sampled output is distributed as
stock sampling.
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
from ..hardware import CPU_DEFAULTS, GPU_DEFAULTS  # noqa: F401 - the presets' old home
from .policy import batch_policy, check_policy_settings, shapes_from
from .prompt_lookup import CONTEXT, GUESSES, POOL, ComposedTreeProposer

__all__ = ["jacobi_forcing", "JacobiForcingSettings", "GPU_DEFAULTS", "CPU_DEFAULTS"]



def _check_ratio(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`activation_ratio` must be a number in (0, 1], got {value!r}.")
    if not 0 < value <= 1:
        raise ValueError(f"`activation_ratio` must be in (0, 1], got {value}.")


@dataclass
class JacobiForcingSettings(StrategySettings):
    """Settings of Jacobi Forcing decoding (:func:`hf_paralleldecode.jacobi_forcing`).

    ``None``: the device preset (:func:`hf_paralleldecode.hardware_preset`; ``GPU_DEFAULTS`` on Hopper / Blackwell,
    ``CPU_DEFAULTS`` on a CPU), except ``ngram_size`` (``max(block_size, 2)``) and ``tree_budget`` (no cap).
    """

    block_size: int | None = field(
        default=None,
        metadata={"help": "n, positions per block (default: 64 on CUDA, ``CPU_DEFAULTS`` on CPU). Every ``None`` below "
                          "is the device preset too (``GPU_DEFAULTS`` / ``CPU_DEFAULTS``).", "minimum": 1,
                  "bound": NEW_TOKENS},
    )
    num_blocks: int | None = field(
        default=None,
        metadata={"help": "K, blocks in flight (1 real-active + up to K - 1 pseudo-active).", "minimum": 1,
                  "bound": NEW_TOKENS},
    )
    activation_ratio: float | None = field(
        default=None,
        metadata={"help": "r in (0, 1]: converged share of the newest block before another is added.",
                  "check": _check_ratio},
    )
    pool_size: int | None = field(
        default=None,
        metadata={"help": "recycled n-gram candidates verified per step (0 disables rejection recycling).",
                  "minimum": 0, "bound": CALL_LENGTH},
    )
    ngram_size: int | None = field(
        default=None, metadata={"help": "length of recycled n-grams (default: ``max(block_size, 2)``).", "minimum": 2,
                                "bound": NGRAM_TOKENS},
    )
    jacobi_seed: int = field(
        default=0,
        metadata={"help": "seed for the guesses of new blocks (drawn from the row's context; 0 to 2**64 - 1).",
                  "minimum": 0, "maximum": SEED_MAX},
    )
    context_matches: int | None = field(
        default=None,
        metadata={"help": "continuations of the row's suffix found in its prompt and output (context n-grams, as "
                          '``decoding="prompt_lookup"``) added to the tree each step; 0 = none (default: 0 on CUDA, '
                          "2 on CPU).", "minimum": 0, "bound": CALL_LENGTH},
    )
    context_tokens: int | None = field(
        default=None,
        metadata={"help": "tokens of each context continuation (default: 10 on CUDA, 6 on CPU).", "minimum": 1,
                  "bound": NEW_TOKENS},
    )
    context_ngram_size: int = field(
        default=3, metadata={"help": "longest suffix looked up in the context.", "minimum": 1, "bound": CALL_LENGTH},
    )
    tree_budget: int | None = field(
        default=None,
        metadata={"help": "drafted nodes per step at most (``None``: no cap); the chain comes first.", "minimum": 1,
                  "bound": STEP_TOKENS},
    )
    cost_aware: bool = field(
        default=False,
        metadata={"help": "feed the optional nodes (context and recycled candidates) only when their expected gain "
                          "pays for their cost on this device (``hf_paralleldecode.decoding.policy.budget``)."},
    )
    adaptive: bool = field(
        default=True,
        metadata={"help": "let the batch policy (:mod:`hf_paralleldecode.decoding.policy`) pick each step's shape for "
                          "the whole batch from measured committed tokens per second: the chain with context and "
                          "recycled candidates (configured), the chain alone cut to 8, 4 or 2 guesses, or a plain "
                          "step (the guesses not fed wait for a later step; the measurements carry over to the "
                          "model's next call). ``False`` feeds the configured tree every step."},
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata={"help": "with ``adaptive``, the most tokens one forward may feed for the whole batch.", "minimum": 1},
    )

    def check(self) -> None:
        check_policy_settings(self.adaptive, self.max_step_tokens)


class MultiblockProposer(ComposedTreeProposer):
    """Per original row: the chain of guesses (``chain[0]`` = root) and the end of each block.

    Positions are indices into the row's generated tokens; the root sits at ``count - 1``. Block
    ``k`` covers ``[ends[k-1], ends[k])``; the first listed block is the real-active one.
    """

    def __init__(self, run, n, num_blocks, ratio, pool_size, ngram_size, seed, context_matches=0, context_tokens=10,
                 context_ngram_size=3, tree_budget=None, cost_aware=False, adaptive=False, max_step_tokens=None):
        self.run, self.n, self.K, self.r = run, n, num_blocks, ratio
        self.compose(run, context_matches, context_tokens, context_ngram_size, tree_budget, cost_aware,
                     mandatory=(GUESSES,))  # the chain: its Jacobi update reads those nodes
        # shapes: chain + context + recycled (configured), the chain cut to 8 / 4 / 2 guesses, a plain step
        guesses = n * num_blocks - 1
        nodes = guesses + context_matches * context_tokens + pool_size * (ngram_size - 1)
        budget = nodes if tree_budget is None else min(nodes, tree_budget)
        self.policy = batch_policy(
            run, shapes_from(1 + context_matches + pool_size, max(guesses, context_tokens if context_matches else 0),
                             budget, bool(context_matches or pool_size)), run.model, adaptive, max_step_tokens,
            self.node_budget)
        self.pool_size, self.ngram = pool_size, ngram_size
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        batch = run.prompt.shape[0]
        self.pool = NgramPool(batch, max_per_key=max(pool_size, 1))
        self.chain: dict[int, list[int]] = {}
        self.ends: dict[int, list[int]] = {}
        self.root_pos: dict[int, int] = {}
        self._stats = dict(blocks_activated=0, recycled_wins=0)
        fills = self._draw()
        for i, r in enumerate(run.row_ids):
            self.chain[r] = [int(run.log.tokens[r, 0])]
            self.root_pos[r] = 0
            self.ends[r] = [n]  # the first block starts at the first generated token (the root)
            self._fit(r, 0, fills, i)

    @property
    def stats(self) -> dict:
        return self.with_context_stats(self._stats)

    def _limit(self, r: int) -> int:
        return int(self.run.log.max_new_tokens)

    def _fit(self, r: int, root_pos: int, fills, i: int) -> None:
        """Make the chain cover ``root_pos .. last block end - 1`` (capped by the token budget); new positions
        take active row ``i``'s tokens of ``fills()`` (a :class:`~.base.ContextDraw`, drawn when first needed), cycled."""
        want = min(self.ends[r][-1], self._limit(r)) - root_pos
        chain = self.chain[r][:want]
        if len(chain) < want:
            chain = chain + fills().cycled(i, want - len(chain))
        self.chain[r] = chain

    def _draw(self):
        """A callable that draws the step's :class:`~.base.ContextDraw` once, on its first call: a step whose
        chains need no new positions (a plain step, mostly) draws nothing."""
        drawn = []

        def fills():
            if not drawn:
                drawn.append(self.run.context_draw(self.n, self.generator))
            return drawn[0]

        return fills

    def propose(self):
        """The chain first (its nodes are read back in ``update``), then context matches and recycled n-grams."""
        counts = self.run.log.host_counts(self.run.row_ids)
        roots, cands, sources = [], [], []
        if not self.configured_step:  # the chain alone, cut to the shape's depth (a plain step: none of it)
            rows = self.run.row_ids
            cands = [[self.chain[r][1: self.shape.depth + 1][: self._limit(r) - c]] for r, c in zip(rows, counts)]
            return self.pack(self.run.roots(), cands, [[GUESSES] for _ in cands])
        context = self.context_candidates(counts)  # (only the configured tree holds context matches)
        for i, r in enumerate(self.run.row_ids):
            chain = self.chain[r]
            found = context[i]
            guesses = self.pool.get(r, chain[0], self.pool_size) if self.pool_size else []
            room = self._limit(r) - counts[i]  # a depth-d path commits d + 1 tokens
            roots.append(chain[0])
            cands.append([c[:room] for c in [chain[1:]] + found + guesses])
            sources.append([GUESSES] + [CONTEXT] * len(found) + [POOL] * len(guesses))
        return self.pack(self.run.roots(), cands, sources)

    def update(self, tree, verdict) -> None:
        committed = verdict.committed
        counts = [n + 1 for n in verdict.nums]
        fills = self._draw()
        configured = self.configured_step
        plain = self.plain_step
        if plain:  # the roots alone: the target's choice after each is the token it committed
            choices_l, chain_nodes = committed, [[] for _ in committed]
        else:  # the choices and the chain's nodes (candidate 0: only its nodes are read), in one read
            width = verdict.choices.shape[1]
            flat = torch.cat([verdict.choices.reshape(-1), tree.candidate_index[:, 0].reshape(-1)]).tolist()
            rows, split = len(committed), len(committed) * width
            length = (len(flat) - split) // max(rows, 1)
            choices_l = [flat[i * width:(i + 1) * width] for i in range(rows)]
            chain_nodes = [flat[split + i * length:split + (i + 1) * length] for i in range(rows)]
        for i, r in enumerate(self.run.row_ids):
            old = self.chain[r]
            nodes = [0] + [m for m in chain_nodes[i] if m >= 0]  # main-chain node of each chain position
            update = [choices_l[i][m] for m in nodes]  # update[j] = Jacobi guess for chain position j + 1
            old_root_pos = self.root_pos[r]
            a = min(counts[i], self._limit(r) - 1 - old_root_pos)  # committed this step (the new root is the bonus)
            root_pos = old_root_pos + a
            # convergence of the newest block: its committed positions (the new root included) plus
            # its next positions that the Jacobi update reproduced under the (noisy) old chain
            ends = self.ends[r]
            block_start, block_end = (ends[-2] if len(ends) > 1 else ends[-1] - self.n), ends[-1]
            newest_done = max(0, min(root_pos + 1, block_end) - block_start)
            for pos in range(max(block_start, root_pos + 1), min(block_end, old_root_pos + len(nodes))):
                j = pos - old_root_pos
                if old[j] != update[j - 1]:
                    break
                newest_done += 1
            main = 0  # guesses of the main chain accepted: fewer than a - 1 means a recycled n-gram won
            while main + 1 < len(nodes) and old[main + 1] == update[main]:
                main += 1
            self._stats["recycled_wins"] += int(a - 1 > main)
            # Jacobi update of the rest of the chain; recycle its n-grams
            bonus = committed[i][a - 1]
            if configured:
                new_chain = [bonus] + update[a : len(nodes) - 1]
            else:  # a shorter step: the positions it did not feed keep their guesses
                new_chain = [bonus] + [update[p - 1] if p <= len(nodes) else old[p] for p in range(a + 1, len(old))]
            if self.pool_size and not plain:  # tail n-grams are shorter, never empty (a plain step only shifts the
                # chain: its n-grams are in the pool already)
                self.pool.add_windows(r, new_chain, self.ngram, start=1)
            self.chain[r] = new_chain
            self.root_pos[r] = root_pos
            ends = [e for e in ends if e > root_pos]
            if not ends:
                ends = [root_pos + self.n]
            elif len(ends) < self.K and newest_done >= self.r * self.n:
                ends.append(ends[-1] + self.n)
                self._stats["blocks_activated"] += 1
            self.ends[r] = ends
            self._fit(r, root_pos, fills, i)


def _run(model, settings: JacobiForcingSettings, call):
    """The preset is :func:`hf_paralleldecode.hardware_preset` for the model's device (``CPU_DEFAULTS`` on a CPU; on
    CUDA the part's roofline preset, which on Hopper / Blackwell is the paper's ``GPU_DEFAULTS``)."""
    preset, s = settings.with_preset(model, call.name)
    if s.ngram_size is None:
        s.ngram_size = max(s.block_size, 2)
    s.activation_ratio = float(s.activation_ratio)
    return decode_call(
        model, call,
        lambda run: MultiblockProposer(run, s.block_size, s.num_blocks, s.activation_ratio, s.pool_size, s.ngram_size,
                                       s.jacobi_seed, s.context_matches, s.context_tokens, s.context_ngram_size,
                                       s.tree_budget, s.cost_aware, s.adaptive, s.max_step_tokens),
        {**{k: v for k, v in s.to_dict().items() if k != "jacobi_seed"}, "hardware_preset": preset})


jacobi_forcing = decoding_strategy("jacobi_forcing", JacobiForcingSettings, _run, doc="""
    Lossless Jacobi Forcing decoding (multiblock + rejection recycling); a ``custom_generate`` callable.

    Greedy or sampled (``do_sample=True``); see the module docstring. The settings are
    :class:`JacobiForcingSettings`.
    """)
