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

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PackedTree", "pack_trees", "pack_candidates", "chain_tree", "root_tree", "tree_from_parents", "ancestor_mask"]

#: trees of at most this many candidate tokens / nodes (all rows together) are packed in Python on the host
#: lists the proposers already hold: a trie of dicts and one copy per field beat the ~40 small tensor
#: operations of the vectorised packing (:func:`pack_candidates`, :func:`ancestor_mask`) on a CPU, where
#: each costs microseconds; larger trees (wide batches) keep the vectorised path
HOST_PACK_TOKENS = 1024


@dataclass
class PackedTree:
    tokens: torch.Tensor  # [batch, nodes] node 0 = root (last committed token)
    parents: torch.Tensor  # [batch, nodes] parent node, -1 for the root and for filler
    depth: torch.Tensor  # [batch, nodes] 0 for the root (and filler)
    num_nodes: torch.Tensor  # [batch] real nodes; the rest are filler
    mask: torch.Tensor  # [batch, nodes, nodes] bool: node i attends to node j (ancestor or self)
    is_chain: bool = False  # every row is a single path laid out in order (a Jacobi block)
    candidate_index: torch.Tensor | None = None  # [batch, candidates, length] node of each candidate token, -1 if absent
    candidate_fresh: torch.Tensor | None = None  # [batch, candidates, length] the tokens that created their node
    candidate_sources: torch.Tensor | None = None  # [batch, candidates] proposer id of each candidate (budgeted trees)
    q: torch.Tensor | None = None  # [batch, nodes, vocab] draft probabilities each node's children were drawn from
    context_path: torch.Tensor | None = None  # [batch, length] the nodes of each row's first context match, -1 past
    # its end (trees that merge context matches into a drafter's tree: the batch policy's context chains)
    node_keys: torch.Tensor | None = None  # [batch, nodes] budget statistics key of each drafted node, -1 for the root
    # and filler (trees a CostAwareBudget trimmed node by node, see budget.CostAwareBudget.trim)
    # the same tokens, parents and real-node counts as host lists ([batch][nodes], filler included; [batch]), when
    # the tree was built from host lists: the verifier and the boundary checks read them instead of the device
    host: tuple[list[list[int]], list[list[int]], list[int]] | None = None
    _max_depth: int | None = None  # see max_depth
    _candidate_nodes: list | None = None  # see candidate_nodes

    @property
    def candidate_nodes(self) -> list[list[list[int]]] | None:
        """Per row, per candidate: the node of each inserted token (``candidate_index`` as lists)."""
        if self.candidate_index is None:
            return None
        if self._candidate_nodes is None:
            self._candidate_nodes = [[[n for n in cand if n >= 0] for cand in row] for row in self.candidate_index.tolist()]
        return self._candidate_nodes

    @property
    def max_depth(self) -> int:
        """Deepest node's depth (a host integer, known when the tree is built; no device sync)."""
        if self._max_depth is None:
            self._max_depth = int(self.depth.max()) if self.depth.numel() else 0
        return self._max_depth

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


_ROOT_STRUCTURE: dict = {}  # (batch, device) -> the constant tensors of a one-node tree (see root_tree)


def root_tree(roots: torch.Tensor) -> PackedTree:
    """Each row's root alone (``roots [batch]``): a plain step's tree, a chain of one node (fed with the 2D mask stock
    decoding passes), holding one empty candidate per row (readers of a row's first candidate find nothing). Its
    structure does not depend on the tokens, so it is built once per batch size and device (read-only views)."""
    key = (roots.shape[0], roots.device)
    structure = _ROOT_STRUCTURE.get(key)
    if structure is None:
        batch, device = key
        zeros = torch.zeros(batch, 1, dtype=torch.long, device=device)
        structure = _ROOT_STRUCTURE[key] = (zeros - 1, zeros, torch.ones(batch, dtype=torch.long, device=device),
                                            torch.ones(batch, 1, 1, dtype=torch.bool, device=device),
                                            torch.zeros(batch, 1, 0, dtype=torch.long, device=device))
    parents, depth, widths, mask, candidates = structure
    return PackedTree(roots[:, None], parents, depth, widths, mask, is_chain=True, candidate_index=candidates,
                      _max_depth=0)


def chain_tree(tokens: torch.Tensor, widths: torch.Tensor) -> PackedTree:
    """A single path per row: ``tokens[:, 0]`` is the root, ``widths`` real nodes per row."""
    batch, width = tokens.shape
    idx = torch.arange(width, device=tokens.device)
    real = idx[None] < widths[:, None]
    parents = torch.where(real & (idx[None] > 0), idx[None] - 1, -1).expand(batch, width)
    depth = torch.where(real, idx[None], 0).expand(batch, width)
    mask = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril()[None].expand(batch, -1, -1)
    # filler positions come after the real ones, so the plain causal mask never lets a real node see one
    return PackedTree(tokens, parents, depth, widths, mask, is_chain=True, _max_depth=width - 1)


def pack_trees(
    roots: torch.Tensor,  # [batch] last committed token of each row
    candidates: Sequence[Sequence[Sequence[int]]],  # per row, candidate continuations (token lists)
    max_nodes: int | None = None,  # node budget per row, root included (None = no limit)
    sources: Sequence[Sequence[int]] | None = None,  # per row, the proposer id of each candidate (with budget)
    budget=None,  # a budget.CostAwareBudget (see pack_candidates)
    root_list: Sequence[int] | None = None,  # the roots as host ints, when the caller has them (no read)
) -> PackedTree:
    """Merge each row's candidates into a trie under its root and pack all rows for one forward.

    Candidates are inserted in the order given until the node budget is spent (a candidate that
    does not fit is truncated), so put the most promising first (with ``budget``, nodes are ranked
    instead, see :func:`pack_candidates`). ``candidate_nodes[row][k]`` lists
    the node holding each (inserted) token of candidate ``k``, e.g. to read a lookahead column's
    logits (``candidate_index`` holds the same as a tensor). The lists are padded into one tensor
    and merged by :func:`pack_candidates`.
    """
    batch = roots.shape[0]
    if len(candidates) != batch:
        raise ValueError(f"Got candidates for {len(candidates)} rows, expected {batch}.")
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}.")
    if budget is None and sum(len(x) for c in candidates for x in c) <= HOST_PACK_TOKENS:
        return _pack_on_host(roots, candidates, max_nodes, root_list)
    num = max((len(c) for c in candidates), default=0)
    longest = max((len(x) for c in candidates for x in c), default=0)
    # padded in numpy row by row: several times faster than torch.tensor() of nested lists
    padded = np.zeros((batch, num, longest), dtype=np.int64)
    lengths = np.zeros((batch, num), dtype=np.int64)
    for b, cands in enumerate(candidates):
        for m, x in enumerate(cands):
            padded[b, m, : len(x)] = x
            lengths[b, m] = len(x)
    device = roots.device
    source_ids = None
    if budget is not None:
        if sources is None or [len(x) for x in sources] != [len(c) for c in candidates]:
            raise ValueError("pack_trees with a budget needs one source id per candidate.")
        source_ids = torch.tensor([budget.keys(x) + [0] * (num - len(x)) for x in sources], dtype=torch.long,
                                  device=device).reshape(batch, num)
    return pack_candidates(roots, torch.from_numpy(padded).to(device), torch.from_numpy(lengths).to(device), max_nodes,
                           source_ids, budget)


def pack_candidates(
    roots: torch.Tensor,  # [batch] last committed token of each row
    tokens: torch.Tensor,  # [batch, num, length] candidate continuations, padded
    lengths: torch.Tensor,  # [batch, num] real tokens of each candidate (0 = no candidate)
    max_nodes: int | None = None,  # node budget per row, root included (None = no limit)
    sources: torch.Tensor | None = None,  # [batch, num] budget.keys() of each candidate (with `budget`)
    budget=None,  # a budget.CostAwareBudget: which optional nodes are worth their cost
) -> PackedTree:
    """:func:`pack_trees` on padded tensors, with no per-token Python: the trie comes from prefix equality.

    Token ``l`` of candidate ``m`` lives in the node of the first candidate ``m' <= m`` that agrees
    with it on tokens ``0..l`` (its *owner*); a node is new when a candidate owns it. New nodes are
    numbered in insertion order (candidate by candidate, token by token), which is topological,
    and the first ``max_nodes - 1`` of them are kept: exactly what inserting the candidates one by
    one into a trie, stopping at the budget, gives.

    With ``budget`` (and ``sources``), nodes are ranked instead: those of mandatory sources first,
    then the others by their estimated acceptance ``P`` (the minimum along their path, so a parent
    always ranks before its child), and the budget chooses how many optional nodes are worth their
    cost (:mod:`~.budget`); ``max_nodes`` still caps the total. ``candidate_fresh`` marks the
    candidate tokens that created a node (what the acceptance model learns from).
    """
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}.")
    batch, num, length = tokens.shape
    device = tokens.device
    if num == 0 or length == 0:  # nothing to draft: the root alone
        empty = torch.zeros((batch, 1), dtype=torch.long, device=device)
        return PackedTree(roots[:, None].clone(), empty - 1, empty, empty[:, 0] + 1,
                          torch.ones((batch, 1, 1), dtype=torch.bool, device=device),
                          candidate_index=tokens.new_full((batch, num, length), -1), _max_depth=0)
    pos = torch.arange(length, device=device)
    valid = pos[None, None] < lengths[..., None]  # [batch, num, length]
    # same[b, m, l, k]: candidates m and k agree on tokens 0..l (both long enough); k last, so that the
    # first-true search below reduces a contiguous axis (a strided argmax is ~20x slower on a CPU)
    agree = (tokens[..., None] == tokens.transpose(1, 2)[:, None]) & valid[..., None] & valid.transpose(1, 2)[:, None]
    same = (~agree).cumsum(dim=2) == 0
    owner = same.to(torch.uint8).argmax(dim=-1)  # [batch, num, length] first candidate holding this prefix
    fresh = valid & (owner == torch.arange(num, device=device)[None, :, None])
    if budget is not None:
        fresh = _budgeted(fresh, owner, valid, sources, budget, max_nodes)
    elif max_nodes is not None:
        fresh &= fresh.reshape(batch, -1).cumsum(1).reshape(batch, num, length) < max_nodes
    ids = fresh.reshape(batch, -1).long().cumsum(1).reshape(batch, num, length)  # node id of each fresh token
    ids = torch.where(fresh, ids, -1)
    node = ids.gather(1, owner)  # [batch, num, length] node of each candidate token (-1: cut by the budget)
    node = torch.where(valid, node, -1)
    width = int(fresh.sum((1, 2)).max()) + 1 if fresh.numel() else 1
    # scatter the fresh nodes into the packed layout; column `width` collects everything else
    slot = torch.where(fresh, ids, width).reshape(batch, -1)
    parent_of = torch.cat([torch.zeros_like(node[..., :1]), node[..., :-1]], dim=-1)  # token l's parent: node of l-1
    flat_rows = torch.arange(batch, device=device)[:, None]
    out_tokens = roots[:, None].repeat(1, width + 1)
    out_tokens[flat_rows, slot] = tokens.reshape(batch, -1)
    out_parents = torch.full((batch, width + 1), -1, dtype=torch.long, device=device)
    out_parents[flat_rows, slot] = parent_of.reshape(batch, -1)
    out_depth = torch.zeros((batch, width + 1), dtype=torch.long, device=device)
    out_depth[flat_rows, slot] = (pos + 1).expand(batch, num, length).reshape(batch, -1)
    out_tokens, out_parents, out_depth = out_tokens[:, :width], out_parents[:, :width], out_depth[:, :width]
    out_parents[:, 0] = -1
    out_depth[:, 0] = 0
    max_depth = int(torch.where(node >= 0, pos + 1, 0).max()) if node.numel() else 0
    num_nodes = fresh.sum((1, 2)) + 1
    return PackedTree(out_tokens, out_parents, out_depth, num_nodes, ancestor_mask(out_parents, max_depth),
                      candidate_index=node, candidate_fresh=fresh, candidate_sources=sources, _max_depth=max_depth)


def _pack_on_host(roots: torch.Tensor, candidates, max_nodes: int | None,
                  root_list: Sequence[int] | None = None) -> PackedTree:
    """:func:`pack_trees` without a cost budget, by inserting the candidates one by one into a trie of dicts
    (the same tree, node numbering, ``candidate_index`` and ``candidate_fresh`` as :func:`pack_candidates`)."""
    batch = roots.shape[0]
    num = max((len(c) for c in candidates), default=0)
    longest = max((len(x) for c in candidates for x in c), default=0)
    if num == 0 or longest == 0:  # the vectorised path's one-node tree
        return pack_candidates(roots, torch.zeros((batch, num, longest), dtype=torch.long, device=roots.device),
                               torch.zeros((batch, num), dtype=torch.long, device=roots.device))
    cap = None if max_nodes is None else max_nodes - 1  # drafted nodes, the root excluded
    rows_tokens, rows_parents, rows_depth, index, fresh = [], [], [], [], []
    for root, cands in zip(roots.tolist() if root_list is None else root_list, candidates):
        toks, pars, deps, child = [root], [-1], [0], {}
        for cand in cands:
            node, ids, new = 0, [], []
            for tok in cand:
                nxt = child.get((node, tok)) if node >= 0 else -1
                made = nxt is None
                if made:
                    if cap is not None and len(toks) > cap:  # the budget is spent: the rest of it is cut
                        nxt, made = -1, False
                    else:
                        nxt = child[(node, tok)] = len(toks)
                        toks.append(tok)
                        pars.append(node)
                        deps.append(deps[node] + 1)
                node = nxt
                ids.append(nxt)
                new.append(made)
            pad = longest - len(cand)
            index.append(ids + [-1] * pad)
            fresh.append(new + [False] * pad)
        index.extend([[-1] * longest] * (num - len(cands)))
        fresh.extend([[False] * longest] * (num - len(cands)))
        rows_tokens.append(toks)
        rows_parents.append(pars)
        rows_depth.append(deps)
    tree = tree_from_parents(roots, rows_tokens, rows_parents, rows_depth)
    tree.candidate_index = torch.tensor(index, dtype=torch.long, device=roots.device).reshape(batch, num, longest)
    tree._candidate_nodes = [[[n for n in cand if n >= 0] for cand in index[b * num:(b + 1) * num]]
                             for b in range(batch)]  # (what candidate_nodes reads back, known here)
    tree.candidate_fresh = torch.tensor(fresh, dtype=torch.bool, device=roots.device).reshape(batch, num, longest)
    return tree


def _budgeted(fresh, owner, valid, sources, budget, max_nodes):
    """The fresh tokens kept under ``budget``: mandatory nodes first, then optional ones by P, as many as pay."""
    batch, num, length = owner.shape
    # P of a node: the product along its path of each node's conditional c (read from the candidate
    # that created that node); every c <= 1, so P never grows along a path
    value = budget.acceptance.conditionals(sources, length).gather(1, owner).cumprod(dim=-1)
    mandatory = budget.is_mandatory(sources)
    # a node is mandatory when any candidate through it is (so a mandatory path's ancestors are too)
    flat_node = (owner * length + torch.arange(length, device=owner.device)).reshape(batch, -1)
    node_mand = torch.zeros(batch, num * length, dtype=torch.long, device=owner.device)
    node_mand.scatter_reduce_(1, flat_node, (mandatory[..., None] & valid).long().reshape(batch, -1), "amax")
    mand = node_mand.reshape(batch, num, length).bool() & fresh
    # rank: mandatory first (insertion order), then by P (ties: insertion order, so parents first)
    score = torch.where(mand, float("inf"), torch.where(fresh, value, float("-inf"))).reshape(batch, -1)
    ordered, order = torch.sort(score, dim=1, descending=True, stable=True)
    total = order.shape[1]
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(total, device=order.device).expand_as(order))
    mand_count = mand.sum((1, 2))
    steps = torch.arange(total, device=order.device)
    idx = mand_count[:, None] + steps
    room = idx < total
    if max_nodes is not None:  # the cap: the choice only weighs optional nodes that can enter
        room &= idx < max_nodes - 1
    optional = torch.where(room, ordered.gather(1, idx.clamp(max=total - 1)), float("-inf"))
    limit = mand_count + budget.choose(optional, (value * mand).sum((1, 2)), mand_count)
    if max_nodes is not None:
        limit = limit.clamp(max=max_nodes - 1)
    return fresh & (ranks.reshape(batch, num, length) < limit[:, None, None])


def tree_from_parents(
    roots: torch.Tensor,  # [batch] root token of each row (also used for filler nodes)
    rows_tokens: Sequence[Sequence[int]],  # per row: node tokens, node 0 = the root, parents before children
    rows_parents: Sequence[Sequence[int]],  # per row: parent of each node (-1 for the root)
    rows_depth: Sequence[Sequence[int]],  # per row: depth of each node (0 for the root)
    q: torch.Tensor | None = None,
) -> PackedTree:
    """Pack per-row node lists (already in topological order) into one :class:`PackedTree`.

    Siblings must hold distinct tokens (a trie): the verifier accepts the child equal to the
    target's choice, and two equal siblings would make that ambiguous.
    """
    width = max(map(len, rows_tokens))
    device = roots.device
    pad = [width - len(t) for t in rows_tokens]
    # one host-to-device copy per field; filler nodes: the row's root token (node 0), no parent, depth 0
    tokens_l = [list(t) + [t[0]] * k for t, k in zip(rows_tokens, pad)]
    parents_l = [list(p) + [-1] * k for p, k in zip(rows_parents, pad)]
    num_l = [len(t) for t in rows_tokens]
    depth_l = [list(d) + [0] * k for d, k in zip(rows_depth, pad)]
    # tokens, parents, depths and node counts: one copy to the device, [batch, 3 * width + 1]
    packed = torch.tensor([t + p + d + [n] for t, p, d, n in zip(tokens_l, parents_l, depth_l, num_l)],
                          dtype=torch.long, device=device)
    tokens, parents, depth = packed[:, :width], packed[:, width:2 * width], packed[:, 2 * width:3 * width]
    max_depth = max((max(d) for d in rows_depth if len(d)), default=0)
    mask = _ancestor_mask_on_host(rows_parents, width, device) if len(rows_tokens) * width <= HOST_PACK_TOKENS \
        else ancestor_mask(parents, max_depth)
    return PackedTree(tokens, parents, depth, packed[:, -1], mask, q=q, host=(tokens_l, parents_l, num_l),
                      _max_depth=max_depth)


def _ancestor_mask_on_host(rows_parents: Sequence[Sequence[int]], width: int, device) -> torch.Tensor:
    """:func:`ancestor_mask` from host parent lists in topological order (rows padded to ``width`` with filler):
    each node's ancestors-or-self as the bits of a Python int (its parent's bits plus its own), unpacked at once."""
    nbytes = (width + 7) // 8
    chunks = []
    for pars in rows_parents:
        seen: list[int] = []
        for v, p in enumerate(pars):
            seen.append((seen[p] if p >= 0 else 0) | (1 << v))
        seen.extend(1 << v for v in range(len(pars), width))  # filler: itself only
        chunks.append(b"".join(x.to_bytes(nbytes, "little") for x in seen))
    bits = np.frombuffer(b"".join(chunks), dtype=np.uint8).reshape(len(rows_parents), width, nbytes)
    return torch.from_numpy(np.unpackbits(bits, axis=-1, count=width, bitorder="little").view(np.bool_)).to(device)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[batch, nodes, nodes]`` bool, node ``i`` sees node ``j`` iff ``j`` is ``i`` or an ancestor of it.

    Pointer doubling on bitsets: each node's ancestors-or-self are the bits of ``ceil(nodes / 64)``
    int64 words; after round ``k`` a node holds its ancestors up to distance ``2**k``, so
    ``ceil(log2(max_depth))`` rounds of two small gathers (no host sync, no per-node work, nothing of
    ``nodes x nodes`` size until the bits are unpacked once). ``parents`` is ``[batch, nodes]`` with
    ``-1`` for the root and filler nodes.
    """
    batch, width = parents.shape
    words = (width + 63) // 64
    device = parents.device
    idx = torch.arange(width, device=device)
    jump = torch.where(parents >= 0, parents, idx)  # roots and filler point at themselves
    own = torch.zeros(width, words, dtype=torch.long, device=device)
    own[idx, idx // 64] = torch.ones_like(idx) << (idx % 64)  # bit 63 is the sign bit: still one bit
    bits = (own[jump] | own).reshape(batch, width * words)  # self and parent
    word = torch.arange(words, device=device)
    reach = 1
    while reach < max_depth:
        bits = bits | bits.gather(1, (jump[..., None] * words + word).reshape(batch, width * words))
        jump = jump.gather(1, jump)
        reach *= 2
    return _unpack_bits(bits.reshape(batch, width, words), width)


def _unpack_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., words]`` int64 bitsets (bit ``j`` of word ``w`` = column ``64 w + j``) -> ``[..., width]`` bool.

    Read through a byte view: on a CPU the words are put in little-endian byte order first (a no-op on
    x86 and ARM); accelerators are little-endian."""
    if bits.device.type == "cpu":
        words = bits.numpy()
        if sys.byteorder != "little":
            words = words.byteswap()
        out = np.unpackbits(words.view(np.uint8), axis=-1, count=width, bitorder="little")
        return torch.from_numpy(out.view(np.bool_))
    return _unpack_bits_on_device(bits, width)


def _unpack_bits_on_device(bits: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`_unpack_bits` in tensor operations (the accelerator path)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.view(torch.uint8)[..., None] >> shifts) & 1).bool().flatten(-2)[..., :width]
