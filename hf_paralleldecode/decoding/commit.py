"""Committed tokens per row and their emission in the exact order stock ``_sample`` produces them.

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

__all__ = ["CommitLog"]


class CommitLog:
    """Committed tokens of every (original) row plus the lock-step emission state.

    Shapes: ``tokens`` ``[batch, max_new_tokens]``, ``count`` ``[batch]`` (committed per row),
    ``sequences`` ``[batch, prompt_len + emitted]``.
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
        pad = generation_config._pad_token_tensor
        self.pad_token_id = int(pad) if pad is not None else None
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.has_eos_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        eos = generation_config._eos_token_tensor
        self.eos_ids = eos.reshape(-1).to(input_ids.device) if (eos is not None and self.has_eos_criteria) else None
        if self.has_eos_criteria and self.pad_token_id is None:
            raise ValueError("`pad_token_id` must be set when `eos_token_id` is, to pad rows that finished early.")
        device = input_ids.device
        self.sequences = input_ids
        # committed tokens; the columns past max_new_tokens take the uncommitted tail of each write
        self._token_buf = torch.zeros(batch, self.max_new_tokens + 64, dtype=torch.long, device=device)
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.first_eos = torch.full((batch,), self.max_new_tokens, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.finished_at = torch.full((batch,), self.max_new_tokens, dtype=torch.long, device=device)
        self.emitted = 0
        self.forwards_per_row = torch.zeros(batch, dtype=torch.long, device=device)
        self.scores: list[torch.Tensor] | None = [] if output_scores else None
        self.logits: list[torch.Tensor] | None = [] if output_logits else None
        self._score_buf = self._logit_buf = None
        if streamer is not None and not prompt_streamed:
            streamer.put(input_ids.cpu())

    @property
    def tokens(self) -> torch.Tensor:
        """``[batch, max_new_tokens]`` committed tokens (row ``r``'s first ``count[r]`` are valid)."""
        return self._token_buf[:, : self.max_new_tokens]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def add(
        self,
        rows: torch.Tensor,  # [active] original row ids
        new_tokens: torch.Tensor,  # [active, width]
        num_new: torch.Tensor,  # [active] how many of new_tokens each row commits (a prefix)
        scores: torch.Tensor | None = None,  # [active, width, vocab] processed scores of new_tokens
        logits: torch.Tensor | None = None,  # [active, width, vocab] raw logits of new_tokens
    ) -> None:
        """Commit ``new_tokens[i, :num_new[i]]`` to row ``rows[i]`` (one target forward for those rows)."""
        width = new_tokens.shape[1]
        start = self.count[rows]
        num_new = torch.minimum(num_new, self.max_new_tokens - start)
        cols = torch.arange(width, device=new_tokens.device)
        take = cols[None, :] < num_new[:, None]  # [active, width]
        pos = start[:, None] + cols[None, :]
        row_idx = rows[:, None].expand_as(pos)
        if self._token_buf.shape[1] < self.max_new_tokens + width:
            spare = self._token_buf.new_zeros(self._token_buf.shape[0], self.max_new_tokens + width - self._token_buf.shape[1])
            self._token_buf = torch.cat([self._token_buf, spare], dim=1)
        # one write without a host sync: tokens not taken land in the spare columns (distinct per column)
        self._token_buf[row_idx, torch.where(take, pos, self.max_new_tokens + cols)] = new_tokens
        self._buffer("_score_buf", self.scores, scores, row_idx, pos, take)
        self._buffer("_logit_buf", self.logits, logits, row_idx, pos, take)
        if self.eos_ids is not None:
            is_eos = torch.isin(new_tokens, self.eos_ids) & take
            first = torch.where(is_eos.any(1), start + is_eos.int().argmax(1), self.max_new_tokens)
            self.first_eos[rows] = torch.minimum(self.first_eos[rows], first)
        self.count[rows] = start + num_new
        self.forwards_per_row[rows] += 1

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

    def needs_work(self) -> torch.Tensor:
        """``[batch]`` bool: rows whose continuation can still appear in the output."""
        room = self.count < self.max_new_tokens
        if not self.has_eos_criteria:
            # Stock keeps generating real tokens for finished rows until every row has finished.
            return room & self.unfinished.any()
        return room & self.unfinished & (self.first_eos >= self.count)

    def emit(self) -> None:
        """Emit every step that every row still writing has committed; update ``unfinished``."""
        while self.unfinished.any() and self.emitted < self.max_new_tokens:
            t = self.emitted
            # with an EOS criterion a finished row's step is padding; without one stock keeps writing the
            # row's real tokens, so every row must have committed step t
            waiting = self.count <= t
            if self.has_eos_criteria:
                waiting &= self.unfinished
            if bool(waiting.any()):
                return
            step = self.tokens[:, t]
            if self.has_eos_criteria:
                step = torch.where(self.unfinished, step, self.pad_token_id)
            self.sequences = torch.cat([self.sequences, step[:, None]], dim=-1)
            step_scores = self._score_buf[:, t] if self._score_buf is not None else None
            if self.scores is not None:
                self.scores.append(step_scores)
            if self.logits is not None:
                self.logits.append(self._logit_buf[:, t])
            if self.streamer is not None:
                self.streamer.put(step.cpu())
            # like stock: the criteria get the tuple of every step's scores when they are kept, else None
            all_scores = tuple(self.scores) if self.scores is not None else None
            stopped = self.unfinished & self.stopping_criteria(self.sequences, all_scores)
            self.finished_at[stopped] = t + 1
            self.unfinished &= ~stopped
            self.emitted += 1

    @property
    def done(self) -> bool:
        return not bool(self.unfinished.any()) or self.emitted >= self.max_new_tokens

    def finish(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def useful_tokens(self) -> torch.Tensor:
        """``[batch]`` tokens each row generated up to the step that finished it (what TPF counts)."""
        return torch.minimum(self.count, torch.minimum(self.finished_at, torch.tensor(self.emitted)))
