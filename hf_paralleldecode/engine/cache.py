"""KV-cache bookkeeping shared by every strategy: per-row committed slots on one shared cache.

What it is for
    A transformers ``DynamicCache`` holds ONE sequence length for the whole batch, but rows of a
    parallel decoder accept different numbers of tokens per forward. :class:`SlotCache` wraps the
    cache with a boolean ``valid[batch, slots]`` table: a physical slot holds a committed key/value
    of that row or is a *hole* (left padding, or a guess the row rejected). Every forward appends
    ``width`` slots for all rows; the 4D additive mask built here lets each query see exactly the
    valid slots of its own row plus the new slots its layout allows (causal block, tree, ...), and
    ``position_ids`` carry each row's logical positions. Attention is invariant to the order of
    keys, so holes cost compute but never change a result.

Decision (rows that accept different lengths)
    We keep per-row committed lengths instead of committing the minimum accepted length across
    rows (simpler, but it throws away the work of fast rows): a fast row never waits for a slow
    one. Trailing slots that no row kept are cut with the cache's public ``crop`` (so at batch
    size 1 the cache always equals the committed length, with no holes); holes inside the cache
    are removed by :meth:`SlotCache.compact` (a per-row gather along the sequence axis of every
    layer) once they make up a large share of the cache.

What it deliberately does not know
    Which tokens are proposed or how they are verified: callers pass the new slots' intra-step
    mask and, after verification, which of the new slots each row keeps.
"""

from __future__ import annotations

import torch

from ..compat import GENERATE_CACHE_KEY, Cache, DynamicCache, DynamicLayer, is_sliding_window_layer

__all__ = ["SlotCache", "prepare_cache", "additive_mask"]


def additive_mask(masks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[batch, 1, queries, keys]`` additive float mask (0 / dtype min) from boolean ``[batch, queries, keys]``."""
    return _additive(masks, dtype)[:, None]


def _additive(masks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (True = may attend) -> 0 / ``dtype`` min, in ``dtype``, in one pass."""
    return torch.where(masks, torch.zeros((), dtype=dtype, device=masks.device), torch.finfo(dtype).min)


def prepare_cache(model, cache, max_length: int) -> DynamicCache:
    """Return a cache the strategies can cut back and gather, or raise ``ValueError``.

    ``generate`` hands the strategy an empty ``DynamicCache(config=...)``. Full-attention layers
    (``DynamicLayer``) are supported. Sliding-window layers are supported only when the whole
    generation fits inside the window (then sliding and full attention are the same computation,
    and a full-attention cache is used instead); otherwise the request is refused.
    """
    if cache is None:
        return DynamicCache()
    if not isinstance(cache, Cache):
        raise ValueError(f"{GENERATE_CACHE_KEY} must be a transformers Cache, got {type(cache).__name__}.")
    if cache.get_seq_length() != 0:
        raise ValueError(
            f"Parallel decoding strategies start from an empty cache; do not pass a pre-filled `{GENERATE_CACHE_KEY}`."
        )
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"{type(cache).__name__} is not supported by parallel decoding strategies (its entries cannot "
            f"be cut back or gathered). Remove `cache_implementation` / `{GENERATE_CACHE_KEY}` to use the default "
            "DynamicCache."
        )
    if getattr(cache, "offloading", False):
        raise ValueError(
            "An offloaded DynamicCache (cache_implementation='offloaded') is not supported by parallel decoding "
            "strategies: they cut back and gather the KV between forwards, which offloading copies asynchronously. "
            "Remove cache_implementation to use the default DynamicCache."
        )
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        return cache
    others = [layer for layer in cache.layers if type(layer) is not DynamicLayer]
    kinds = sorted({type(layer).__name__ for layer in others})
    window = getattr(model.config, "sliding_window", None)
    if window is None or not all(is_sliding_window_layer(layer) for layer in others):
        raise ValueError(
            f"This model's cache has layers of kind {kinds} that cannot be cut back to a committed length or "
            "gathered per row (recurrent or otherwise stateful layers); use stock generate()."
        )
    if max_length <= window:
        return DynamicCache()
    raise ValueError(
        f"This model's cache has sliding-window layers ({kinds}) that cannot be cut back exactly once the window "
        f"is exceeded, and max_length={max_length} exceeds its sliding_window={window}. Lower max_new_tokens so "
        "the whole generation fits in the window, or use stock generate()."
    )


class SlotCache:
    """Per-row valid-slot table over a shared ``DynamicCache``.

    Shapes: ``valid`` is ``[batch, num_slots]`` (bool); ``num_valid`` is ``[batch]`` and equals each
    row's logical length (the position id of its next token).
    """

    #: compact once the cache holds more than ``max(compact_min_holes, compact_ratio * longest_row)``
    #: slots beyond the longest row (holes cost attention compute; compaction, one gather per layer).
    compact_min_holes: int = 32
    compact_ratio: float = 0.25

    def __init__(self, cache: DynamicCache, valid: torch.Tensor, dtype: torch.dtype):
        self.cache = cache
        self.valid = valid.bool()  # [batch, num_slots]
        self.dtype = dtype
        self.num_compactions = 0

    @property
    def valid(self) -> torch.Tensor:
        return self._valid

    @valid.setter
    def valid(self, value: torch.Tensor) -> None:
        self._valid = value
        self._host_num_valid = None  # read again from the table when next asked
        self._num_valid = None

    def host_num_valid(self) -> list[int]:
        """``num_valid`` as host ints: read once after the table is replaced, then kept up to date by
        :meth:`commit` (do not modify)."""
        if self._host_num_valid is None:
            self._host_num_valid = self._valid.sum(-1).tolist()
        return self._host_num_valid

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    @property
    def num_valid(self) -> torch.Tensor:  # [batch] (computed once per table; do not modify)
        if self._num_valid is None:
            self._num_valid = self._valid.sum(-1)
        return self._num_valid

    def padding_mask(self, width: int) -> torch.Tensor | None:
        """2D mask ``[batch, num_slots + width]`` (1 = may attend) for ``width`` new slots that attend causally among
        themselves: the mask stock generation passes, from which the model builds its causal mask (its own fast
        path: no additive 4D mask to build and apply). ``None`` when every slot is valid (no padding, no holes):
        stock generation then passes no mask either."""
        if all(n == self.num_slots for n in self.host_num_valid()):
            return None
        new = torch.ones(self.valid.shape[0], width, dtype=torch.long, device=self.valid.device)
        return torch.cat([self.valid.long(), new], dim=1)

    def attention_mask(self, intra: torch.Tensor) -> torch.Tensor:
        """4D additive mask ``[batch, 1, width, num_slots + width]`` for the next forward.

        ``intra`` is ``[batch, width, width]`` or ``[width, width]`` (bool, True = may attend) among
        the new slots; every query must at least see itself so that no attention row is empty.
        """
        batch, width, slots = self.valid.shape[0], intra.shape[-1], self.num_slots
        # written by parts: each row's committed slots once, never a [batch, width, slots] bool in between
        out = torch.empty(batch, 1, width, slots + width, dtype=self.dtype, device=self.valid.device)
        out[..., :slots] = _additive(self.valid, self.dtype)[:, None, None, :]
        new = _additive(intra.to(self.valid.device), self.dtype)
        out[..., slots:] = new[:, None] if new.dim() == 3 else new
        return out  # [batch, 1, width, slots + width]

    def commit(self, keep: torch.Tensor) -> None:
        """Record which of the slots the last forward appended each row keeps (``keep: [batch, width]``).

        ``keep`` may be any subset (a prefix for Jacobi blocks, a root-to-leaf path for trees).
        Within the new region each row's kept slots are moved to its front (a gather over
        ``width`` slots per layer, skipped when every row keeps a prefix), then trailing slots
        that no row keeps are cropped with ``DynamicCache.crop``. At batch size 1 the cache
        therefore always equals the committed length; with rows that keep different counts the
        shorter rows leave holes, masked until the next :meth:`compact`.
        """
        keep = keep.bool()
        width = keep.shape[1]
        counts = keep.sum(1)  # [batch]
        cols = torch.arange(width, device=keep.device)
        as_prefix = cols[None, :] < counts[:, None]
        # one host read for the three decisions below
        scattered, last, longest = torch.stack(
            [(keep != as_prefix).any().long(), counts.max(), (self.num_valid + counts).max()]).tolist() if counts.numel() else (0, 0, 0)
        # each row's kept slots first, in order (only the first `last` columns survive the crop)
        order = (~keep).long().argsort(dim=1, stable=True)[:, :last] if scattered else None
        self._append(order, as_prefix[:, :last], width, longest)

    def commit_kept(self, kept: list[list[int]], width: int) -> None:
        """:meth:`commit` from host lists: ``kept[row]`` are the slots row keeps among the ``width`` new ones,
        increasing. Every decision is taken on the host (no device read)."""
        counts = [len(k) for k in kept]
        last = max(counts, default=0)
        after = [n + c for n, c in zip(self.host_num_valid(), counts)]
        order = None
        if any(k and k[-1] != len(k) - 1 for k in kept):  # increasing: a prefix ends at len - 1
            # the kept slots first; a shorter row's columns past its count are holes (any slot will do)
            order = torch.tensor([k + [0] * (last - len(k)) for k in kept], dtype=torch.long,
                                 device=self._valid.device).reshape(len(kept), last)
        if last == 1 and all(counts):  # every row keeps one slot (a plain step)
            new = torch.ones(len(counts), 1, dtype=torch.bool, device=self._valid.device)
        else:
            new = torch.tensor([[j < c for j in range(last)] for c in counts], dtype=torch.bool,
                               device=self._valid.device).reshape(len(counts), last)
        self._append(order, new, width, max(after, default=0))
        self._host_num_valid = after

    def _append(self, order: torch.Tensor | None, new: torch.Tensor, width: int, longest: int) -> None:
        """The rest of a commit: move kept slots first (``order`` ``[batch, new width]``: the new slot each
        kept column takes, into the ``width`` appended ones), crop to ``new``'s width, extend the table."""
        if order is not None:
            self._regather(order, start=self.num_slots)
        if new.shape[1] < width:
            self.cache.crop(-(width - new.shape[1]))
        self.valid = torch.cat([self._valid, new], dim=1)
        if self.cache.get_seq_length() != self.num_slots:
            raise RuntimeError(
                f"KV cache length {self.cache.get_seq_length()} out of sync with {self.num_slots} tracked slots."
            )
        if self._holes_worth_compacting(longest):
            self.compact()

    def _regather(self, index: torch.Tensor, start: int = 0) -> None:
        """Per row, write slots ``start + index`` of every layer to slots ``start .. start + n`` (``index:
        [batch, n]``). With ``start`` (a commit) the slots past ``start + n`` are left as they are, for the
        caller to crop; from slot 0 (a compaction) the layers are cut to ``n`` slots."""
        for layer in self.cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            idx = index[:, None, :, None].to(layer.keys.device)
            for name in ("keys", "values"):
                t = getattr(layer, name)
                picked = t[:, :, start:].gather(2, idx.expand(-1, t.shape[1], -1, t.shape[-1]))
                if start:
                    t[:, :, start: start + picked.shape[2]] = picked  # in place (static addresses survive)
                elif picked.shape[2] == t.shape[2]:
                    t.copy_(picked)
                else:
                    setattr(layer, name, picked)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (finished rows are dropped from the work)."""
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]

    def _holes_worth_compacting(self, longest: int | None = None) -> bool:
        """``longest``: the longest row's valid slots, when the caller has read it already."""
        if longest is None:
            longest = max(self.host_num_valid(), default=0)
        return self.num_slots - longest > max(self.compact_min_holes, self.compact_ratio * longest)

    def compact_if_worth_it(self) -> None:
        """:meth:`compact` when the holes are worth it (the rule a commit applies): for a cache that is cut back
        by other means than :meth:`commit` (a drafter's own cache at the end of a step)."""
        if self._holes_worth_compacting():
            self.compact()

    def compact(self) -> None:
        """Move each row's valid slots to the right end of the cache (order kept), dropping holes."""
        longest = max(self.host_num_valid(), default=0)
        if longest == self.num_slots:
            return
        order = torch.arange(self.num_slots, device=self.valid.device)
        # Sort key puts holes first and valid slots last, each group in original order.
        key = self.valid.long() * self.num_slots + order
        index = key.argsort(dim=1)[:, -longest:]  # [batch, longest]
        self._regather(index)
        self.valid = self.valid.gather(1, index)
        self.num_compactions += 1
