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
import torch

from ..decoding.prompt_lookup import NgramIndex
from .requests import Entry, RequestStates

__all__ = ["TokenProposer", "ContextProposer", "DeerProposer"]


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

    #: measured here (docs/serve.md): ahead of vLLM plain at 1 and 4 requests at once, behind it at 16 and 32
    max_requests: int | None = 4
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


class _DeerRequest:
    """One request's DEER state: the drafter's per-call state at batch 1 (made at the request's first draft, fed the
    request's tokens as they come), the tokens committed since it began and the last chain drafted."""

    __slots__ = ("state", "committed", "chain")

    def __init__(self):
        self.state, self.committed, self.chain = None, [], []


class DeerProposer(TokenProposer):
    """A DEER diffusion drafter as a vLLM proposer (see the module docstring): each drafting request's block of
    ``num_speculative_tokens`` masks is denoised once after its last token, and the chain is the argmax per depth
    (cut where the drafter's confidence falls below :attr:`min_confidence`, if set).

    The drafter is :attr:`drafter` (a folder, a Hub repo id or a shipped alias such as ``"default-deer"``), else the
    one named by the target's ``parallel_decoding_config.json`` (a bundle's ``drafter/`` folder, or an alias)."""

    #: measured here (docs/serve.md): ahead of vLLM plain with one request decoding, behind it from 4 on (a drafter
    #: forward per request and step)
    max_requests: int | None = 1
    #: the DEER drafter; ``None``: the one the served checkpoint's decoding config names
    drafter: str | None = None
    #: ``"float32"``, ``"bfloat16"``, ...; ``None``: this library's CPU preset (bf16 where the CPU computes it natively)
    drafter_dtype: str | None = None
    #: a request whose drafter state lags by more tokens than this (steps it did not draft) starts a fresh state
    max_catch_up: int = 64
    #: cut the chain before the first depth the drafter gives less than this probability (a shorter chain for the
    #: target to verify); ``None``: always ``num_speculative_tokens``. 0.3 measured no faster here (docs/serve.md):
    #: on this CPU vLLM's verification of 9 tokens costs hardly more than of 5
    min_confidence: float | None = None

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        from ..drafters.diffusion import DiffusionDrafter
        from ..drafters.loading import DRAFTER_DTYPES, load_drafter
        from ..hardware import device_preset

        if self.min_confidence is not None and not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"{type(self).__name__}.min_confidence must be None or in [0, 1), got "
                             f"{self.min_confidence!r}.")
        if not isinstance(self.max_catch_up, int) or self.max_catch_up < 1:
            raise ValueError(f"{type(self).__name__}.max_catch_up must be an integer >= 1, got {self.max_catch_up!r}.")
        source = self.drafter if self.drafter is not None else _configured_drafter(vllm_config.model_config.model)
        dtype = self.drafter_dtype or device_preset("cpu")[1]["speculative"]["drafter_dtype"]
        dtype = DRAFTER_DTYPES.get(dtype, torch.float32)
        self.deer = load_drafter(source, cache=False, device="cpu", dtype=dtype)
        if not isinstance(self.deer, DiffusionDrafter):
            raise ValueError(f"DeerProposer drafts with a DEER diffusion drafter; {source!r} is a "
                             f"{self.deer.describe()}. Serve a draft head or EAGLE-3 drafter through its vLLM export "
                             "(hfpd.export_drafter(..., format='speculators')) instead.")
        if self.k > self.deer.max_depth:
            raise ValueError(f"num_speculative_tokens={self.k} exceeds the DEER drafter's block_size="
                             f"{self.deer.max_depth}: lower num_speculative_tokens.")
        self.deer.check_length(self.max_model_len)
        self.vocab = _target_vocab(vllm_config)
        if self.deer.vocab_size < self.vocab:
            raise ValueError(f"The DEER drafter's vocabulary ({self.deer.vocab_size} rows) is smaller than the served "
                             f"model's ({self.vocab}): it was not built for this model.")

    def new_state(self, tokens: np.ndarray) -> _DeerRequest:
        return _DeerRequest()

    def draft_rows(self, rows):
        out = []
        with torch.inference_mode():
            for entry, tokens, k in rows:
                out.append(self._draft(entry, tokens, k) if k > 0 else [])
        return out

    def _draft(self, entry: Entry, tokens: np.ndarray, k: int) -> list[int]:
        request: _DeerRequest = entry.state
        new = tokens[entry.tokens.shape[0]:]
        if new.shape[0] == 0 and entry.tokens.shape[0]:
            return request.chain  # a stream another slot with the same tokens drafted this step
        self._feed(request, entry.tokens.shape[0], new)
        request.chain = self._deer_chain(request, tokens, k)
        return request.chain

    def _feed(self, request: _DeerRequest, known: int, new: np.ndarray) -> None:
        """Queue ``new`` (the tokens committed after the first ``known``) for the drafter's next forward; a state that
        would lag by more than :attr:`max_catch_up` tokens is dropped (the next draft starts afresh)."""
        if request.state is None:
            return
        pending = getattr(request.state, "pending", None)  # (a bidirectional drafter reads the committed tokens)
        if (0 if pending is None else pending[0].shape[1]) + new.shape[0] > self.max_catch_up:
            request.state = None
            return
        from ..engine.verify import Verdict

        got = torch.as_tensor(new, dtype=torch.long)[None]
        verdict = Verdict(path=torch.zeros_like(got), num_accepted=torch.tensor([got.shape[1] - 1]), tokens=got,
                          choices=got)
        request.state.update(_Position(known - 1), None, verdict)
        request.committed.extend(int(t) for t in new)

    def _start(self, request: _DeerRequest, tokens: np.ndarray) -> None:
        from ..drafters.context import DrafterContext

        n = tokens.shape[0]
        prompt = torch.as_tensor(tokens[:-1], dtype=torch.long)[None]
        ones = torch.ones_like(prompt, dtype=torch.bool)
        positions = torch.arange(n - 1)[None]
        context = DrafterContext(prompt=prompt, prompt_mask=ones, prompt_positions=positions, packed_prompt=prompt,
                                 prompt_lengths=torch.tensor([n - 1]), first_tokens=torch.tensor([int(tokens[-1])]),
                                 first_positions=torch.tensor([n - 1]), taps=None, vocab=self.vocab,
                                 device=torch.device("cpu"), dtype=torch.float32)
        request.state = self.deer.start(context, self.k)
        request.state.max_catch_up = None  # the proposer bounds the lag itself (max_catch_up)
        request.committed = [int(tokens[-1])]

    def _deer_chain(self, request: _DeerRequest, tokens: np.ndarray, k: int) -> list[int]:
        from ..drafters.context import DraftStep

        if request.state is None:
            self._start(request, tokens)
        done = request.committed  # built into tensors only if the drafter reads them (a bidirectional one)
        step = DraftStep(rows=torch.tensor([0]), roots=torch.tensor([int(tokens[-1])]),
                         root_pos=torch.tensor([tokens.shape[0] - 1]), depth=k,
                         read_committed=lambda: (torch.tensor([done]), torch.tensor([len(done)])))
        logits = request.state.marginals(step)  # [1, >= k, V]
        request.state.end_step()
        return self.chain_of(logits[0, :k])

    def chain_of(self, logits: torch.Tensor) -> list[int]:
        """The chain drafted from the denoised block's logits (``[k, V]``): the argmax per depth, cut before the first
        depth whose probability is below :attr:`min_confidence`."""
        if self.min_confidence is None:
            return logits.argmax(-1).tolist()
        confidence, ids = logits.float().softmax(-1).max(-1)
        low = (confidence < self.min_confidence).nonzero()
        return ids[: int(low[0, 0]) if low.numel() else ids.shape[0]].tolist()


class _Position:
    """What :meth:`DiffusionState.update` reads of a step: the position of the last token the state was fed."""

    __slots__ = ("root_pos",)

    def __init__(self, last: int):
        self.root_pos = torch.tensor([last])


def _target_vocab(vllm_config) -> int:
    hf = getattr(vllm_config.model_config, "hf_config", None)
    text = hf.get_text_config() if hf is not None and hasattr(hf, "get_text_config") else hf
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError("DeerProposer could not read the served model's vocabulary size from vLLM's model config.")
    return vocab


def _configured_drafter(target):
    """The drafter the served checkpoint's ``parallel_decoding_config.json`` names (a folder of the checkpoint, an
    alias or a repo id), found and resolved as :func:`hf_paralleldecode.load_model` does."""
    from ..config import CONFIG_NAME
    from ..loading import _find_config, _resolve_drafter_path

    config = _find_config(target, {})
    if config is None or not config.drafter:
        raise ValueError(f"DeerProposer found no drafter: {target} has no {CONFIG_NAME} naming one. Subclass "
                         "DeerProposer with drafter = '<folder, repo id or alias>' and name that class in "
                         "speculative_config['model'].")
    return _resolve_drafter_path(target, config.drafter)
