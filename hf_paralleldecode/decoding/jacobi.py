"""Jacobi decoding: fixed-point iteration on an n-token block, block after block (greedy or sampled).

Algorithm (per row; rows run independently, see ``cache.py`` for how they share one cache)
    A block covers ``n = block_size`` output positions. Its first token is the last committed
    token (known, its KV not yet computed); the other ``n - 1`` positions hold guesses. Each
    iteration feeds ``[last committed, guesses...]`` (only the unconverged part of the block) in
    one forward with a causal mask after the committed prefix. The target's choices ``y`` (its
    argmax, or a draw from its distribution when sampling) give the Jacobi update of every
    position; the leading guesses equal to ``y`` are converged (accepted), and ``y`` right after
    them is exact as well (bonus). A step commits
    ``accepted + 1`` tokens and keeps the KV of the fed tokens it accepted; the rest of the
    block is replaced by its Jacobi update ``y`` and iterated again. When the block is complete,
    the bonus token starts the next block. ``block_size=1`` is ordinary greedy decoding.

Guess initialisation (``jacobi_init``)
    * ``"random_context"`` (default, as CLLM and Jacobi Forcing): each guess is a token drawn
      uniformly from the row's own context (prompt without padding + generated tokens), with a
      ``torch.Generator`` seeded by ``jacobi_seed``: the same call gives the same trajectory.
    * ``"repeat"``: every guess is the block's first token.
    The initialisation changes speed only, never the output.

Lossless
    Every committed token is the target's choice given the exact committed prefix, with the
    user's logits processors applied per position (``processors.py``): its argmax when greedy, a
    draw from its processed distribution when ``do_sample=True`` (sample-then-match,
    ``verify.py``). Greedy output therefore equals stock greedy output token for token (in fp32;
    in bf16 / fp16 a many-token forward can round a near-tied argmax differently from a one-token
    forward), and sampled output is distributed as stock sampling. The committed tokens are emitted
    step by step exactly as stock generation (``commit.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.run import Proposer, decode_call
from ..engine.settings import NEW_TOKENS, SEED_MAX, StrategySettings, decoding_strategy
from ..engine.tree import chain_tree, root_tree
from .policy import batch_policy, check_policy_settings, shapes_from
from .policy.shapes import verdict_counts

__all__ = ["jacobi", "JacobiSettings", "JACOBI_INITS"]

JACOBI_INITS = ("random_context", "repeat")


@dataclass
class JacobiSettings(StrategySettings):
    """Settings of Jacobi decoding (:func:`hf_paralleldecode.jacobi`)."""

    block_size: int | None = field(
        default=None,
        metadata={"help": "n, the number of tokens iterated in parallel (1 = ordinary greedy decoding; default: the "
                          "device preset, 16 on CPU, see :func:`hf_paralleldecode.hardware_preset`). At most "
                          "``max_new_tokens``: a larger block is lowered to it.", "minimum": 1, "bound": NEW_TOKENS},
    )
    jacobi_init: str = field(
        default="random_context",
        metadata={"help": 'how the guesses of a new block are initialised, ``"random_context"`` or ``"repeat"`` (see '
                          "the module docstring). Changes speed only, never the output.", "choices": JACOBI_INITS},
    )
    jacobi_seed: int = field(
        default=0, metadata={"help": 'seed of the generator used by ``"random_context"`` (0 to 2**64 - 1).',
                             "minimum": 0, "maximum": SEED_MAX},
    )
    adaptive: bool = field(
        default=True,
        metadata={"help": "let the batch policy (:mod:`hf_paralleldecode.decoding.policy`) pick each step's shape for "
                          "the whole batch from measured committed tokens per second: the rest of the block "
                          "(configured), at most 9, 5 or 3 of its tokens, or the last committed token alone (the "
                          "guesses not fed wait for a later step; the measurements carry over to the model's next "
                          "call). ``False`` feeds the rest of the block every step."},
    )
    max_step_tokens: int | None = field(
        default=None,
        metadata={"help": "with ``adaptive``, the most tokens one forward may feed for the whole batch.", "minimum": 1},
    )

    def check(self) -> None:
        check_policy_settings(self.adaptive, self.max_step_tokens)


class JacobiProposer(Proposer):
    """Per-row Jacobi block state: the tokens to feed next and how much of the block is left.

    ``draft`` ``[active, block_size]``: ``draft[:, 0]`` is the last committed token, the rest are
    guesses; ``block_left`` (host ints, one per active row): positions of the current block not yet finalised,
    counting ``draft[:, 0]``. The bookkeeping reads nothing of the device: the accepted counts come with the verdict.
    """

    def __init__(self, run, block_size: int, init: str, seed: int, adaptive: bool = False,
                 max_step_tokens: int | None = None):
        self.run = run
        # shapes: the rest of the block (configured), at most 9 / 5 / 3 of its tokens, the last committed token alone
        self.policy = batch_policy(run, shapes_from(1, block_size - 1, block_size - 1, False), run.model, adaptive,
                                   max_step_tokens) if block_size > 1 else None
        self.n = block_size
        self.init = init
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        log = run.log
        first = log.tokens[run.rows, 0]
        self.draft = first[:, None].repeat(1, block_size)
        self.block_left = [block_size] * first.shape[0]
        self._new_guesses([True] * first.shape[0])

    def propose(self):
        if self.plain_step:  # the roots alone, as stock decoding feeds them
            return root_tree(self.draft[:, 0])
        widths = self.widths()
        return chain_tree(self.draft[:, : max(widths)], torch.tensor(widths, dtype=torch.long, device=self.draft.device))

    def widths(self) -> list[int]:
        """Tokens to feed per row (host ints): the rest of the block, capped by the row's token budget and the step's
        shape."""
        log = self.run.log
        cap = self.n if self.configured_step else self.shape.depth + 1
        return [min(left, log.max_new_tokens - count, cap)
                for left, count in zip(self.block_left, log.host_counts(self.run.row_ids))]

    def select(self, keep: torch.Tensor) -> None:
        self.draft = self.draft[keep]
        self.block_left = [self.block_left[i] for i in self.run.kept_positions]

    def update(self, tree, verdict) -> None:
        """Jacobi update after a forward: the target's choices ``[active, width]`` and accepted counts."""
        choices, accepted = verdict.choices, verdict.num_accepted
        width = choices.shape[1]
        src = accepted[:, None] + torch.arange(self.n, device=choices.device)  # old position of each new one, - 1
        # bonus token, then the Jacobi update of the fed positions, then the guesses a shorter step did not feed
        self.draft = torch.where(src < tree.num_nodes[:, None], choices.gather(1, src.clamp(max=width - 1)),
                                 self.draft.gather(1, (src + 1).clamp(max=self.n - 1)))
        counts = verdict_counts(verdict)
        self.block_left = [left - n - 1 for left, n in zip(self.block_left, counts)]
        finished = [left <= 0 for left in self.block_left]
        if any(finished):
            self.block_left = [self.n if f else left for f, left in zip(finished, self.block_left)]
            self._new_guesses(finished)

    def _new_guesses(self, finished: list[bool]) -> None:
        """New guesses for the rows whose block finished (host flags, one per active row): one copy to the device."""
        if self.n == 1:
            return
        device = self.draft.device
        if self.init == "repeat":
            mask = torch.tensor(finished, device=device)
            fill = self.draft[:, :1].expand(-1, self.n - 1)
        else:  # the flags and the draws in one tensor
            draws = self.run.sample_context_lists(self.n - 1, self.generator)
            packed = torch.tensor([[int(f)] + d for f, d in zip(finished, draws)], dtype=torch.long, device=device)
            mask, fill = packed[:, 0].bool(), packed[:, 1:]
        self.draft[:, 1:] = torch.where(mask[:, None], fill, self.draft[:, 1:])


def _run(model, settings: JacobiSettings, call):
    preset, s = settings.with_preset(model, call.name)
    return decode_call(
        model, call, lambda run: JacobiProposer(run, s.block_size, s.jacobi_init, s.jacobi_seed, s.adaptive,
                                                s.max_step_tokens),
        dict(block_size=s.block_size, adaptive=s.adaptive, max_step_tokens=s.max_step_tokens, hardware_preset=preset))


jacobi = decoding_strategy("jacobi", JacobiSettings, _run, doc="""
    Lossless Jacobi decoding (greedy or sampled); a ``custom_generate`` callable.

    Use ``model.generate(**inputs, custom_generate=hf_paralleldecode.jacobi, block_size=16)`` on any model, or
    ``model.generate(**inputs, decoding="jacobi", block_size=16)`` on a model passed through
    :func:`hf_paralleldecode.enable`. The settings are :class:`JacobiSettings`.
    """)
