"""Context n-gram drafting (``decoding="prompt_lookup"``): continuations of the current suffix found in the
row's own prompt and generated text, merged as a tree and verified in one forward.

What it does
    Code and edits repeat themselves. Each step, for every row, the last ``n`` tokens of its
    context (its prompt without padding, plus what it has committed) are looked up in that same
    context, for ``n`` from ``max_ngram_size`` down to 1. Every earlier occurrence gives a candidate
    continuation: the ``num_tokens`` tokens that followed it. Longer matches come first, and within a
    length the most recent occurrence comes first. Up to ``max_matches`` distinct candidates are
    merged into a trie under the last committed token, cut at ``tree_budget`` drafted nodes, and
    verified by the shared tree verifier. It is lossless, greedy or sampled, and batched, like every
    strategy here; transformers' own prompt lookup (``prompt_lookup_num_tokens``) is batch-1 only
    and drafts a single chain.

Cost
    Matching is a few tensor comparisons per row and n-gram size; nothing is stored between steps.
"""

from __future__ import annotations

import torch

from .base import Proposer, check_int_setting, checks_settings, decode
from .tree import pack_trees

__all__ = ["prompt_lookup", "context_candidates"]


def _check_settings(num_tokens, max_ngram_size, max_matches, tree_budget):
    check_int_setting("num_tokens", num_tokens, 1)
    check_int_setting("max_ngram_size", max_ngram_size, 1)
    check_int_setting("max_matches", max_matches, 1)
    check_int_setting("tree_budget", tree_budget, 1)


def context_candidates(context: torch.Tensor, num_tokens: int, max_ngram_size: int, max_matches: int) -> list[list[int]]:
    """Continuations of ``context``'s suffix found earlier in ``context`` (1-D, CPU), best first.

    For ``n = max_ngram_size .. 1``: every position ``p`` with ``context[p:p+n] == context[-n:]``
    and at least one token after the match (the suffix itself excluded) gives
    ``context[p+n : p+n+num_tokens]``; longer ``n`` first, later ``p`` first, duplicates dropped.
    """
    length = context.shape[0]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_ngram_size, length - 1), 0, -1):
        windows = context[:-1].unfold(0, n, 1)  # start p in [0, length - n - 1]: a continuation exists
        hits = (windows == context[-n:]).all(dim=1).nonzero().flatten().flip(0)
        for p in hits.tolist():
            cont = tuple(context[p + n : p + n + num_tokens].tolist())
            if cont not in seen:
                seen.add(cont)
                out.append(list(cont))
                if len(out) == max_matches:
                    return out
    return out


class ContextNgramProposer(Proposer):
    """Each step: every active row's context suffix matches, merged as a trie (see module docstring)."""

    def __init__(self, run, num_tokens: int, max_ngram_size: int, max_matches: int, tree_budget: int):
        self.run = run
        self.num_tokens, self.max_ngram, self.max_matches, self.budget = num_tokens, max_ngram_size, max_matches, tree_budget
        self.steps = self.matched = 0
        # each row's prompt without padding, kept on the host
        self.prompts = {r: run.prompt[r][run.prompt_mask[r]].cpu() for r in range(run.prompt.shape[0])}

    @property
    def stats(self) -> dict:
        return {"matched_step_share": self.matched / max(self.steps, 1)}

    def propose(self):
        log, rows = self.run.log, self.run.rows
        counts = log.count[rows].tolist()
        tokens = log.tokens[rows, : max(counts)].cpu()  # one device-to-host copy per step
        roots, cands = [], []
        for i, r in enumerate(rows.tolist()):
            context = torch.cat([self.prompts[r], tokens[i, : counts[i]]])
            room = int(log.max_new_tokens) - counts[i]  # a depth-d path commits d + 1 tokens
            found = context_candidates(context, min(self.num_tokens, room), self.max_ngram, self.max_matches)
            roots.append(int(tokens[i, counts[i] - 1]))
            cands.append(found)  # every match has a continuation: no empty candidate
            self.steps += 1
            self.matched += bool(cands[-1])
        return pack_trees(torch.tensor(roots, device=rows.device), cands, max_nodes=self.budget + 1)

    def update(self, tree, verdict) -> None:
        """Nothing to learn: the next step reads the committed tokens from the commit log."""


@checks_settings(_check_settings)
def prompt_lookup(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    num_tokens: int = 10,
    max_ngram_size: int = 3,
    max_matches: int = 4,
    tree_budget: int = 32,
    pd_streamer=None,
    **model_kwargs,
):
    """Lossless context n-gram (prompt lookup) decoding, greedy or sampled, batched; a ``custom_generate`` callable.

    Args:
        num_tokens: tokens drafted after each match (transformers' ``prompt_lookup_num_tokens``).
        max_ngram_size: longest suffix looked up; shorter ones down to 1 are tried too.
        max_matches: distinct continuations merged into the tree per step.
        tree_budget: drafted nodes per step at most (the verification forward feeds at most
            ``tree_budget + 1`` tokens).
        pd_streamer (BaseStreamer | None): see :func:`hf_paralleldecode.jacobi`.
    """
    _check_settings(num_tokens, max_ngram_size, max_matches, tree_budget)
    return decode(
        model, "prompt_lookup",
        lambda run: ContextNgramProposer(run, num_tokens, max_ngram_size, max_matches, tree_budget),
        input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs,
        dict(num_tokens=num_tokens, max_ngram_size=max_ngram_size, max_matches=max_matches, tree_budget=tree_budget),
        pd_streamer=pd_streamer,
    )
