"""Jacobi Forcing data layout: noise schedules, state selection, packed noisy/clean sequences and their masks.

Reference: Hu et al., *Fast and Accurate Causal Parallel Decoding using Jacobi Forcing* (2025);
``docs/training.md``.

What it is for
    A response is split into blocks of ``n`` tokens; block ``i`` gets a target noise ratio
    ``t_i = W[i mod w]`` from a schedule ``W`` (linear progressive, reverse progressive or
    random); the Jacobi state of block ``i`` whose noise ratio is nearest ``t_i`` becomes its
    *noisy* block, the fixed point its *clean* block. One training sequence packs
    ``[prompt][noisy_0][clean_0][noisy_1][clean_1]...`` with shared position ids per pair, and a
    mask such that one forward yields both the students (noisy blocks) and the teachers (clean
    blocks) for every block.

Noise ratio
    The share of a state's positions from its first disagreement with the fixed point onward
    (the unconverged part in Jacobi's sense: a converged prefix, then noise), so ``0`` is the fixed
    point and ``1`` a state that is wrong from its first token.

Masks (each token's visibility; Jacobi Forcing, Hu et al. 2025, Figure 4)
    * ``"noise_conditioned"`` (Jacobi Forcing): a noisy token sees the prompt, the *noisy* blocks
      before its own (the earlier blocks at their assigned noise levels) and its own block
      causally; a clean token sees the prompt, the clean blocks before its own and its own block
      causally.
    * ``"cllm"`` (no noise conditioning): a noisy token sees the prompt, the *clean* blocks before
      its own and its own block causally; clean tokens as above.
    Prompt tokens are causal among themselves. One predicate (:func:`visible`) defines each
    variant; the dense 4D mask and the FlexAttention ``mask_mod`` are both built from it (the
    trainers use the dense mask; the FlexAttention helpers are provided for custom loops).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.cache import additive_mask  # one mask builder for decoding and training; re-exported here

__all__ = [
    "SCHEDULES",
    "MASKS",
    "noise_schedule",
    "noise_ratio",
    "select_states",
    "PackedSequence",
    "pack_sequence",
    "visible",
    "dense_mask",
    "additive_mask",
    "flex_block_mask",
    "flex_mask_mod",
]

SCHEDULES = ("linear", "reverse", "random")
MASKS = ("noise_conditioned", "cllm")
PROMPT, NOISY, CLEAN = 0, 1, 2


def noise_schedule(kind: str, window: int, num_blocks: int, generator: torch.Generator | None = None) -> list[float]:
    """Target noise ratio of each block: ``t_i = W[i mod window]``.

    ``linear``: ``W = [0, 1/w, ..., (w-1)/w]`` (light to heavy noise within each window);
    ``reverse``: the same, heaviest first; ``random``: every block draws from ``W`` uniformly.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"noise schedule must be one of {SCHEDULES}, got {kind!r}.")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}.")
    levels = [k / window for k in range(window)]
    if kind == "reverse":
        levels = levels[::-1]
    if kind == "random":
        idx = torch.randint(0, window, (num_blocks,), generator=generator).tolist()
        return [levels[k] for k in idx]
    return [levels[i % window] for i in range(num_blocks)]


def noise_ratio(state: Sequence[int], fixed_point: Sequence[int]) -> float:
    """Share of positions from the first disagreement with the fixed point onward."""
    if len(state) != len(fixed_point) or not fixed_point:
        raise ValueError(f"state and fixed point must have the same non-zero length ({len(state)} vs {len(fixed_point)}).")
    agree = 0
    for a, b in zip(state, fixed_point):
        if a != b:
            break
        agree += 1
    return (len(fixed_point) - agree) / len(fixed_point)


def select_states(states: Sequence[Sequence[int]], fixed_point: Sequence[int], target: float) -> list[int]:
    """The trajectory state whose noise ratio is nearest ``target`` (the earliest on ties)."""
    if not states:
        raise ValueError("a block's trajectory has no states.")
    ratios = [noise_ratio(s, fixed_point) for s in states]
    best = min(range(len(states)), key=lambda k: (abs(ratios[k] - target), k))
    return list(states[best])


@dataclass
class PackedSequence:
    input_ids: torch.Tensor  # [length]
    position_ids: torch.Tensor  # [length]
    kind: torch.Tensor  # [length] PROMPT / NOISY / CLEAN
    block: torch.Tensor  # [length] block index (-1 for the prompt)
    noisy_index: torch.Tensor  # [blocks * n] positions of noisy tokens, block by block
    clean_index: torch.Tensor  # [blocks * n] matching positions of clean tokens
    labels: torch.Tensor  # [length] next clean token for the prompt's last token and clean tokens, else -100


def pack_sequence(prompt: Sequence[int], noisy: Sequence[Sequence[int]], clean: Sequence[Sequence[int]]) -> PackedSequence:
    """``[prompt][noisy_0][clean_0][noisy_1][clean_1]...`` with shared position ids per pair.

    Labels (AR loss on the clean response): the last prompt token predicts ``clean_0[0]``; clean
    token ``j`` of block ``i`` predicts the next clean token (the first of block ``i + 1`` at the
    block's end; nothing after the last block).
    """
    if len(noisy) != len(clean) or not clean:
        raise ValueError(f"need one noisy block per clean block (got {len(noisy)} and {len(clean)}), at least one.")
    n = len(clean[0])
    for k, (a, b) in enumerate(zip(noisy, clean)):
        if len(a) != n or len(b) != n:
            raise ValueError(f"block {k}: noisy and clean blocks must all have {n} tokens (got {len(a)}, {len(b)}).")
    if not prompt:
        raise ValueError("the prompt must not be empty.")
    p = len(prompt)
    ids, pos, kind, block = list(prompt), list(range(p)), [PROMPT] * p, [-1] * p
    noisy_index, clean_index = [], []
    for i, (a, b) in enumerate(zip(noisy, clean)):
        base = p + i * n
        for tokens, k, index in ((a, NOISY, noisy_index), (b, CLEAN, clean_index)):
            index.extend(range(len(ids), len(ids) + n))
            ids.extend(int(t) for t in tokens)
            pos.extend(range(base, base + n))
            kind.extend([k] * n)
            block.extend([i] * n)
    flat_clean = [int(t) for blk in clean for t in blk]
    labels = [-100] * len(ids)
    labels[p - 1] = flat_clean[0]
    for j, at in enumerate(clean_index):
        if j + 1 < len(flat_clean):
            labels[at] = flat_clean[j + 1]
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return PackedSequence(as_long(ids), as_long(pos), as_long(kind), as_long(block), as_long(noisy_index),
                          as_long(clean_index), as_long(labels))


def visible(variant: str, q_kind, q_block, q_pos, kv_kind, kv_block, kv_pos):
    """Whether query token (kind, block, position) may attend to key token; works on tensors (broadcast)."""
    if variant not in MASKS:
        raise ValueError(f"mask variant must be one of {MASKS}, got {variant!r}.")
    causal = kv_pos <= q_pos
    prompt_key = kv_kind == PROMPT
    same_block = (kv_block == q_block) & (kv_kind == q_kind)
    earlier = kv_block < q_block
    q_prompt, q_noisy, q_clean = q_kind == PROMPT, q_kind == NOISY, q_kind == CLEAN
    if variant == "noise_conditioned":
        noisy_sees = earlier & (kv_kind == NOISY)
    else:
        noisy_sees = earlier & (kv_kind == CLEAN)
    clean_sees = earlier & (kv_kind == CLEAN)
    return causal & (
        (q_prompt & prompt_key)
        | (~q_prompt & (prompt_key | same_block))
        | (q_noisy & noisy_sees)
        | (q_clean & clean_sees)
    )


def dense_mask(seq: PackedSequence, variant: str = "noise_conditioned") -> torch.Tensor:
    """Boolean ``[length, length]`` visibility (True = may attend)."""
    q = (seq.kind[:, None], seq.block[:, None], seq.position_ids[:, None])
    kv = (seq.kind[None, :], seq.block[None, :], seq.position_ids[None, :])
    return visible(variant, *q, *kv)




def flex_mask_mod(kind: torch.Tensor, block: torch.Tensor, position: torch.Tensor, variant: str = "noise_conditioned"):
    """FlexAttention ``mask_mod`` over a batch ``[batch, length]`` of packed sequences (same predicate)."""
    visible(variant, PROMPT, -1, 0, PROMPT, -1, 0)  # validates the variant name up front

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(variant, kind[b, q_idx], block[b, q_idx], position[b, q_idx],
                       kind[b, kv_idx], block[b, kv_idx], position[b, kv_idx])

    return mask_mod


def flex_block_mask(kind: torch.Tensor, block: torch.Tensor, position: torch.Tensor, variant: str = "noise_conditioned"):
    """FlexAttention ``BlockMask`` for a batch ``[batch, length]`` of packed sequences."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length = kind.shape
    return create_block_mask(flex_mask_mod(kind, block, position, variant), B=batch, H=None, Q_LEN=length,
                             KV_LEN=length, device=str(kind.device))
