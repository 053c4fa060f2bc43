"""This library's token-level drafters as vLLM proposers (vLLM's ``custom_class`` speculative method).

    from vllm import LLM
    llm = LLM(model=TARGET, speculative_config={
        "method": "custom_class", "model": "hf_paralleldecode.serving.vllm.ContextProposer",
        "num_speculative_tokens": 8})

vLLM (0.32 CPU build, 0.33) imports the class, builds it with its ``VllmConfig`` and, every step, calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``: per batch slot, the tokens
sampled this step (empty for a request still in prefill), the request's token count and its tokens. It expects one
draft chain per slot (a list of token ids, possibly empty) and verifies the chains itself, so output stays vLLM's
own greedy output (and its sampling distribution). Trees do not reach vLLM: a proposer that drafts several
continuations here hands over one chain, the one most of them share.

Settings are class attributes (vLLM passes only the class path): subclass in a module of your own to change them,
and name that class in ``speculative_config``.

Proposers
    * :class:`ContextProposer`: multi-match context n-grams (``decoding="prompt_lookup"`` and the context part of
      the embedded models' default decoding) — up to ``max_matches`` continuations of the request's suffix found in
      its own prompt and output, merged into the chain most of them agree on.
    * :class:`DeerProposer`: a DEER diffusion drafter (a folder, a shipped alias, or the drafter a bundle's
      ``parallel_decoding_config.json`` names), one denoising forward per step for every drafting request.
Per-request state (the n-gram index, the drafter's cache) is kept across steps by content
(:mod:`.requests`): vLLM's hook hands no request ids, and slots move as requests finish or are preempted.
"""

from __future__ import annotations

import numpy as np

from ..decoding.prompt_lookup import NgramIndex
from .requests import Entry, RequestStates

__all__ = ["TokenProposer", "ContextProposer"]


class TokenProposer:
    """What vLLM's ``custom_class`` hook asks of a proposer, for drafters that read tokens only.

    A subclass implements :meth:`new_state` (the state of a request never seen) and :meth:`draft_rows` (advance
    each drafting request's state to its tokens and return its chain)."""

    #: draft nothing in a step where more requests than this are decoding (vLLM then runs plain steps): under load a
    #: wider verification costs more than the accepted tokens save. ``None``: always draft.
    max_requests: int | None = None
    #: steps a request may go unseen before its state is dropped (it finished)
    max_idle_steps: int = 64

    def __init__(self, vllm_config):
        spec = getattr(vllm_config, "speculative_config", None)
        k = getattr(spec, "num_speculative_tokens", None)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"{type(self).__name__} needs speculative_config['num_speculative_tokens'] >= 1 (the "
                             f"longest chain it drafts); got {k!r}.")
        if self.max_requests is not None and (not isinstance(self.max_requests, int) or self.max_requests < 1):
            raise ValueError(f"{type(self).__name__}.max_requests must be None or an integer >= 1, got "
                             f"{self.max_requests!r}.")
        self.k = k
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vllm_config = vllm_config
        self.requests = RequestStates(self.new_state, max_idle_steps=self.max_idle_steps)
        self.steps = 0  # propose() calls
        self.drafting_steps = 0  # calls that drafted for at least one request
        self.drafted_tokens = 0

    def load_model(self, *args, **kwargs) -> None:
        """vLLM hands over its target model here; a token-level proposer reads nothing of it."""

    def new_state(self, tokens: np.ndarray):  # pragma: no cover - interface
        raise NotImplementedError

    def draft_rows(self, rows: list[tuple[Entry, np.ndarray, int]]) -> list[list[int]]:  # pragma: no cover
        """For each ``(entry, tokens, k)``: advance ``entry.state`` to ``tokens`` and return at most ``k`` draft ids."""
        raise NotImplementedError

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs) -> list[list[int]]:
        """One draft chain per batch slot (vLLM's hook; see the module docstring)."""
        self.steps += 1
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = [i for i, sampled in enumerate(sampled_token_ids)
                if len(sampled) and int(num_tokens_no_spec[i]) < self.max_model_len]
        if rows and (self.max_requests is None or len(rows) <= self.max_requests):
            work, held = [], {}  # id(entry) -> the tokens of the row holding it this step
            for i in rows:
                tokens = np.asarray(token_ids_cpu[i, : int(num_tokens_no_spec[i])])
                entry = self.requests.lookup(tokens)
                if id(entry) in held and not np.array_equal(held[id(entry)], tokens):
                    entry = self.requests.lookup(tokens, fresh=True)  # two streams that share a start: one state each
                held[id(entry)] = tokens
                work.append((entry, tokens, min(self.k, self.max_model_len - tokens.shape[0])))
            for i, (entry, tokens, _), chain in zip(rows, work, self.draft_rows(work)):
                self.requests.seen(entry, tokens)
                out[i] = [int(t) for t in chain]
                self.drafted_tokens += len(out[i])
            self.drafting_steps += 1
        self.requests.end_step()
        return out


class ContextProposer(TokenProposer):
    """Multi-match context n-grams as a vLLM proposer (see the module docstring)."""

    #: longest suffix n-gram looked up (``context_ngram_size``)
    ngram_size: int = 3
    #: continuations merged per step (``context_matches`` / prompt lookup's ``max_matches``)
    max_matches: int = 4

    def new_state(self, tokens: np.ndarray) -> NgramIndex:
        return NgramIndex([], self.ngram_size)

    def draft_rows(self, rows):
        out = []
        for entry, tokens, k in rows:
            index = entry.state
            index.extend(tokens[len(index.tokens):].tolist())
            out.append(index.chain(k, self.max_matches))
        return out
