"""Best-first draft trees under the cumulative draft log-probability (JetSpec Algorithm 1, Eq. 15).

What it is for
    A learned drafter gives, for a node ``v`` of the tree, a list of children ``(token, log q)`` in
    the order they should be tried. :class:`TreeBuilder` grows one row's tree under a node budget
    ``B`` (drafted nodes, the root excluded), a width ``W`` (children per node) and a depth ``N``,
    scoring a node by ``s(pi(v)) = sum of log q`` along its branch. Children lists are produced
    lazily: the builder says which nodes it needs *evaluated* (:meth:`TreeBuilder.wanted`) and the
    drafter evaluates them for all rows at once (one draft-head forward for a causal head), which
    is what makes a branch-conditioned tree cost one head forward per wave instead of per node.

Two orders
    * ``exact=True`` (greedy decoding): exact best-first insertion with lazy siblings (DDTree):
      nodes enter in descending score order, so the tree is the top-``B`` set of branches under
      the score. A node's first child is considered only once the node is evaluated; a wave is
      run when an unevaluated node could still beat the best candidate.
    * ``exact=False`` (sampling; JetSpec Algorithm 1): pop the best unexpanded node and add
      *all* of its (up to ``W``) children at once. The number of children a node gets is then
      fixed before its children's values are seen, and siblings are a prefix of the drafter's
      without-replacement draws: the condition under which multi-draft rejection sampling
      (``verify.py``) is lossless. (Lazy siblings would make a sibling's presence depend on its
      own value and bias the output.)

What it deliberately does not know
    Where the children come from (a head, marginals, anything) or how the tree is verified.
"""

from __future__ import annotations

import heapq
import itertools

__all__ = ["TreeBuilder"]


class TreeBuilder:
    """One row's tree: ``tokens``, ``parents``, ``depth`` (node 0 = root), grown best-first."""

    def __init__(self, root: int, budget: int, width: int, max_depth: int, exact: bool):
        self.tokens, self.parents, self.depth, self.score = [root], [-1], [0], [0.0]
        self.budget, self.width, self.max_depth, self.exact = budget, width, max_depth, exact
        self.children: dict[int, list[tuple[int, float]]] = {}
        self.frozen: set[int] = set()  # nodes that may not be evaluated any more (wave cap)
        self.unevaluated: set[int] = {0} if max_depth > 0 else set()  # expandable nodes without children yet
        self._seq = itertools.count()
        self._heap: list = []
        if not exact:
            heapq.heappush(self._heap, (0.0, next(self._seq), 0))

    @property
    def drafted(self) -> int:
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def _add(self, parent: int, token: int, logq: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(self.score[parent] + logq)
        if self.depth[node] < self.max_depth:
            self.unevaluated.add(node)
        return node

    def _expandable(self, node: int) -> bool:
        return self.depth[node] < self.max_depth and node not in self.frozen

    def _pending(self) -> list[int]:
        """Inserted, expandable nodes whose children are not known yet."""
        return sorted(self.unevaluated)

    def give(self, node: int, children: list[tuple[int, float]]) -> None:
        """The drafter's children of ``node`` in try order: ``[(token, log q), ...]`` (at most ``W`` used)."""
        self.children[node] = children[: self.width]
        self.unevaluated.discard(node)
        if self.exact and self.children[node]:
            tok, lq = self.children[node][0]
            heapq.heappush(self._heap, (-(self.score[node] + lq), next(self._seq), node, 0))

    def freeze(self) -> None:
        """No more evaluations: unevaluated nodes stay leaves."""
        self.frozen.update(self.unevaluated)
        self.unevaluated.clear()

    def wanted(self) -> list[int]:
        """Grow as far as possible; return the nodes to evaluate next ([] when the tree is finished)."""
        if self.exact:
            return self._grow_exact()
        return self._grow_expand_all()

    def _grow_exact(self) -> list[int]:
        while self.drafted < self.budget:
            if self.unevaluated:
                best_pending = max(self.score[v] for v in self.unevaluated)
                if not self._heap or best_pending > -self._heap[0][0]:
                    return self._pending()
            if not self._heap:
                return []
            _, _, parent, k = heapq.heappop(self._heap)
            kids = self.children[parent]
            tok, lq = kids[k]
            self._add(parent, tok, lq)
            if k + 1 < len(kids):
                heapq.heappush(self._heap, (-(self.score[parent] + kids[k + 1][1]), next(self._seq), parent, k + 1))
        return []

    def _grow_expand_all(self) -> list[int]:
        while self.drafted < self.budget and self._heap:
            _, _, v = self._heap[0]
            if not self._expandable(v):
                heapq.heappop(self._heap)
                continue
            if v not in self.children:
                # evaluate every unexpanded node that could still be expanded within the budget
                room = self.budget - self.drafted
                queued = sorted(e for e in self._heap if e[2] not in self.children and self._expandable(e[2]))
                return [e[2] for e in queued[:room]]
            heapq.heappop(self._heap)
            for tok, lq in self.children[v]:
                if self.drafted == self.budget:
                    break
                u = self._add(v, tok, lq)
                heapq.heappush(self._heap, (-self.score[u], next(self._seq), u))
        return []
