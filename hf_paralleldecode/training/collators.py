"""Turn collected trajectories into training batches (random state choice happens here, per batch).

* :class:`ConsistencyCollator` (CLLM): per row one complete block ``i`` and one noisy state ``y``
  of its trajectory (plus the next state ``y'`` for local consistency); the student sequence is
  ``prompt + fixed points before i + y``, the teacher sequence ``... + y*`` (global) or ``... + y'``
  (local), and the clean sequence ``prompt + response`` carries the AR loss.
* :class:`ProgressiveCollator` (Jacobi Forcing): per row, every complete block gets a target
  noise ratio from the schedule, the nearest trajectory state becomes its noisy block, and the
  row is packed ``[prompt][noisy_0][clean_0]...`` with its noise-conditioned (or CLLM) mask.

Both validate rows (missing columns, block-size mismatch) with a ``ValueError`` naming the problem.
"""

from __future__ import annotations

import random

import torch

from .packing import additive_mask, dense_mask, noise_ratio, noise_schedule, pack_sequence, select_states

__all__ = ["ConsistencyCollator", "ProgressiveCollator", "REQUIRED_COLUMNS"]

REQUIRED_COLUMNS = ("prompt_ids", "response_ids", "trajectories", "fixed_points")


def check_block_size(collected: int | None, block_size: int) -> None:
    """``ValueError`` when data collected with block size ``collected`` (``None``: not known) cannot train
    ``block_size`` (a real run's first batch and ``train --dry-run`` refuse it in the same words)."""
    if collected is not None and collected != block_size:
        raise ValueError(
            f"The data was collected with block size {collected} but the config says block_size={block_size}; "
            "collect again or set block_size to match."
        )


def _check_row(row: dict, block_size: int) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in row]
    if missing:
        raise ValueError(f"Trajectory rows need columns {list(REQUIRED_COLUMNS)}; missing {missing}.")
    for fixed in row["fixed_points"]:
        check_block_size(len(fixed), block_size)


def _pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, seqs))
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


class ConsistencyCollator:
    """CLLM batches: per row one complete block, one noisy state of its trajectory and the teacher state.

    Rows need ``prompt_ids``, ``response_ids``, ``trajectories`` (per block, its Jacobi states) and
    ``fixed_points`` (per block, its converged tokens), as written by ``hf-paralleldecode collect``. A row
    missing a column, collected with another block size, or without a complete block raises ``ValueError``.
    The block and the state are drawn at random per call (the collator's own seeded generator).

    Calling it on a list of rows returns a dict of tensors: ``student_ids`` (prompt, the earlier fixed points, the
    noisy state), ``student_len``, ``teacher_ids`` (the same with the teacher state), ``block_start`` (the position
    whose logits predict the block's first token), ``block_mask`` ``[B, n]`` (the positions that count: past the
    prefix the noisy state already shares with the teacher state), ``clean_ids`` / ``clean_attention_mask`` (prompt
    + response) and ``labels`` (``clean_ids`` with ``-100`` on the prompt and padding; the trainer shifts them).

    Args:
        block_size: Jacobi block size ``n``; must equal the collection's.
        consistency: ``"global"`` (the teacher state is the fixed point) or ``"local"`` (the next state).
        pad_token_id: Id written into the padding.
        seed: Seed of the collator's own random generator.
    """

    def __init__(self, block_size: int, consistency: str = "global", pad_token_id: int = 0, seed: int = 0):
        if consistency not in ("global", "local"):
            raise ValueError(f"consistency must be 'global' or 'local', got {consistency!r}.")
        self.n, self.consistency, self.pad = block_size, consistency, pad_token_id
        self.rng = random.Random(seed)

    def __call__(self, rows: list[dict]) -> dict:
        students, teachers, cleans, starts, masks = [], [], [], [], []
        for row in rows:
            _check_row(row, self.n)
            blocks = [k for k, states in enumerate(row["trajectories"]) if states]
            if not blocks:
                raise ValueError(f"Row {row.get('prompt_id')} has no complete block to learn from.")
            i = self.rng.choice(blocks)
            states, fixed = row["trajectories"][i], row["fixed_points"][i]
            j = self.rng.randrange(max(len(states) - 1, 1))
            noisy = states[j]
            target = fixed if self.consistency == "global" else states[min(j + 1, len(states) - 1)]
            prefix = list(row["prompt_ids"]) + [t for blk in row["fixed_points"][:i] for t in blk]
            students.append(prefix + list(noisy))
            teachers.append(prefix + list(target))
            cleans.append(list(row["prompt_ids"]) + list(row["response_ids"]))
            starts.append(len(prefix) - 1)  # logits at start + k predict block position k
            # predicting block position k sees noisy[:k]; where that equals target[:k] both sides see the
            # same context and the pair carries no signal
            agree = round((1 - noise_ratio(noisy, target)) * self.n)
            masks.append([k > agree for k in range(self.n)])
        clean_ids = _pad(cleans, self.pad)
        labels = _pad(cleans, -100)
        for b, row in enumerate(rows):  # AR loss on the response only
            labels[b, : len(row["prompt_ids"])] = -100
        return dict(
            student_ids=_pad(students, self.pad), student_len=torch.tensor([len(s) for s in students]),
            teacher_ids=_pad(teachers, self.pad), block_start=torch.tensor(starts),
            block_mask=torch.tensor(masks, dtype=torch.bool), clean_ids=clean_ids,
            clean_attention_mask=_pad([[1] * len(c) for c in cleans], 0), labels=labels,
        )


class ProgressiveCollator:
    """Jacobi Forcing batches: every complete block of a row, noised by the schedule, packed with its fixed point.

    Rows need the columns :class:`ConsistencyCollator` needs (``prompt_ids``, ``response_ids``, ``trajectories``,
    ``fixed_points``); the same problems raise ``ValueError``. Per row, block ``i`` gets the target noise ratio
    ``W[i mod window]`` of the schedule, the trajectory state nearest it becomes its noisy block, and the row is
    packed ``[prompt][noisy_0][clean_0][noisy_1][clean_1]...`` with shared position ids per pair.

    Calling it on a list of rows returns a dict of tensors: ``input_ids`` / ``position_ids`` / ``labels`` ``[B,
    S]`` (next-token labels of the clean blocks, ``-100`` elsewhere), ``attention_mask`` (additive float mask ``[B,
    1, S, S]``; padding sees only itself), ``noisy_index`` / ``clean_index`` ``[B, P]`` (positions of each noisy
    token and its clean counterpart) and ``pair_mask`` ``[B, P]`` (which pairs exist).

    Args:
        block_size: Jacobi block size ``n``; must equal the collection's.
        schedule: Noise schedule, ``"linear"``, ``"reverse"`` or ``"random"``.
        window: Window ``w`` of the schedule.
        mask: Attention mask, ``"noise_conditioned"`` or ``"cllm"``.
        pad_token_id: Id written into the padding.
        seed: Seed of the collator's own generator (the ``random`` schedule).
    """

    def __init__(self, block_size: int, schedule: str = "linear", window: int = 4, mask: str = "noise_conditioned",
                 pad_token_id: int = 0, seed: int = 0):
        noise_schedule(schedule, window, 1)  # validates
        self.n, self.schedule, self.window, self.mask, self.pad = block_size, schedule, window, mask, pad_token_id
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, rows: list[dict]) -> dict:
        packed = []
        for row in rows:
            _check_row(row, self.n)
            fixed_points = row["fixed_points"]
            if not fixed_points:
                raise ValueError(f"Row {row.get('prompt_id')} has no complete block to learn from.")
            targets = noise_schedule(self.schedule, self.window, len(fixed_points), self.generator)
            noisy = [select_states(states, fixed, t) for states, fixed, t in
                     zip(row["trajectories"], fixed_points, targets)]
            packed.append(pack_sequence(row["prompt_ids"], noisy, fixed_points))
        length = max(p.input_ids.shape[0] for p in packed)
        batch = len(packed)
        input_ids = torch.full((batch, length), self.pad, dtype=torch.long)
        position_ids = torch.zeros((batch, length), dtype=torch.long)
        labels = torch.full((batch, length), -100, dtype=torch.long)
        allowed = torch.eye(length, dtype=torch.bool).repeat(batch, 1, 1)  # padding sees itself only
        pairs = max(p.noisy_index.shape[0] for p in packed)
        noisy_index = torch.zeros((batch, pairs), dtype=torch.long)
        clean_index = torch.zeros((batch, pairs), dtype=torch.long)
        pair_mask = torch.zeros((batch, pairs), dtype=torch.bool)
        for b, p in enumerate(packed):
            k, m = p.input_ids.shape[0], p.noisy_index.shape[0]
            input_ids[b, :k], position_ids[b, :k], labels[b, :k] = p.input_ids, p.position_ids, p.labels
            allowed[b, :k, :k] = dense_mask(p, self.mask)
            noisy_index[b, :m], clean_index[b, :m], pair_mask[b, :m] = p.noisy_index, p.clean_index, True
        return dict(input_ids=input_ids, position_ids=position_ids, attention_mask=additive_mask(allowed, torch.float32),
                    labels=labels, noisy_index=noisy_index, clean_index=clean_index, pair_mask=pair_mask)
