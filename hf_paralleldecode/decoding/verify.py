"""Prefix matching, the chain fast path of the tree walk (``tree.walk_tree``).

Glossary (one notation everywhere): the target's distribution is ``p``; a step feeds the last
committed token followed by guessed tokens; *accepted* tokens are the leading guesses that equal
the target's choice; the *bonus* token is the target's choice right after the accepted ones.
A step therefore commits ``accepted + 1`` tokens.
"""

from __future__ import annotations

import torch

__all__ = ["match_prefix"]


def match_prefix(
    guesses: torch.Tensor,  # [batch, k] guessed tokens at positions 1..k of the fed block
    choices: torch.Tensor,  # [batch, k] target's choice (greedy or sampled) for those same positions
    num_guesses: torch.Tensor,  # [batch] how many of the k guesses are real (the rest is filler)
) -> torch.Tensor:
    """Number of leading guesses equal to the target's choice, per row (``[batch]``, long)."""
    cols = torch.arange(guesses.shape[1], device=guesses.device)
    match = (guesses == choices) & (cols[None, :] < num_guesses[:, None])
    return match.long().cumprod(dim=1).sum(dim=1)
