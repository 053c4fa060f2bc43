"""N-gram pools: continuations keyed by their first token, least-recently-used first out.

Fed by lookahead windows and by Jacobi Forcing's rejection recycling; read by the
verification branch, which looks up the row's last committed token. One pool per original batch
row; a pool lives for the whole ``generate`` call (it survives block boundaries).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

__all__ = ["NgramPool"]

_WORD = array("q").itemsize  # bytes per stored token


class NgramPool:
    """Per-row maps ``first token -> up to max_per_key continuations`` (:meth:`get` gives tuples of tokens).

    A key's continuations are a plain list, least recently used first: with a handful per key, a
    list's equality scan is cheaper than hashing them into an ordered dict. Each continuation is
    stored as the bytes of its int64 tokens: a window of a chain is then one ``memcpy``-like slice of
    the chain's bytes and compares with ``memcmp``, where a tuple slice touches every token object
    (rejection recycling inserts every window of a 64-token chain per row per step: 2x faster).
    """

    def __init__(self, batch_size: int, max_per_key: int):
        self.max_per_key = max_per_key
        self._pools: list[dict[int, list[bytes]]] = [{} for _ in range(batch_size)]

    def add(self, row: int, key: int, continuation: Sequence[int]) -> None:
        """Insert (or refresh) ``continuation`` under ``key``; evict the least recently used beyond the cap."""
        if self.max_per_key <= 0 or not continuation:
            return
        self.add_windows(row, (int(key), *(int(t) for t in continuation)), len(continuation) + 1, stop=1)

    def add_sequence(self, row: int, tokens: Sequence[int], n: int) -> None:
        """Insert every n-gram of ``tokens`` (key = its first token, continuation = the other n - 1)."""
        if n >= 2 and len(tokens) >= n:  # a 1-gram has no continuation to store
            self.add_windows(row, [int(t) for t in tokens], n, stop=len(tokens) - n + 1)

    def add_windows(self, row: int, tokens: Sequence[int], n: int, start: int = 0, stop: int | None = None) -> None:
        """``add(row, tokens[j], tokens[j + 1 : j + n])`` for every ``start <= j < stop`` (default: every ``j``
        with a non-empty continuation), in order (tail windows are shorter). ``tokens`` must hold Python ints;
        this is the per-step hot path of rejection recycling, so it avoids per-token conversions and calls."""
        if self.max_per_key <= 0:
            return
        pool, cap = self._pools[row], self.max_per_key
        seq = tokens if isinstance(tokens, list) else list(tokens)
        raw = array("q", seq).tobytes()
        for j in range(start, len(seq) - 1 if stop is None else stop):
            cont = raw[_WORD * (j + 1): _WORD * (j + n)]
            entries = pool.get(seq[j])
            if entries is None:
                pool[seq[j]] = [cont]
                continue
            if cont in entries:
                entries.remove(cont)
            entries.append(cont)
            if len(entries) > cap:
                del entries[0]

    def get(self, row: int, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """Continuations stored under ``key``, most recently used first."""
        entries = self._pools[row].get(int(key))
        if not entries:
            return []
        out = entries[::-1] if limit is None else entries[: -limit - 1: -1]
        return [tuple(array("q", cont)) for cont in out]

    def size(self, row: int) -> int:
        return sum(len(v) for v in self._pools[row].values())
