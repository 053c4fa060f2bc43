"""Committed tokens per row and their emission in the exact order stock generation produces them.

What it is for
    Rows of a parallel decoder commit several tokens per forward and run at different speeds.
    Stock greedy/sample decoding advances every row by one token per step, pads rows that have
    finished (when an EOS criterion is present), calls the stopping criteria on the whole batch
    after each step and hands each step's tokens to the streamer. :class:`CommitLog` stores what
    each row has committed and *emits* step ``t`` as soon as every unfinished row has committed
    its ``t``-th token (every row's, finished ones included, when there is no EOS to pad with), so
    the output tensor, the finished-row padding, the stopping-criteria calls and the streamer see
    exactly what stock generation would have produced.

What it deliberately does not know
    How tokens were proposed or verified; it only records what a strategy commits.
"""

from __future__ import annotations

import torch

from ..compat import EosTokenCriteria, MaxLengthCriteria, eos_token_tensor, pad_token_tensor

__all__ = ["CommitLog"]


class CommitLog:
    """Committed tokens of every (original) row plus the lock-step emission state.

    Shapes: ``tokens`` ``[batch, max_new_tokens]``, ``count`` ``[batch]`` (committed per row),
    ``sequences`` ``[batch, prompt_len + emitted]``.

    The bookkeeping lives in host lists (a step commits a handful of tokens per row, and on a CPU
    each small tensor operation costs microseconds); ``tokens``, ``count``, ``first_eos``,
    ``unfinished``, ``finished_at`` and ``forwards_per_row`` are tensors built from them when read,
    once per change. With only length / EOS stopping criteria (what ``generate`` builds unless the
    user adds their own), emission decides on the host too and calls no criterion per token.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,  # [batch, prompt_len], left padded
        generation_config,
        stopping_criteria,
        streamer=None,
        prompt_streamed: bool = False,  # the streamer already has the prompt (generate put it there)
        output_scores: bool = False,
        output_logits: bool = False,
    ):
        batch, prompt_len = input_ids.shape
        self.max_new_tokens = max(int(generation_config.max_length) - prompt_len, 0)
        pad = pad_token_tensor(generation_config)
        self.pad_token_id = int(pad) if pad is not None else None
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.has_eos_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        eos = eos_token_tensor(generation_config)
        self.eos_ids = eos.reshape(-1).to(input_ids.device) if (eos is not None and self.has_eos_criteria) else None
        if self.has_eos_criteria and self.pad_token_id is None:
            raise ValueError("`pad_token_id` must be set when `eos_token_id` is, to pad rows that finished early.")
        self.device = input_ids.device
        self.prompt_len = prompt_len
        self._sequences = input_ids
        self._pending: list[list[int]] = []  # emitted steps decided on the host, not yet in the sequences tensor
        self.emitted = 0
        # host state (the truth); tensors are built from it on demand (see _tensor)
        self._rows = [[] for _ in range(batch)]  # committed tokens per row
        self._count = [0] * batch
        self._first_eos = [self.max_new_tokens] * batch
        self._unfinished = [True] * batch
        self._finished_at = [self.max_new_tokens] * batch
        self._forwards = [0] * batch
        self._tensors: dict[str, torch.Tensor] = {}
        self._eos_set = set(self.eos_ids.tolist()) if self.eos_ids is not None else None
        # emission can decide on the host when the criteria are exactly transformers' length / EOS ones (with the
        # EOS ids known here); a score-reading criterion is another kind, so scores never matter to them
        self._host_criteria = {type(c) for c in stopping_criteria} <= {MaxLengthCriteria, EosTokenCriteria} and all(
            set(c.eos_token_id.reshape(-1).tolist()) == self._eos_set
            for c in stopping_criteria if type(c) is EosTokenCriteria)
        self._max_length = min((c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria), default=None)
        self.scores: list[torch.Tensor] | None = [] if output_scores else None
        self.logits: list[torch.Tensor] | None = [] if output_logits else None
        self._score_buf = self._logit_buf = None
        if streamer is not None and not prompt_streamed:
            streamer.put(input_ids.cpu())

    # ---- tensors built from the host state -------------------------------------------------------
    def _tensor(self, name: str, build) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = build()
        return t

    def _long(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @property
    def tokens(self) -> torch.Tensor:
        """``[batch, max_new_tokens]`` committed tokens (row ``r``'s first ``count[r]`` are valid, the rest 0)."""
        width = self.max_new_tokens
        return self._tensor("tokens", lambda: self._long([row + [0] * (width - len(row)) for row in self._rows])
                            .reshape(len(self._rows), width))

    @property
    def count(self) -> torch.Tensor:
        return self._tensor("count", lambda: self._long(self._count))

    def mean_remaining(self, rows: list[int]) -> float:
        """The mean of ``rows``' new tokens still allowed (``max_new_tokens`` minus what each has committed)."""
        return self.max_new_tokens - sum(self._count[r] for r in rows) / max(len(rows), 1)

    @property
    def first_eos(self) -> torch.Tensor:
        return self._tensor("first_eos", lambda: self._long(self._first_eos))

    @property
    def unfinished(self) -> torch.Tensor:
        return self._tensor("unfinished", lambda: torch.tensor(self._unfinished, dtype=torch.bool, device=self.device))

    @property
    def finished_at(self) -> torch.Tensor:
        return self._tensor("finished_at", lambda: self._long(self._finished_at))

    @property
    def forwards_per_row(self) -> torch.Tensor:
        return self._tensor("forwards_per_row", lambda: self._long(self._forwards))

    def host_counts(self, rows: list[int]) -> list[int]:
        """Committed tokens of ``rows`` (original ids), as host ints."""
        return [self._count[r] for r in rows]

    def last_token(self, row: int) -> int:
        """Row ``row``'s last committed token (the root of its next tree), a host int."""
        return self._rows[row][-1]

    def host_tokens(self, row: int) -> list[int]:
        """Row ``row``'s committed tokens, as a host list (do not modify)."""
        return self._rows[row]

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def add(
        self,
        rows: torch.Tensor,  # [active] original row ids
        new_tokens: torch.Tensor,  # [active, width]
        num_new: torch.Tensor,  # [active] how many of new_tokens each row commits (a prefix)
        scores: torch.Tensor | None = None,  # [active, width, vocab] processed scores of new_tokens
        logits: torch.Tensor | None = None,  # [active, width, vocab] raw logits of new_tokens
        host: tuple[list[int], list[list[int]], list[int]] | None = None,  # (rows, new_tokens, num_new) as lists
    ) -> None:
        """Commit ``new_tokens[i, :num_new[i]]`` to row ``rows[i]`` (one target forward for those rows).

        ``host``: the same three as host lists when the caller has them (then no tensor is read back)."""
        rows_l, tokens_l, num_l = host if host is not None else (rows.tolist(), new_tokens.tolist(), num_new.tolist())
        starts, taken = [], []
        for r, toks, n in zip(rows_l, tokens_l, num_l):
            start = self._count[r]
            n = max(min(n, self.max_new_tokens - start), 0)
            starts.append(start)
            taken.append(n)
            kept = toks[:n]
            self._rows[r].extend(kept)
            if self._eos_set is not None and self._first_eos[r] == self.max_new_tokens:
                first = next((k for k, t in enumerate(kept) if t in self._eos_set), None)
                if first is not None:
                    self._first_eos[r] = start + first
            self._count[r] = start + n
            self._forwards[r] += 1
        self._tensors.clear()
        if scores is not None or logits is not None:
            width = new_tokens.shape[1]
            start = self._long(starts)
            cols = torch.arange(width, device=new_tokens.device)
            take = cols[None, :] < self._long(taken)[:, None]  # [active, width]
            pos = start[:, None] + cols[None, :]
            row_idx = rows[:, None].expand_as(pos)
            self._buffer("_score_buf", self.scores, scores, row_idx, pos, take)
            self._buffer("_logit_buf", self.logits, logits, row_idx, pos, take)

    def _buffer(self, name, requested, values, row_idx, pos, take):
        if requested is None or values is None:
            return
        buf = getattr(self, name)
        need = int(pos[take].max()) + 1 if bool(take.any()) else 0
        if buf is None or buf.shape[1] < need:  # grown by doubling: never sized for max_new_tokens up front
            old = buf.shape[1] if buf is not None else 0
            grown = values.new_zeros(self.batch_size, min(self.max_new_tokens, max(need, 2 * old, 16)), values.shape[-1])
            if buf is not None:
                grown[:, :old] = buf
            buf = grown
            setattr(self, name, buf)
        buf[row_idx[take], pos[take]] = values[take]

    def host_needs_work(self) -> list[bool]:
        """Per row: whether its continuation can still appear in the output."""
        m = self.max_new_tokens
        if not self.has_eos_criteria:
            # Stock keeps generating real tokens for finished rows until every row has finished.
            going = any(self._unfinished)
            return [going and c < m for c in self._count]
        return [u and c < m and e >= c for u, c, e in zip(self._unfinished, self._count, self._first_eos)]

    def _ready(self) -> int:
        """Steps every row still writing has committed (all rows' without an EOS criterion)."""
        counts = [c for c, u in zip(self._count, self._unfinished) if u or not self.has_eos_criteria]
        return min(min(counts, default=self.max_new_tokens), self.max_new_tokens)

    def emit(self) -> None:
        """Emit every step that every row still writing has committed; update ``unfinished``.

        With transformers' own length / EOS criteria the stops are decided on the host lists and the
        sequences grow once per call; any other criterion is called per step on the sequences so far, as
        stock does."""
        on_host = self._host_criteria
        steps = []  # emitted this call, not yet in `sequences` (host decisions only)
        while any(self._unfinished) and self.emitted < self.max_new_tokens:
            t = self.emitted
            # with an EOS criterion a finished row's step is padding; without one stock keeps writing the
            # row's real tokens, so every row must have committed step t
            if self._ready() <= t:
                break
            step = self._step(t)
            if self.scores is not None:
                self.scores.append(self._emitted_values(self._score_buf, t))
            if self.logits is not None:
                self.logits.append(self._emitted_values(self._logit_buf, t))
            if self.streamer is not None:
                self.streamer.put(self._long(step).cpu())
            if on_host:
                steps.append(step)
                stopped = self._host_stops(step, t)
            else:
                self.sequences = torch.cat([self.sequences, self._long(step)[:, None]], dim=-1)
                # like stock: the criteria get the tuple of every step's scores when they are kept, else None
                all_scores = tuple(self.scores) if self.scores is not None else None
                stopped = (self.unfinished & self.stopping_criteria(self.sequences, all_scores)).tolist()
            self._stop(stopped, t)
            self.emitted += 1
        if steps:  # the tensor is built when read (the output, a criterion): no copy to the device per step
            self._pending.extend(steps)
            for c in self.stopping_criteria:  # the length criterion's warning past max_position_embeddings
                if type(c) is MaxLengthCriteria and c.max_position_embeddings is not None and \
                        self.prompt_len + self.emitted > c.max_position_embeddings:
                    c(self.sequences, None)

    @property
    def sequences(self) -> torch.Tensor:
        """``[batch, prompt_len + emitted]``: the prompt and every emitted step (finished rows padded)."""
        if self._pending:
            steps = self._long(self._pending).reshape(len(self._pending), -1).T
            self._sequences = torch.cat([self._sequences, steps], dim=-1)
            self._pending = []
        return self._sequences

    @sequences.setter
    def sequences(self, value: torch.Tensor) -> None:
        self._pending = []
        self._sequences = value

    def _emitted_values(self, buf: torch.Tensor | None, t: int) -> torch.Tensor | None:
        """Step ``t``'s scores / logits ``[batch, vocab]``: a row that had finished before step ``t`` (padding) holds
        zeros, whatever its strategy committed past its stop in the step that finished it."""
        if buf is None:
            return None
        values = buf[:, t]
        if self.has_eos_criteria and not all(self._unfinished):
            values = values * torch.tensor(self._unfinished, dtype=values.dtype, device=values.device)[:, None]
        return values

    def _host_stops(self, step: list[int], t: int) -> list[bool]:
        """The rows transformers' length / EOS criteria stop after step ``t`` (unfinished rows only)."""
        if self._max_length is not None and self.prompt_len + t + 1 >= self._max_length:
            return list(self._unfinished)
        if self._eos_set is not None:
            return [u and tok in self._eos_set for u, tok in zip(self._unfinished, step)]
        return [False] * len(step)

    def _step(self, t: int) -> list[int]:
        """Step ``t``'s token of every row (a finished row's is padding when there is an EOS criterion)."""
        if self.has_eos_criteria:
            return [row[t] if u else self.pad_token_id for row, u in zip(self._rows, self._unfinished)]
        return [row[t] for row in self._rows]

    def _stop(self, stopped: list[bool], t: int) -> None:
        if any(stopped):
            for r, s in enumerate(stopped):
                if s:
                    self._finished_at[r] = t + 1
                    self._unfinished[r] = False
            self._tensors.clear()

    @property
    def done(self) -> bool:
        return not any(self._unfinished) or self.emitted >= self.max_new_tokens

    def finish(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def useful_tokens(self) -> torch.Tensor:
        """``[batch]`` tokens each row generated up to the step that finished it (what TPF counts)."""
        return self._long([min(c, f, self.emitted) for c, f in zip(self._count, self._finished_at)])
