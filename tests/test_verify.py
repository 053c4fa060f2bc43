"""The verifier's acceptance rules, tested alone against closed forms.

Multi-draft rejection sampling on trees: a Markov "target" ``P`` and "drafter" ``Q`` over a tiny
vocabulary (next token depends on the last one), trees whose nodes carry several children drawn
without replacement from ``Q``, decoded step by step with :func:`rejection_walk` until every row
has three tokens. A one-sample chi-square test compares the joint law of the three tokens with
the exact one, ``P[s, y1] P[y1, y2] P[y2, y3]``. A biased residual must be caught (mutation check).
"""

from __future__ import annotations

import pytest
import torch

from hf_paralleldecode.decoding import verify
from hf_paralleldecode.engine.tree import pack_trees
from hf_paralleldecode.engine.verify import rejection_walk, residual, verify_tree

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

V, NEW, ROWS, START = 4, 3, 12000, 0


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value; categories with zero probability must never be observed."""
    n = observed.sum()
    zero = expected_probs <= 0
    assert int(observed[zero].sum()) == 0, "an outcome the target gives zero probability was produced"
    exp = expected_probs[~zero] * n
    stat = ((observed[~zero] - exp) ** 2 / exp).sum()
    dof = (~zero).sum() - 1
    return float(torch.special.gammaincc(dof / 2.0, stat / 2.0))


def _sampled_children(Q, token, width, g):
    """``width`` tokens drawn without replacement from ``Q[token]`` (Gumbel top-k), in draw order."""
    keys = Q[token].log() - torch.empty(V).exponential_(generator=g).log()
    order = keys.argsort(descending=True)
    return [int(t) for t in order[:width] if Q[token, int(t)] > 0]


def _tree_paths(Q, root, width, depth, g):
    """Root-to-leaf token lists in depth-first order, siblings in draw order."""
    if depth == 0:
        return [[]]
    out = []
    for y in _sampled_children(Q, root, width, g):
        out += [[y] + rest for rest in _tree_paths(Q, y, width, depth - 1, g)]
    return out


def decode_markov(P, Q, width, depth, seed=0):
    """Every row decodes NEW tokens with trees verified by ``rejection_walk``; returns ``[ROWS, NEW]``."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    out = [[] for _ in range(ROWS)]
    while True:
        rows = [r for r in range(ROWS) if len(out[r]) < NEW]
        if not rows:
            break
        roots = torch.tensor([out[r][-1] if out[r] else START for r in rows])
        cands = [_tree_paths(Q, int(root), width, depth, g) for root in roots]
        tree = pack_trees(roots, cands)
        p, q = P[tree.tokens], Q[tree.tokens]  # [rows, nodes, V]: after node v, given v's token
        path, num, nxt = rejection_walk(tree, p, q)
        for i, r in enumerate(rows):
            toks = [int(tree.tokens[i, int(path[i, k])]) for k in range(1, int(num[i]) + 1)] + [int(nxt[i])]
            out[r] = (out[r] + toks)[:NEW]
    return torch.tensor(out)


def joint_pvalue(P, seqs):
    codes = (seqs * torch.tensor([V**2, V, 1])).sum(-1)
    observed = torch.bincount(codes, minlength=V**NEW).double()
    probs = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        for b in range(V):
            probs[a, b] = P[START, a] * P[a, b] * P[b]
    return chi_square_pvalue(observed, probs.reshape(-1))


def _markov(seed, sparse=False):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(V, V, generator=g, dtype=torch.float64) ** 2 + 0.02
    if sparse:  # top-k-like supports: the target and the drafter disagree on which tokens exist
        drop = torch.rand(V, V, generator=g) < 0.35
        drop[START] = False  # the start row keeps every token, so the joint law has many outcomes
        m[drop & (torch.arange(V)[None] != torch.arange(V)[:, None])] = 0
    return m / m.sum(-1, keepdim=True)


CASES = {
    "chain": dict(width=1, depth=3, sparse=False),
    "tree_w2_d2": dict(width=2, depth=2, sparse=False),
    "tree_w3_d2_sparse": dict(width=3, depth=2, sparse=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampling_on_trees_is_distributed_as_the_target(case):
    c = CASES[case]
    P, Q = _markov(1, c["sparse"]), _markov(2, c["sparse"])
    seqs = decode_markov(P, Q, c["width"], c["depth"])
    assert joint_pvalue(P, seqs) > 1e-3


@pytest.mark.slow
def test_a_biased_residual_is_caught(monkeypatch):
    """Mutation check: resampling from p instead of norm(max(p - q, 0)) after a rejection is detected."""
    P, Q = _markov(1), _markov(2)
    monkeypatch.setattr(verify, "residual", lambda r, q: r)
    seqs = decode_markov(P, Q, width=2, depth=2)
    assert joint_pvalue(P, seqs) < 1e-6


def test_residual_closed_form():
    r = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.25, 0.5, 0.0, 0.25]])
    torch.testing.assert_close(residual(r, q), torch.tensor([[0.25, 0.0, 0.2, 0.0]]) / 0.45)
    torch.testing.assert_close(residual(r, r), r)  # nothing left to remove: r itself


def test_equal_draft_and_target_accept_every_drafted_token():
    P = _markov(3)
    tree = pack_trees(torch.tensor([0, 1]), [[[1, 2, 3]], [[2, 0], [3]]])
    path, num, _ = rejection_walk(tree, P[tree.tokens], P[tree.tokens].clone())
    assert num[0] == 3  # q == p: min(1, p/q) = 1 on every node of a chain
    assert num[1] >= 1  # the first sibling is always accepted when q == p


def test_verdict_commits_accepted_tokens_then_the_bonus_for_each_rule():
    tree = pack_trees(torch.tensor([5, 5]), [[[1, 2], [3]], [[3, 4]]])
    scores = torch.full((2, tree.width, 8), -10.0)
    # greedy choices: after root -> 1, after node 1 -> 2, after node 2 -> 7 (bonus); row 1: root -> 6
    for row, node, tok in [(0, 0, 1), (0, 1, 2), (0, 2, 7), (1, 0, 6)]:
        scores[row, node, tok] = 10.0
    v = verify_tree(tree, scores, do_sample=False)
    assert v.num_accepted.tolist() == [2, 0]
    assert v.tokens[0, :3].tolist() == [1, 2, 7] and v.tokens[1, 0] == 6
    # sampling with near-one-hot p and q = p on the drafted tokens gives the same result
    q = torch.softmax(scores, -1)
    v2 = verify_tree(tree, scores * 10, do_sample=True, q=q)
    assert v2.tokens[0, :3].tolist() == [1, 2, 7] and v2.tokens[1, 0] == 6
