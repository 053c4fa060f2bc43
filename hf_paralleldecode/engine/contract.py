"""The boundary checks: what a proposer or a drafter hands the engine, checked in one place before it is used.

What it is for
    A strategy or a drafter kind written from ``docs/architecture.md`` that gets the contract slightly wrong must be
    refused with a ``ValueError`` naming the contract and the fix, before the mistake reaches a forward: never fed as
    given (a tree rooted elsewhere than the row's last committed token verifies drafts against the wrong context and
    returns wrong text), never left to fail inside torch (a size mismatch, an index out of range, a ``KeyError``).

    * :func:`check_proposer`: the object a strategy's ``make_proposer`` returned implements ``propose`` and
      ``update`` (once per call, before the first step).
    * :func:`check_tree`: each step's :class:`~.tree.PackedTree`: one row per active row, consistent fields, every
      row's root its last committed token, every token inside the target's vocabulary. The values are checked on the
      tree's host lists when it was built from them, else on the device and read with the step's verdict: no read of
      their own.
    * :func:`check_draft_logits`: what a drafter's state returns (``marginals``, ``expand``): the shape the tree
      grower indexes, over the target's vocabulary.

What it deliberately does not know
    Where trees come from and how they are verified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .tree import PackedTree

__all__ = ["check_proposer", "check_tree", "check_draft_logits", "PendingCheck"]

ROOT_CONTRACT = ("node 0 of each row's tree must be the row's last committed token (run.log.tokens[rows, "
                 "run.log.count[rows] - 1]): drafts verified after another root are checked against the wrong context")


def check_proposer(proposer, name: str) -> None:
    """``ValueError`` unless ``proposer`` (what strategy ``name``'s ``make_proposer(run)`` returned) implements the
    proposer contract: ``propose() -> PackedTree`` and ``update(tree, verdict)`` (``select(kept)`` has a default)."""
    from .run import Proposer

    if not isinstance(proposer, Proposer) and not any(hasattr(proposer, m) for m in ("propose", "update")):
        raise ValueError(f"decoding={name!r}: make_proposer(run) returned {proposer!r}, not a proposer: return an "
                         "object implementing propose() -> PackedTree and update(tree, verdict) (subclass "
                         "hf_paralleldecode.engine.run.Proposer; docs/architecture.md, 'Extension points').")
    missing = [signature for method, signature in (("propose", "propose() -> PackedTree"),
                                                   ("update", "update(tree, verdict)"))
               if not callable(getattr(type(proposer), method, None))
               or getattr(type(proposer), method) is getattr(Proposer, method)]
    if missing:
        raise ValueError(f"decoding={name!r}: the proposer {type(proposer).__name__} does not define "
                         f"{' or '.join(missing)}; every proposer implements both (update may do nothing when the "
                         "strategy learns nothing: docs/architecture.md, 'Extension points').")


@dataclass
class PendingCheck:
    """A tree's value checks computed on the device, to be read with the step's verdict (no read of its own).

    ``flag``: a 0-d tensor, nonzero when a root or a token breaks the contract; ``explain()`` reads the tree and raises
    the detailed ``ValueError`` (called only when the flag was read set, before anything is committed)."""

    flag: torch.Tensor
    explain: Callable[[], None]


def check_tree(tree, rows: list[int], last_token: Callable[[int], int], vocab: int, name: str,
               last: torch.Tensor | None = None) -> PendingCheck | None:
    """``ValueError`` naming the contract when ``tree`` (a proposer's proposal for the active ``rows``, original ids
    in order, host ints) cannot be fed as given: ``last_token(row)`` is an original row's last committed token (a
    host int), ``vocab`` the target's embedding rows.

    Shapes are checked on the host. Values (every row's root its last committed token, every token in the
    vocabulary) are checked on the tree's host lists when it has them; otherwise on the device against ``last``
    (``[active]``, the same tokens on the device), with no read: the returned :class:`PendingCheck` is read with the
    step's verdict, and the tokens fed are clamped into the vocabulary meanwhile (a token out of it never matches the
    target's choice, and the flag stops the step before its commit)."""
    who = f"decoding={name!r}: the proposed tree"
    if not isinstance(tree, PackedTree):
        raise ValueError(f"decoding={name!r}: propose() returned {type(tree).__name__}, not a PackedTree (build it "
                         "with hf_paralleldecode.engine.tree: chain_tree, pack_trees, root_tree).")
    tokens = tree.tokens
    active = len(rows)
    if tokens.dim() != 2 or tokens.shape[0] != active or tokens.shape[1] < 1:
        raise ValueError(f"{who} holds tokens of shape {list(tokens.shape)} for {tokens.shape[0] if tokens.dim() else 0}"
                         f" rows, but {active} rows are active: propose [active, nodes] for run.rows (the rows still "
                         "decoding, in that order; a row leaves once it finished and select(kept) says which stay).")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"{who} holds {tokens.dtype} tokens: token ids are integers (torch.long).")
    batch, width = tokens.shape
    expected = {"parents": [batch, width], "depth": [batch, width], "num_nodes": [batch],
                "mask": [batch, width, width]}
    for field, shape in expected.items():
        got = list(getattr(tree, field).shape)
        if got != shape:
            raise ValueError(f"{who}'s {field} has shape {got} where its tokens {list(tokens.shape)} need {shape} "
                             "(docs/architecture.md, 'One step'; build trees with hf_paralleldecode.engine.tree).")
    if tree.q is not None and list(tree.q.shape[:2]) != [batch, width]:
        raise ValueError(f"{who}'s q has shape {list(tree.q.shape)} where its tokens need [{batch}, {width}, vocab].")
    if tree.host is not None:
        host_tokens = tree.host[0]
        _check_values(who, rows, last_token, vocab, [t[0] for t in host_tokens], min(map(min, host_tokens)),
                      max(map(max, host_tokens)))
        return None
    if last is None:  # values read here
        _explain(who, tokens, rows, last_token, vocab)
        return None
    flag = (tokens[:, 0] != last).any()
    if width == 1:  # the roots alone: fed as the engine holds them (in the vocabulary), checked against them
        tree.tokens = last[:, None]
    else:  # fed clamped into the vocabulary; a token out of it differs from its clamped self
        fed = tokens.clamp(0, vocab - 1)
        flag = flag | (fed != tokens).any()
        tree.tokens = fed
    return PendingCheck(flag, lambda: _explain(who, tokens, rows, last_token, vocab))


def _explain(who, tokens, rows, last_token, vocab) -> None:
    low, high = tokens.aminmax()
    values = torch.cat([tokens[:, 0], low[None], high[None]]).tolist()
    batch = tokens.shape[0]
    _check_values(who, rows, last_token, vocab, values[:batch], values[batch], values[batch + 1])


def _check_values(who, rows, last_token, vocab, roots, low, high) -> None:
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"{who} holds token {bad} outside the target's vocabulary of {vocab} (ids 0 .. {vocab - 1}): "
                         "propose ids the model embeds (a drafter over another vocabulary must map its ids first).")
    for row, root in zip(rows, roots):
        want = last_token(row)
        if root != want:
            raise ValueError(f"{who} for row {row} has root {root}, but the row's last committed token is {want}: "
                             f"{ROOT_CONTRACT}.")


def check_draft_logits(logits, what: str, describe: str, shape: list, vocab: int, at_least: int | None = None,
                       rows: str = "") -> None:
    """``ValueError`` unless ``logits`` (what a drafter's ``what`` returned; ``describe``: the drafter) is a float
    tensor of ``shape`` plus the target's ``vocab``; with ``at_least``, dimension 1 holds at least that many entries
    (marginals for every depth the step drafts). ``rows``: what the leading dimensions stand for, in the message."""
    if at_least is not None:
        wanted = f"[{shape[0]}, >= {at_least}, {vocab}]"
    else:
        wanted = "[" + ", ".join(map(str, [*shape, vocab])) + "]"
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise ValueError(f"The {describe}'s {what} returned {type(logits).__name__}: it must return float logits "
                         f"{wanted} (docs/architecture.md, 'Writing a drafter kind').")
    got = list(logits.shape)
    lead_ok = (len(got) == len(shape) + 1 and got[0] == shape[0]
               and (got[1:-1] == shape[1:] if at_least is None else got[1] >= at_least))
    if not lead_ok:
        raise ValueError(f"The {describe}'s {what} returned logits of shape {got} where this step needs {wanted} "
                         f"({rows}: docs/architecture.md, 'Writing a drafter kind').")
    if got[-1] != vocab:
        raise ValueError(f"The {describe}'s {what} returned logits of shape {got}, over {got[-1]} tokens where the "
                         f"target's vocabulary has {vocab}: return logits over the target's vocabulary ({wanted}; -inf "
                         "for tokens the drafter cannot propose).")
