"""The DEER drafter's side of a speculative run: its block forward(s) and its cache of committed tokens.

Per step (``decoding/speculative.py`` grows the tree and verifies it)
    :meth:`DiffusionSource.marginals` gives ``[active, k, V]`` draft logits for depths ``1..k``
    after each row's last committed token (the *anchor*), from one denoising forward of the
    drafter over ``[committed..., boundary?, MASK x k]`` (:class:`~..drafters.DiffusionDrafter`);
    ``k`` is the tree's depth (``tree_depth``, at most the drafter's ``block_size``).
    * ``block_causal`` drafters keep the committed tokens' keys/values in their own
      :class:`~.cache.SlotCache`: a step feeds only the tokens committed since the last step
      (left-padded per row, causal among themselves) plus the block (bidirectional, seeing the
      whole prefix); the block's slots are cut off afterwards. The first step feeds the prompt.
    * ``bidirectional`` drafters have no cache (every prefix token sees the block): a step feeds
      the last ``context_window`` committed tokens of each row plus the block, right-padded.
    * ``denoise_steps > 1``: each further forward re-feeds the block with the most confident
      masked positions filled by their argmax (LLaDA's low-confidence remasking, deterministic);
      a position's ``q`` is the distribution it was unmasked from. Given the drafter's own
      (deterministic) choices these are fixed distributions, so the tree drawn from them is
      verified exactly as a one-step draft: lossless with rejection sampling.
    :meth:`DiffusionSource.update` queues the newly committed tokens (accepted drafts + the bonus).

What it deliberately does not know
    Trees, processors, verification.
"""

from __future__ import annotations

import time

import torch

from ..compat import DynamicCache
from .cache import SlotCache

__all__ = ["DiffusionSource"]


class DiffusionSource:
    """Draft marginals from a :class:`~hf_paralleldecode.DiffusionDrafter` for the active rows of ``run``."""

    kind = "marginals"

    def __init__(self, run, drafter, vocab: int, depth: int | None = None, steps: int | None = None):
        self.run, self.drafter, self.vocab = run, drafter, vocab
        c = drafter.config
        self.causal = c.attention == "block_causal"
        device = run.rows.device
        depth = c.block_size if depth is None else depth  # masks fed per step: the tree's depth
        self.block = torch.tensor(drafter.block_ids(depth), dtype=torch.long, device=device)  # [L]
        self.query = drafter.query_index(depth).to(device)  # [k] into [anchor] + block
        self.first_mask = 1 + (c.boundary_token_id is not None)  # index of mask 1 in [anchor] + block
        self.steps = min(steps or c.denoise_steps, depth)
        self.forwards, self.seconds = 0, 0.0
        self.fed_tokens = 0  # drafter input slots, summed over forwards (the bidirectional cost)
        if self.causal:
            b = run.rows.shape[0]
            self.slots = SlotCache(DynamicCache(), torch.zeros(b, 0, dtype=torch.bool, device=device), drafter.dtype)
            roots = run.log.tokens[run.rows, 0]
            self.pending = (  # the prompt (left-padded) and the first committed token, not yet fed
                torch.cat([run.prompt[run.rows], roots[:, None]], dim=1),
                torch.cat([run.prompt_positions[run.rows], run.next_positions()[:, None]], dim=1),
                torch.cat([run.prompt_mask[run.rows], torch.ones_like(roots[:, None], dtype=torch.bool)], dim=1),
            )

    # ---- forwards -------------------------------------------------------------------------------
    def _call(self, **kwargs) -> torch.Tensor:
        device = self.drafter.device
        t0 = time.perf_counter()
        logits = self.drafter(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - t0
        self.forwards += 1
        self.fed_tokens += int(kwargs["input_ids"].numel())
        return logits.to(self.run.rows.device)

    def _causal_forward(self, block: torch.Tensor, root_pos: torch.Tensor, first: bool) -> torch.Tensor:
        """``[b, 1 + L, Vd]`` logits of ``[anchor] + block``; the first forward of a step also feeds the queue."""
        b, L = block.shape
        device = block.device
        block_pos = root_pos[:, None] + 1 + torch.arange(L, device=device)
        if first:
            ids, pos, valid = self.pending
            m = ids.shape[1]
            eye = torch.eye(m, dtype=torch.bool, device=device)
            causal = torch.ones(m, m, dtype=torch.bool, device=device).tril()
            top = torch.cat([(causal & valid[:, None, :]) | eye, torch.zeros(b, m, L, dtype=torch.bool, device=device)],
                            dim=-1)
            bottom = torch.cat([valid[:, None, :].expand(b, L, m), torch.ones(b, L, L, dtype=torch.bool, device=device)],
                               dim=-1)
            intra = torch.cat([top, bottom], dim=1)
            ids, pos = torch.cat([ids, block], dim=1), torch.cat([pos, block_pos], dim=1)
        else:
            m, valid = 0, None
            intra = torch.ones(b, L, L, dtype=torch.bool, device=device)
            ids, pos = block, block_pos
        logits = self._call(input_ids=ids, attention_mask=self.slots.attention_mask(intra), position_ids=pos,
                            cache=self.slots.cache, logits_to_keep=L + (1 if first else 0))
        self.slots.cache.crop(-L)  # the block's slots never stay
        if first:
            self.slots.valid = torch.cat([self.slots.valid, valid], dim=1)
            self.pending = None
            self._anchor = logits[:, :1]
            return logits
        return torch.cat([self._anchor, logits], dim=1)

    def _window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each active row's last ``context_window`` committed tokens (prompt included), left-aligned:
        ``ids [b, w_max]`` and ``lengths [b]``."""
        run = self.run
        rows = run.rows
        plen = run.prompt_lengths[rows]
        total = plen + run.log.count[rows]
        w = total.clamp(max=self.drafter.context_window)
        j = torch.arange(int(w.max()), device=rows.device)
        virtual = (total - w)[:, None] + j  # index into [real prompt tokens, committed tokens]
        physical = torch.where(virtual < plen[:, None], virtual, run.prompt.shape[1] + virtual - plen[:, None])
        context = torch.cat([run.packed_prompt[rows], run.log.tokens[rows]], dim=1)
        return context.gather(1, physical.clamp(max=context.shape[1] - 1)), w

    def _bidirectional_forward(self, block: torch.Tensor) -> torch.Tensor:
        """``[b, 1 + L, Vd]`` logits of ``[anchor] + block`` from one forward over window + block (right-padded)."""
        window, w = self._window()
        b, L = block.shape
        device = block.device
        width = window.shape[1] + L
        cols = torch.arange(width, device=device)
        ids = torch.full((b, width), self.drafter.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, : window.shape[1]] = window
        ids.scatter_(1, w[:, None] + torch.arange(L, device=device), block)
        attention = (cols[None] < (w + L)[:, None]).long()
        logits = self._call(input_ids=ids, attention_mask=attention)
        at = (w - 1)[:, None] + torch.arange(L + 1, device=device)  # the anchor (last committed token) and the block
        return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))

    # ---- the step ----------------------------------------------------------------------------------
    def marginals(self, roots: torch.Tensor, root_pos: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[active, k, V]`` (fp32, the target's vocabulary) for depths ``1..k``."""
        b = roots.shape[0]
        block = self.block[None].expand(b, -1).clone()
        k = self.query.shape[0]
        masked = torch.ones(b, k, dtype=torch.bool, device=roots.device)
        out = None
        for s in range(self.steps):
            logits = self._causal_forward(block, root_pos, s == 0) if self.causal else self._bidirectional_forward(block)
            q = logits[:, self.query, : self.vocab].float()  # [b, k, V]
            out = q if out is None else torch.where(masked[..., None], q, out)
            if s == self.steps - 1:
                break
            left = int(masked[0].sum())  # every row has the same number of masked positions
            n = -(-left // (self.steps - s))  # ceil: the rest is spread over the remaining steps
            conf = q.amax(-1).masked_fill(~masked, float("-inf"))
            pick = conf.topk(n, dim=-1).indices  # [b, n] most confident masked depths
            masked.scatter_(1, pick, False)
            block.scatter_(1, pick + self.first_mask - 1, q.argmax(-1).gather(1, pick))
        return out

    def update(self, tree, verdict, root_pos: torch.Tensor) -> None:
        """Queue each row's newly committed tokens (accepted drafts + bonus) for the next forward."""
        if not self.causal:
            return  # the window is read from the commit log
        n = verdict.num_accepted + 1  # [b]
        m = int(n.max())
        cols = torch.arange(m, device=n.device)
        shift = (m - n)[:, None]
        idx = (cols[None] - shift).clamp(min=0)  # left-padded: the new anchor is always the last column
        self.pending = (verdict.tokens.gather(1, idx), root_pos[:, None] + 1 + idx, cols[None] >= shift)

    def end_step(self) -> None:
        if self.causal and self.slots._holes_worth_compacting():
            self.slots.compact()

    def select(self, kept: torch.Tensor) -> None:
        if self.causal:
            self.slots.select_rows(kept)
            if self.pending is not None:
                self.pending = tuple(t[kept] for t in self.pending)
