"""Token trees: the one packing every drafter's guesses go through before a single target forward.

What it is for
    Candidates of any origin (a Jacobi block, recycled n-grams, lookahead guesses, draft-head
    trees) continue the row's last committed token, the *root*. :func:`pack_trees` merges each
    row's candidates into a trie (shared prefixes stored once), lays the nodes out along the
    sequence axis in topological order and gives each node its depth (position offset) and its
    ancestors-or-self attention row. :func:`chain_tree` builds the degenerate one-path tree of a
    Jacobi block without Python loops. Acceptance is ``verify.py``'s; the KV of exactly the
    accepted path's nodes is then kept by ``SlotCache.commit``.

Shapes (``batch`` rows, ``nodes`` packed nodes per row, node 0 is always the root)
    ``tokens``, ``parents``, ``depth``: ``[batch, nodes]``; ``mask``: ``[batch, nodes, nodes]``.
    Rows with fewer nodes are padded with *filler* nodes (parent ``-1``, attend to themselves only).
    Siblings are laid out in the order they should be tried (their draw order, for drafters with ``q``).

What it deliberately does not know
    Where candidates come from, and how they are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PackedTree", "pack_trees", "chain_tree", "tree_from_parents"]


@dataclass
class PackedTree:
    tokens: torch.Tensor  # [batch, nodes] node 0 = root (last committed token)
    parents: torch.Tensor  # [batch, nodes] parent node, -1 for the root and for filler
    depth: torch.Tensor  # [batch, nodes] 0 for the root (and filler)
    num_nodes: torch.Tensor  # [batch] real nodes; the rest are filler
    mask: torch.Tensor  # [batch, nodes, nodes] bool: node i attends to node j (ancestor or self)
    is_chain: bool = False  # every row is a single path laid out in order (a Jacobi block)
    candidate_nodes: list[list[list[int]]] | None = None  # per row, per candidate: node of each token
    q: torch.Tensor | None = None  # [batch, nodes, vocab] draft probabilities each node's children were drawn from

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def real(self) -> torch.Tensor:  # [batch, nodes] bool
        return torch.arange(self.width, device=self.tokens.device)[None] < self.num_nodes[:, None]

    def path_tokens(self, row: int, node: int) -> list[int]:
        """Tokens from the root's child down to ``node`` (inclusive); empty for the root."""
        out = []
        parents, tokens = self.parents[row].tolist(), self.tokens[row].tolist()
        while node > 0:
            out.append(tokens[node])
            node = parents[node]
        return out[::-1]


def chain_tree(tokens: torch.Tensor, widths: torch.Tensor) -> PackedTree:
    """A single path per row: ``tokens[:, 0]`` is the root, ``widths`` real nodes per row."""
    batch, width = tokens.shape
    idx = torch.arange(width, device=tokens.device)
    real = idx[None] < widths[:, None]
    parents = torch.where(real & (idx[None] > 0), idx[None] - 1, -1).expand(batch, width)
    depth = torch.where(real, idx[None], 0).expand(batch, width)
    mask = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril()[None].expand(batch, -1, -1)
    # filler positions come after the real ones, so the plain causal mask never lets a real node see one
    return PackedTree(tokens, parents, depth, widths, mask, is_chain=True)


def pack_trees(
    roots: torch.Tensor,  # [batch] last committed token of each row
    candidates: Sequence[Sequence[Sequence[int]]],  # per row, candidate continuations (token lists)
    max_nodes: int | None = None,  # node budget per row, root included (None = no limit)
) -> PackedTree:
    """Merge each row's candidates into a trie under its root and pack all rows for one forward.

    Candidates are inserted in the order given until the node budget is spent (a candidate that
    does not fit is truncated), so put the most promising first. ``candidate_nodes[row][k]`` lists
    the node holding each (inserted) token of candidate ``k``, e.g. to read a lookahead column's
    logits.
    """
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}.")
    batch = roots.shape[0]
    if len(candidates) != batch:
        raise ValueError(f"Got candidates for {len(candidates)} rows, expected {batch}.")
    rows_tokens, rows_parents, rows_depth, rows_nodes = [], [], [], []
    for b in range(batch):
        toks, pars, deps = [int(roots[b])], [-1], [0]
        children: dict[tuple[int, int], int] = {}
        cand_nodes = []
        for cand in candidates[b]:
            node, nodes = 0, []
            for tok in cand:
                key = (node, int(tok))
                if key not in children:
                    if max_nodes is not None and len(toks) >= max_nodes:
                        break
                    children[key] = len(toks)
                    toks.append(int(tok))
                    pars.append(node)
                    deps.append(deps[node] + 1)
                node = children[key]
                nodes.append(node)
            cand_nodes.append(nodes)
        rows_nodes.append(cand_nodes)
        rows_tokens.append(toks)
        rows_parents.append(pars)
        rows_depth.append(deps)
    tree = tree_from_parents(roots, rows_tokens, rows_parents, rows_depth)
    tree.candidate_nodes = rows_nodes
    return tree


def tree_from_parents(
    roots: torch.Tensor,  # [batch] root token of each row (also used for filler nodes)
    rows_tokens: Sequence[Sequence[int]],  # per row: node tokens, node 0 = the root, parents before children
    rows_parents: Sequence[Sequence[int]],  # per row: parent of each node (-1 for the root)
    rows_depth: Sequence[Sequence[int]],  # per row: depth of each node (0 for the root)
    q: torch.Tensor | None = None,
) -> PackedTree:
    """Pack per-row node lists (already in topological order) into one :class:`PackedTree`."""
    batch = roots.shape[0]
    width = max(map(len, rows_tokens))
    device = roots.device
    root_list = roots.tolist()
    pad = [width - len(t) for t in rows_tokens]
    # one host-to-device copy per field; filler nodes: the row's root token, no parent, depth 0
    tokens = torch.tensor([list(t) + [r] * k for t, r, k in zip(rows_tokens, root_list, pad)], device=device)
    parents = torch.tensor([list(p) + [-1] * k for p, k in zip(rows_parents, pad)], device=device)
    depth = torch.tensor([list(d) + [0] * k for d, k in zip(rows_depth, pad)], device=device)
    # ancestor-or-self mask by pointer jumping along parents: one vectorised pass per tree level
    mask = torch.eye(width, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    cur = parents
    rows = torch.arange(batch, device=device)[:, None].expand(-1, width)
    cols = torch.arange(width, device=device)[None].expand(batch, -1)
    for _ in range(int(depth.max()) if width > 1 else 0):
        valid = cur >= 0
        mask[rows[valid], cols[valid], cur[valid]] = True
        cur = torch.where(valid, parents.gather(1, cur.clamp(min=0)), cur)
    num_nodes = torch.tensor([len(t) for t in rows_tokens], device=device)
    return PackedTree(tokens, parents, depth, num_nodes, mask, q=q)
