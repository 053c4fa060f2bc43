"""The shapes a step may take, and what a chain would have accepted on a step of the configured tree.

Shapes
    Every strategy offers a few *shapes* (:class:`Shape`): its configured tree first, then chains of at most 8, 4 and
    2 levels along its first choice (a drafter's chain without context matches, the first context match, a
    Jacobi block cut short), and a *plain* step that feeds the last committed token alone: ordinary decoding, no
    drafter forward. Strategies whose state needs every node of their tree (a lookahead window) offer the
    configured tree and the plain step only. The rows of one step share its shape, because a forward costs what
    its widest row costs (the rows are padded to one width); each row fills the shape with its own best nodes.

Paired counts
    On every step of the configured tree, the tokens each chain would have committed are read off the same
    verification (:func:`first_child_prefix`: how far the accepted path ran along the tree's first children, which
    is the chain; with sampling the draws are shared, so this holds for sampled steps as well).

What it deliberately does not know
    Times, batches, the rule that picks a shape (:mod:`.rule`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Shape", "PLAIN", "CHAIN_DEPTHS", "shapes_from", "path_prefix", "first_child_prefix"]

#: the depths of the chains every strategy offers besides its configured tree (cut to the configured depth)
CHAIN_DEPTHS = (8, 4, 2)


@dataclass(frozen=True)
class Shape:
    """One tree shape: ``width`` children per node, ``depth`` levels, ``budget`` drafted nodes, context on / off;
    ``drafter=False``: no drafter forward, the first context match alone (a *context chain*)."""

    width: int
    depth: int
    budget: int
    context: bool
    drafter: bool = True

    @property
    def plain(self) -> bool:
        """A step that feeds the last committed token only (ordinary decoding)."""
        return self.depth == 0

    @property
    def kind(self) -> tuple[int, bool, bool]:
        """What shapes of one kind share: width, context matches and the drafter forward. They differ by depth and
        budget only, so their step times lie on one curve of nodes fed (:meth:`~.times.StepTimes.floor`)."""
        return self.width, self.context, self.drafter

    @property
    def label(self) -> str:
        if self.plain:
            return "plain"
        if not self.drafter:
            return f"context chain d{self.depth}"
        kind = "chain" if self.width == 1 else f"tree w{self.width}"
        return f"{kind} d{self.depth} b{self.budget}" + (" +context" if self.context else "")


PLAIN = Shape(1, 0, 0, False)


def shapes_from(width: int, depth: int, budget: int, context: bool, chains: bool = True,
                context_depth: int | None = None) -> list[Shape]:
    """The configured shape first, then (``chains``) chains of at most 8, 4 and 2 levels without context matches,
    (``context_depth``: the tokens of a context match) context chains of at most 8, 4 and 2 tokens without the
    drafter (deduplicated), and the plain step."""
    out = [Shape(width, depth, budget, context)]
    for d in CHAIN_DEPTHS if chains else ():
        chain = Shape(1, min(depth, d, budget), min(depth, d, budget), False)
        if chain not in out and chain.depth > 0:
            out.append(chain)
    for d in CHAIN_DEPTHS if chains and context and context_depth else ():
        chain = Shape(1, min(context_depth, d, budget), min(context_depth, d, budget), True, drafter=False)
        if chain not in out and chain.depth > 0:
            out.append(chain)
    if PLAIN not in out:
        out.append(PLAIN)
    return out


def path_prefix(verdict, nodes: torch.Tensor) -> torch.Tensor:
    """``[batch]``: how many of each row's accepted nodes are, one after the other from the root, the nodes of
    ``nodes`` ``[batch, length]`` (a path from the root's child down, ``-1`` past its end)."""
    path = verdict.path[:, 1:]
    n = min(path.shape[1], nodes.shape[1])
    ok = (nodes[:, :n] >= 0) & (path[:, :n] == nodes[:, :n])
    return ok.long().cumprod(1).sum(1)


def first_child_prefix(tree, verdict) -> torch.Tensor:
    """``[batch]``: how many of each row's accepted nodes are, one after the other from the root, the first child
    (the lowest node index, the first tried) of the node before: what the chain along the tree's first children
    would have accepted on this very step (greedy: the same argmaxes; sampled: the same draws)."""
    parents = tree.parents
    batch, width = parents.shape
    index = torch.arange(width, device=parents.device).expand(batch, width)
    first = torch.full((batch, width + 1), width, dtype=torch.long, device=parents.device)  # width: no child
    first.scatter_reduce_(1, torch.where(parents >= 0, parents, width), index, reduce="amin", include_self=True)
    # the first child of each node on the accepted path: the chain that path would follow
    return path_prefix(verdict, first.gather(1, verdict.path[:, :-1].clamp(min=0)))


def verdict_counts(verdict) -> list[int]:
    """Each row's accepted nodes as host ints (:attr:`~hf_paralleldecode.engine.verify.Verdict.nums`: read by the
    engine with the verdict); a verdict-like object without them is read."""
    nums = getattr(type(verdict), "nums", None)
    return verdict.nums if nums is not None else verdict.num_accepted.tolist()


def first_child_prefix_host(tree, verdict) -> list[int]:
    """:func:`first_child_prefix` as host ints, from the host lists of the tree and the verdict when both have them
    (no read), else read. On a chain every accepted node is its parent's first child."""
    if getattr(tree, "is_chain", False):
        return verdict_counts(verdict)
    if getattr(tree, "host", None) is None or getattr(verdict, "host", None) is None:
        return first_child_prefix(tree, verdict).tolist()
    out = []
    for parents, path, num in zip(tree.host[1], verdict.host[0], verdict.host[1]):
        first: dict[int, int] = {}
        for v, p in enumerate(parents):
            if p >= 0 and p not in first:
                first[p] = v
        k = 0
        while k < num and first.get(path[k]) == path[k + 1]:
            k += 1
        out.append(k)
    return out

