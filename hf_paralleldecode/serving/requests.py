"""Per-request state for a serving engine's proposer hook, kept across steps without request ids.

vLLM's ``custom_class`` hook calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` each step:
row ``i`` is whichever request sits in batch slot ``i`` now, and slots are reordered as requests finish, are
preempted or join. No request id is handed over. A proposer that keeps state per request (an n-gram index, a
drafter's cache) therefore finds it by content: :class:`RequestStates` keeps one entry per token stream, and a
row takes the entry whose tokens are the longest prefix of the row's tokens (a request's tokens only grow, so its
entry always is one). A preempted request that comes back with the same tokens finds its entry again; a request
that is gone stops being looked up, and its entry is dropped after ``max_idle_steps`` steps; two requests with the
same tokens share an entry for as long as their tokens agree (the state depends on the tokens alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["RequestStates", "Entry"]

#: tokens of a stream's start used as the lookup key (the full prefix is compared before an entry is used)
KEY_TOKENS = 8


class Entry:
    """One token stream's state: the tokens the state has seen (``tokens``, a host array) and the state itself."""

    __slots__ = ("tokens", "state", "last_step", "last_use")

    def __init__(self, tokens: np.ndarray, state: Any, step: int):
        self.tokens, self.state, self.last_step, self.last_use = tokens, state, step, 0


class RequestStates:
    """Entries by content (see the module docstring).

    ``new_state(tokens)`` makes the state of a stream never seen; the caller advances it to the row's tokens and
    records them with :meth:`seen`. ``max_entries`` caps the entries kept (the least recently used go first)."""

    def __init__(self, new_state: Callable[[np.ndarray], Any], max_idle_steps: int = 64, max_entries: int = 4096):
        if max_idle_steps < 1 or max_entries < 1:
            raise ValueError("RequestStates needs max_idle_steps >= 1 and max_entries >= 1.")
        self.new_state = new_state
        self.max_idle_steps, self.max_entries = max_idle_steps, max_entries
        self._by_key: dict[tuple[int, ...], list[Entry]] = {}
        self.step = 0
        self._uses = 0  # lookups so far: the recency order of the entries
        self.created = 0  # entries made (a request seen for the first time, or one whose tokens diverged)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def lookup(self, tokens: np.ndarray, fresh: bool = False) -> Entry:
        """The entry whose tokens are the longest prefix of ``tokens`` (a 1-D int array), or a new one (always a new
        one with ``fresh``: a row whose entry another row with other tokens already holds this step)."""
        key = tuple(int(t) for t in tokens[:KEY_TOKENS])
        best = None
        for entry in () if fresh else self._by_key.get(key, ()):
            n = entry.tokens.shape[0]
            if n <= tokens.shape[0] and (best is None or n > best.tokens.shape[0]) and \
                    np.array_equal(entry.tokens, tokens[:n]):
                best = entry
        if best is None:
            best = Entry(tokens[:0].copy(), self.new_state(tokens), self.step)
            self._by_key.setdefault(key, []).append(best)
            self.created += 1
        self._uses += 1
        best.last_step, best.last_use = self.step, self._uses
        return best

    @staticmethod
    def seen(entry: Entry, tokens: np.ndarray) -> None:
        """Record that ``entry``'s state now reflects ``tokens``."""
        entry.tokens = np.array(tokens, copy=True)

    def end_step(self) -> None:
        """Drop the entries of requests not seen for ``max_idle_steps`` steps (finished ones), and the oldest beyond
        ``max_entries``."""
        self.step += 1
        oldest = self.step - self.max_idle_steps
        entries = []
        for key in list(self._by_key):
            kept = [e for e in self._by_key[key] if e.last_step >= oldest]
            if kept:
                self._by_key[key] = kept
                entries.extend(kept)
            else:
                del self._by_key[key]
        if len(entries) > self.max_entries:
            cut = sorted(e.last_use for e in entries)[len(entries) - self.max_entries]
            for key in list(self._by_key):
                self._by_key[key] = [e for e in self._by_key[key] if e.last_use >= cut]
                if not self._by_key[key]:
                    del self._by_key[key]
