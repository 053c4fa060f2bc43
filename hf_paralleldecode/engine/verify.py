"""Acceptance: the one module that decides which drafted tokens a step commits, for every drafter.

Glossary (one notation everywhere, vLLM style)
    ``p``         the target's distribution after a node (its logits after the user's processors).
    ``q``         the distribution a drafter *sampled* a node's children from (after the same
                  processors, applied along that node's own path); only learned drafters carry it.
    root          node 0 of each row's tree: the last committed token (its KV is not cached yet).
    accepted      drafted tokens on the path from the root that pass the rule below.
    bonus token   the target's token after the last accepted node when that node has no child
                  left to try (a leaf): a draw from ``p`` (greedy: its argmax).
    recovered     the token drawn from the final residual when every child of the last accepted
                  node was rejected (rejection sampling only; greedy/matching call it bonus too).
    A step commits ``accepted + 1`` tokens: the accepted ones, then the bonus / recovered token.

The three rules (:func:`verify_tree` picks one; nothing else accepts tokens)
    * greedy (``do_sample=False``): descend into the child whose token equals ``argmax p``; the
      argmax at the last accepted node is the bonus token. Output = ``generate(do_sample=False)``
      (token for token in fp32; in bf16 / fp16 the many-token forward can flip a near-tied argmax).
    * sample-then-match (``do_sample=True``, drafts without ``q``: Jacobi blocks, n-grams): draw
      one token from ``p`` at every node and descend into the child holding it. Every committed
      token is a draw from ``p`` given its exact prefix, so the output is distributed as stock
      sampling.
    * multi-draft rejection sampling (``do_sample=True``, drafts with ``q``: draft heads; diffusion
      drafters are planned): at the current node with residual ``r`` (initially ``p``), try the
      children in the order they were drawn (without replacement) from ``q``: accept child ``y``
      with probability ``min(1, r(y) / q(y))``; on rejection ``r <- norm(max(r - q, 0))`` and
      ``q <- q`` with ``y`` removed (renormalised), then try the next sibling. When every child is
      rejected the recovered token is drawn from ``r``; a leaf's bonus token is drawn from ``p``.
      This is recursive rejection sampling without replacement: lossless *provided* the children
      of a node are a prefix of a without-replacement sample from its ``q`` whose length does not
      depend on the children's own values (the draft-head tree builder guarantees both).

Shapes
    ``tokens``/``parents``/``depth`` ``[batch, nodes]`` (the :class:`~.tree.PackedTree`),
    ``scores`` (processed target logits) ``[batch, nodes, vocab]``,
    ``q`` ``[batch, nodes, vocab]``: ``q[b, v]`` is the distribution node ``v``'s children were drawn from.
    Results: ``path`` ``[batch, max_depth + 1]`` accepted nodes from the root (``-1`` past the end),
    ``num_accepted`` ``[batch]``, ``tokens`` ``[batch, max_depth + 1]``: the committed tokens
    (the first ``num_accepted + 1`` of each row are valid).

What it deliberately does not know
    Where drafts come from, the KV cache, and how committed tokens are emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Verdict", "verify_tree", "walk_tree", "rejection_walk", "match_prefix", "residual"]


#: below this many scores (a few rows of a vocabulary) ``argmax`` itself is faster than :func:`greedy_argmax`'s several
#: small operations (this project's CPU: 9 against 29 us for one row of 8k, even at about 10 rows)
SMALL_ARGMAX = 1 << 16


def greedy_argmax(scores: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``scores.argmax(-1)``, the same indices (first maximum; a NaN counts as the maximum), faster on CPUs.

    torch's CPU argmax over a long last dimension runs at a fraction of the memory bandwidth, while
    ``amax`` is vectorised: the maximum of each ``block`` of the vocabulary picks the first block that
    holds the row's maximum, and an argmax inside that block finishes (5 to 6x faster for vocabularies
    of 8k to 150k on this project's CPU). Small vocabularies, fewer than :data:`SMALL_ARGMAX` scores (a plain step of
    a few rows) and other devices take ``argmax``.
    """
    vocab = scores.shape[-1]
    if scores.device.type != "cpu" or vocab < 4 * block or not scores.is_floating_point() or scores.numel() < SMALL_ARGMAX:
        return scores.argmax(-1)
    lead = scores.shape[:-1]
    flat = scores.reshape(-1, vocab)
    main = vocab - vocab % block
    blocks = flat[:, :main].reshape(flat.shape[0], main // block, block)
    block_max = blocks.amax(-1)  # [n, blocks]
    which = block_max.argmax(-1)  # first block holding the row's maximum (or its first NaN)
    index = which * block + blocks[torch.arange(flat.shape[0], device=flat.device), which].argmax(-1)
    if main < vocab:  # the tail past the last whole block: it wins only with a strictly larger value (or a NaN)
        best = block_max.gather(1, which[:, None]).squeeze(1)
        tail_max, tail_index = flat[:, main:].max(-1)
        wins = (tail_max > best) | (tail_max.isnan() & ~best.isnan())
        index = torch.where(wins, tail_index + main, index)
    return index.reshape(lead)


@dataclass
class Verdict:
    """What one verification decided, per active row."""

    path: torch.Tensor  # [batch, max_depth + 1] accepted nodes from the root, -1 past the end
    num_accepted: torch.Tensor  # [batch] accepted drafted tokens (the step commits one more)
    tokens: torch.Tensor  # [batch, max_depth + 1] committed tokens (first num_accepted + 1 valid)
    choices: torch.Tensor  # [batch, nodes] the target's token after every node (greedy / matching);
    #                        under rejection sampling, the argmax of p off the accepted path
    host: tuple[list[list[int]], list[int], list[list[int]]] | None = None  # (path, num_accepted, tokens) as
    #                        host lists, when the walk ran on the host (readers then need no copy back)
    check: torch.Tensor | None = None  # the step's boundary check (engine/contract.py), not read yet: read with the
    #                        verdict's own values (nonzero: the proposal broke the contract)
    check_failed: bool = False  # the check, read with the host lists
    host_nums: list[int] | None = None  # num_accepted as host ints, once read (a verdict walked on the device)
    host_tokens: list[list[int]] | None = None  # tokens as host lists, once read (a verdict walked on the device)

    def read(self) -> None:
        """Read a verdict walked on the device: ``num_accepted``, ``tokens`` and the step's :attr:`check`, in one
        transfer (into ``host_nums``, ``host_tokens``, ``check_failed``). The engine reads it at the commit; a
        verdict walked on the host holds them already."""
        if self.host is not None or self.host_nums is not None:
            return
        rows, self.check_failed = _read_with(torch.cat([self.num_accepted[:, None], self.tokens], dim=1), self.check)
        self.host_nums, self.host_tokens = [r[0] for r in rows], [r[1:] for r in rows]

    @property
    def nums(self) -> list[int]:
        """``num_accepted`` as host ints (read once with the verdict: :meth:`read`)."""
        if self.host is not None:
            return self.host[1]
        self.read()
        return self.host_nums

    @property
    def committed(self) -> list[list[int]]:
        """``tokens`` as host lists (each row's first ``num_accepted + 1`` are committed; read once: :meth:`read`)."""
        if self.host is not None:
            return self.host[2]
        self.read()
        return self.host_tokens


def match_prefix(
    guesses: torch.Tensor,  # [batch, k] guessed tokens at positions 1..k of the fed block
    choices: torch.Tensor,  # [batch, k] target's choice (greedy or sampled) for those same positions
    num_guesses: torch.Tensor,  # [batch] how many of the k guesses are real (the rest is filler)
) -> torch.Tensor:
    """Number of leading guesses equal to the target's choice, per row (``[batch]``, long)."""
    cols = torch.arange(guesses.shape[1], device=guesses.device)
    match = (guesses == choices) & (cols[None, :] < num_guesses[:, None])
    return match.long().cumprod(dim=1).sum(dim=1)


def walk_tree(tree, choices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk each row's tree along the target's choices (greedy argmax or samples, one per node).

    Returns ``path`` ``[batch, max_depth + 1]`` and ``num_accepted`` ``[batch]`` (see module docstring);
    the bonus token is ``choices[row, path[row, num_accepted]]``.
    """
    batch = choices.shape[0]
    device = choices.device
    if tree.is_chain:  # fast path: leading matches of a single path
        num = match_prefix(tree.tokens[:, 1:], choices[:, :-1], tree.num_nodes - 1)
        idx = torch.arange(tree.width, device=device)[None]
        return torch.where(idx <= num[:, None], idx, -1), num
    # A node is accepted when its token and every ancestor's token (below the root) equal the target's
    # choice after their parent: one pass over the ancestor-or-self mask, no per-depth host sync.
    # Siblings hold distinct tokens (a trie), so at most one node per depth is accepted: the path.
    real = tree.real
    ok = (tree.tokens == choices.gather(1, tree.parents.clamp(min=0))) & real
    ok[:, 0] = True  # the root
    accepted = ~(tree.mask & ~ok[:, None, :]).any(-1) & real  # [batch, nodes]
    num = accepted.sum(1) - 1
    depth_slots = tree.max_depth + 1
    node_ids = torch.arange(tree.width, device=device).expand(batch, -1)
    slot = torch.where(accepted, tree.depth, depth_slots)  # rejected nodes go to a dropped extra column
    path = torch.full((batch, depth_slots + 1), -1, dtype=torch.long, device=device)
    path.scatter_(1, slot, torch.where(accepted, node_ids, -1))
    return path[:, :depth_slots], num


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(r - q, 0))`` per row (``[n, vocab]``); rows where it vanishes (``r == q``) keep ``r``."""
    res = (r - q).clamp_(min=0)
    total = res.sum(-1, keepdim=True)
    return torch.where(total > 0, res / total.clamp(min=1e-30), r)


def _remove(q: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``q`` with ``token`` removed and renormalised (``q [n, vocab]``, ``token [n]``)."""
    q = q.scatter(1, token[:, None], 0.0)
    total = q.sum(-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp(min=1e-30), q)


def rejection_walk(tree, p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft rejection sampling down each row's tree (see module docstring).

    Args:
        tree (PackedTree): the packed trees that were fed; siblings are tried in node order (their draw order).
        p: ``[batch, nodes, vocab]`` target probabilities after every node.
        q: ``[batch, nodes, vocab]`` draft probabilities each node's children were drawn from.

    Returns ``path``, ``num_accepted`` and ``next_token`` ``[batch]`` (the bonus / recovered token).
    """
    batch, width, _ = p.shape
    device = p.device
    real = tree.real
    rows = torch.arange(batch, device=device)
    node_idx = torch.arange(width, device=device)[None]
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    going = torch.ones(batch, dtype=torch.bool, device=device)
    num = torch.zeros(batch, dtype=torch.long, device=device)
    path = [cur.clone()]
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    while bool(going.any()):
        r = p[rows, cur].clone()  # [batch, vocab] residual at the current node
        qc = q[rows, cur].clone()
        children = (tree.parents == cur[:, None]) & real & going[:, None]  # [batch, nodes]
        rank = children.long().cumsum(1)
        accepted_child = torch.full((batch,), -1, dtype=torch.long, device=device)
        for k in range(1, int(rank.max()) + 1 if children.any() else 1):
            is_k = children & (rank == k)
            trying = is_k.any(1) & (accepted_child < 0)
            if not bool(trying.any()):
                break
            child = torch.where(is_k, node_idx, width).min(1).values.clamp(max=width - 1)  # [batch]
            y = tree.tokens[rows, child]
            ry, qy = r.gather(1, y[:, None]).squeeze(1), qc.gather(1, y[:, None]).squeeze(1)
            accept_prob = torch.where(qy > 0, (ry / qy.clamp(min=1e-30)).clamp(max=1.0), (ry > 0).float())
            ok = trying & (torch.rand(batch, device=device) < accept_prob)
            accepted_child = torch.where(ok, child, accepted_child)
            rejected = trying & ~ok
            r = torch.where(rejected[:, None], residual(r, qc), r)
            qc = torch.where(rejected[:, None], _remove(qc, y), qc)
        stop = going & (accepted_child < 0)
        if bool(stop.any()):
            draw = torch.multinomial(r, 1).squeeze(1)
            next_token = torch.where(stop, draw, next_token)
        moved = going & (accepted_child >= 0)
        cur = torch.where(moved, accepted_child, cur)
        num += moved.long()
        going = moved
        path.append(torch.where(moved, cur, -1))
    return torch.stack(path, dim=1), num, next_token


#: trees of at most this many nodes (all rows) are walked in Python on host lists: one copy of the
#: few small tensors beats the dozens of tiny tensor operations of the vectorised walk (``walk_tree``)
HOST_WALK_NODES = 256


def _read_with(values: torch.Tensor, check: torch.Tensor | None) -> tuple[list, bool]:
    """``values`` as host lists and whether ``check`` (a boundary check's flag, or ``None``) is set: one read."""
    if check is None:
        return values.tolist(), False
    flat = torch.cat([values.reshape(-1).to(torch.long), check.reshape(1).to(torch.long)]).tolist()
    out = flat[:-1]
    for size in reversed(values.shape[1:]):
        out = [out[i:i + size] for i in range(0, len(out), size)]
    return out, bool(flat[-1])


def _walk_on_host(tree, choices: torch.Tensor, check: torch.Tensor | None = None) -> Verdict:
    """:func:`walk_tree` + the committed tokens for a small tree, in Python (greedy / sample-then-match); the tree's
    own host lists when it has them (one read: the choices)."""
    batch = choices.shape[0]
    device = choices.device
    depth_slots = tree.max_depth + 1
    if tree.host is not None:
        tokens_l, parents_l, nodes_l = tree.host
        choices_l, failed = _read_with(choices, check)
    else:
        (tokens_l, parents_l, choices_l), failed = _read_with(torch.stack([tree.tokens, tree.parents, choices]),
                                                              check)
        nodes_l = tree.num_nodes.tolist()
    paths, nums, committed = [], [], []
    for b in range(batch):
        toks, pars, ch = tokens_l[b], parents_l[b], choices_l[b]
        children: dict[tuple[int, int], int] = {}
        for v in range(1, nodes_l[b]):
            children.setdefault((pars[v], toks[v]), v)  # siblings hold distinct tokens (PackedTree's invariant)
        node, path = 0, [0]
        while (node, ch[node]) in children:
            node = children[(node, ch[node])]
            path.append(node)
        nums.append(len(path) - 1)
        committed.append([toks[v] for v in path[1:]] + [ch[node]] + [0] * (depth_slots - len(path)))
        paths.append(path + [-1] * (depth_slots - len(path)))
    # path, tokens and counts in one copy to the device: [batch, 2 * depth_slots + 1]
    packed = torch.tensor([p + c + [n] for p, c, n in zip(paths, committed, nums)], dtype=torch.long, device=device)
    return Verdict(path=packed[:, :depth_slots], num_accepted=packed[:, -1], tokens=packed[:, depth_slots:-1],
                   choices=choices, host=(paths, nums, committed), check_failed=failed)


def sample_by_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per distribution (``probs [..., vocab]``) by inverse CDF from ``uniforms [...]`` in ``[0, 1)``: the
    first token whose cumulative probability exceeds ``u`` times the total (never a token of zero probability)."""
    cdf = probs.cumsum(-1)
    value = (uniforms.to(cdf.dtype) * cdf[..., -1])[..., None]
    return torch.searchsorted(cdf, value, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _root_only(scores, do_sample: bool, choices, uniforms, check: torch.Tensor | None = None) -> Verdict:
    """The verdict of a tree of one node per row: the root's next token is committed (greedy: the argmax; sampled: a
    draw from ``p``, by inverse CDF from ``uniforms`` when given). A draft probability ``q`` plays no part: no node
    was drafted."""
    if choices is None:
        if do_sample:
            probs = torch.softmax(scores[:, 0], dim=-1)
            if uniforms is not None:
                token = sample_by_uniforms(probs, uniforms[:, 0])
            else:
                token = torch.multinomial(probs, 1).squeeze(1)
            choices = token[:, None]
        else:
            choices = greedy_argmax(scores)
    batch = choices.shape[0]
    zeros = torch.zeros(batch, dtype=torch.long, device=choices.device)
    committed, failed = _read_with(choices[:, :1], check)
    return Verdict(path=zeros[:, None], num_accepted=zeros, tokens=choices[:, :1], choices=choices,
                   host=([[0]] * batch, [0] * batch, committed), check_failed=failed)


def verify_tree(tree, scores: torch.Tensor | None, do_sample: bool, q: torch.Tensor | None = None,
                choices: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                check: torch.Tensor | None = None) -> Verdict:
    """Apply the rule that fits (greedy / sample-then-match / rejection sampling) to one packed tree.

    ``scores`` ``[batch, nodes, vocab]`` are the target's processed scores; ``q`` the drafter's
    probabilities (sampling only; ignored when greedy, where acceptance is exact match). A greedy
    step may pass the target's ``choices`` ``[batch, nodes]`` (its argmax) instead of ``scores``. A sampled step
    without ``q`` may pass ``uniforms`` ``[batch, nodes]``: each node's sample is then drawn by inverse CDF from its
    uniform (:func:`sample_by_uniforms`) instead of ``torch.multinomial``. ``check``: a boundary check's flag on the
    device (:func:`~.contract.check_tree`), read with the verdict's host lists (``Verdict.check_failed``) or left for
    the commit to read (``Verdict.check``).
    """
    if choices is not None and do_sample:
        raise ValueError("verify_tree: choices stand for a greedy step's scores; sampling needs the scores.")
    if tree.width == 1:  # a plain step (each row's root alone): the target's token after it, nothing to walk
        return _root_only(scores, do_sample, choices, uniforms, check)
    if do_sample and q is not None:
        probs = torch.softmax(scores, dim=-1)
        path, num, nxt = rejection_walk(tree, probs, q)
        choices = scores.argmax(-1)
    else:
        if do_sample:
            probs = torch.softmax(scores, dim=-1)  # [batch, nodes, vocab]
            if uniforms is not None:
                choices = sample_by_uniforms(probs, uniforms)
            else:
                choices = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(probs.shape[:2])
        elif choices is None:
            choices = greedy_argmax(scores)  # [batch, nodes]
        if not tree.is_chain and choices.numel() <= HOST_WALK_NODES:
            return _walk_on_host(tree, choices, check)
        path, num = walk_tree(tree, choices)
        nxt = choices.gather(1, path.gather(1, num[:, None]).clamp(min=0)).squeeze(1)
    # committed tokens: the accepted nodes' tokens (below the root), then the bonus / recovered token
    idx = path.clamp(min=0)
    tokens = tree.tokens.gather(1, idx)[:, 1:]
    tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], 1)], dim=1)
    tokens.scatter_(1, num[:, None], nxt[:, None])
    if do_sample and q is not None:  # on the accepted path, the choice after a node is the committed token
        valid = path >= 0
        choices = choices.scatter(1, idx, torch.where(valid, tokens, tokens[:, :1]))
    return Verdict(path=path, num_accepted=num, tokens=tokens, choices=choices, check=check)
