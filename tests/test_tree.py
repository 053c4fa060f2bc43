"""Token trees: packing, greedy acceptance, and the general verifier driven by an oracle drafter."""

from __future__ import annotations

import pytest
import torch
from models import prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode.engine.run import start
from hf_paralleldecode.engine.tree import chain_tree, pack_trees
from hf_paralleldecode.engine.verify import walk_tree

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


def test_pack_trees_dedupes_prefixes_orders_topologically_and_builds_ancestor_masks():
    tree = pack_trees(torch.tensor([7, 9]), [[[1, 2, 3], [1, 2, 4], [5]], [[6]]])
    assert tree.tokens[0].tolist() == [7, 1, 2, 3, 4, 5]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 2, 0]
    assert tree.depth[0].tolist() == [0, 1, 2, 3, 3, 1]
    assert tree.num_nodes.tolist() == [6, 2]
    m = tree.mask[0].int()
    assert m[4].tolist() == [1, 1, 1, 0, 1, 0]  # node 4 sees root, 1, 2 and itself, not its sibling 3
    assert m[5].tolist() == [1, 0, 0, 0, 0, 1]
    assert tree.mask[1, 3].int().tolist() == [0, 0, 0, 1, 0, 0]  # filler sees only itself
    assert tree.path_tokens(0, 4) == [1, 2, 4]


def test_pack_trees_budget_and_validation():
    tree = pack_trees(torch.tensor([0]), [[[1, 2, 3], [4, 5]]], max_nodes=4)
    assert tree.tokens[0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="max_nodes"):
        pack_trees(torch.tensor([0]), [[[1]]], max_nodes=0)
    with pytest.raises(ValueError, match="rows"):
        pack_trees(torch.tensor([0, 1]), [[[1]]])


def test_walk_tree_walks_matching_children():
    tree = pack_trees(torch.tensor([7, 7]), [[[1, 2, 3], [1, 2, 4], [5]], [[1, 2, 3], [5]]])
    # choices after each node: root->1, 1->2, 2->4 (so the 2-4 branch), 4->8 (bonus)
    choices = torch.tensor([[1, 2, 4, 0, 8, 0], [5, 0, 0, 0, 9, 0]])
    path, num = walk_tree(tree, choices)
    assert num.tolist() == [3, 1]
    assert path[0].tolist() == [0, 1, 2, 4]
    assert path[1, :2].tolist() == [0, 4] and (path[1, 2:] == -1).all()


def test_chain_fast_path_agrees_with_the_general_walk():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 3, (5, 8), generator=g)
    widths = torch.tensor([8, 5, 1, 3, 8])
    choices = torch.randint(0, 3, (5, 8), generator=g)
    chain = chain_tree(tokens, widths)
    general = pack_trees(tokens[:, 0], [[tokens[b, 1 : int(widths[b])].tolist()] for b in range(5)])
    p1, n1 = walk_tree(chain, choices)
    p2, n2 = walk_tree(general, choices[:, : general.width])
    assert torch.equal(n1, n2)
    for b in range(5):
        assert p1[b, : int(n1[b]) + 1].tolist() == p2[b, : int(n2[b]) + 1].tolist()


def oracle_tree(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, reference=None, **model_kwargs):
    """Test drafter: per row, a wrong branch, a half-right branch and the right continuation (from ``reference``)."""
    run = start(model, "oracle_tree", input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                model_kwargs)
    prompt_len = input_ids.shape[1]
    while not run.log.done:
        run.drop_finished()
        if run.rows.numel() == 0:
            break
        roots, cands = [], []
        for r in run.rows.tolist():
            c = int(run.log.count[r])
            roots.append(int(run.log.tokens[r, c - 1]))
            right = reference[r, prompt_len + c : prompt_len + c + 4].tolist()
            wrong = [(t + 1) % 97 for t in right]
            cands.append([wrong[:2], right[:2] + wrong[2:3], right[:3] if c % 2 else right])
        budget = run.log.max_new_tokens - run.log.count[run.rows]
        tree = pack_trees(torch.tensor(roots), [[x[: int(b)] for x in cs] for cs, b in zip(cands, budget)])
        run.verify(tree)
    return run.result(bool(generation_config.return_dict_in_generate), 0.0)


@pytest.mark.parametrize("kwargs", [dict(), dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2)],
                         ids=["plain", "repetition_penalty", "no_repeat_ngram"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_tree_verifier_is_lossless_and_accepts_whole_branches(arch, kwargs):
    model = hfpd.enable(tiny_model(arch))
    ids, mask = prompts(3)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None, **kwargs)
    ref = model.generate(**gen)
    out = model.generate(**gen, custom_generate=oracle_tree, reference=ref, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.tokens_per_forward > 2.5  # whole right branches are accepted (3-5 tokens per forward)


def test_pack_trees_reports_the_node_of_every_candidate_token():
    tree = pack_trees(torch.tensor([7]), [[[1, 2, 3], [1, 2, 4], [5, 6]]], max_nodes=6)
    assert tree.candidate_nodes == [[[1, 2, 3], [1, 2, 4], [5]]]  # [5, 6] truncated by the budget


def _reference_trie(root, candidates, max_nodes):
    """Candidates inserted one by one into a trie, stopping at the budget (what pack_trees must equal)."""
    toks, pars, deps, children, cand_nodes = [root], [-1], [0], {}, []
    for cand in candidates:
        node, nodes = 0, []
        for t in cand:
            if (node, t) not in children:
                if max_nodes is not None and len(toks) >= max_nodes:
                    break
                children[(node, t)] = len(toks)
                toks.append(t), pars.append(node), deps.append(deps[node] + 1)
            node = children[(node, t)]
            nodes.append(node)
        cand_nodes.append(nodes)
    return toks, pars, deps, cand_nodes


def _random_candidates(seed: int, count: int, longest: int, budgets: list):
    """``count`` random packing cases ``(batch, roots, candidates, node budget)``: 1 to 4 rows of up to 5
    candidates of 0 to ``longest`` tokens from a 3-token alphabet (so prefixes are shared often)."""
    import random

    rng = random.Random(seed)
    for _ in range(count):
        batch = rng.randint(1, 4)
        cands = [[[rng.randrange(3) for _ in range(rng.randint(0, longest))] for _ in range(rng.randint(0, 5))]
                 for _ in range(batch)]
        roots = torch.tensor([rng.randrange(9) for _ in range(batch)])
        yield batch, roots, cands, rng.choice(budgets)


def test_vectorised_packing_equals_sequential_trie_insertion():
    for batch, roots, cands, budget in _random_candidates(seed=0, count=200, longest=6, budgets=[None, 1, 2, 3, 5, 8]):
        tree = pack_trees(roots, cands, budget)
        walk, num = walk_tree(tree, torch.randint(0, 3, tree.tokens.shape))  # runs on every shape
        assert walk.shape == (batch, tree.max_depth + 1) and num.shape == (batch,)
        for b in range(batch):
            toks, pars, deps, cand_nodes = _reference_trie(int(roots[b]), cands[b], budget)
            n = len(toks)
            assert int(tree.num_nodes[b]) == n
            assert (tree.tokens[b, :n].tolist(), tree.parents[b, :n].tolist(), tree.depth[b, :n].tolist()) == (
                toks, pars, deps)
            assert tree.candidate_nodes[b] == cand_nodes + [[]] * (len(tree.candidate_nodes[b]) - len(cand_nodes))
            assert (tree.parents[b, n:] == -1).all() and (tree.tokens[b, n:] == roots[b]).all()
            for i in range(tree.width):
                seen, j = {i}, i
                while i < n and pars[j] >= 0:
                    j = pars[j]
                    seen.add(j)
                assert set(tree.mask[b, i].nonzero().flatten().tolist()) == seen
        assert tree.max_depth == int(tree.depth.max())


def test_vectorised_walk_equals_a_per_depth_walk():
    import random

    rng = random.Random(1)
    for _ in range(200):
        cands = [[[rng.randrange(3) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(0, 4))]
                 for _ in range(3)]
        tree = pack_trees(torch.tensor([0, 1, 2]), cands)
        choices = torch.randint(0, 3, tree.tokens.shape)
        path, num = walk_tree(tree, choices)
        for b in range(3):
            node, expect = 0, [0]
            while True:
                kids = [v for v in range(int(tree.num_nodes[b])) if int(tree.parents[b, v]) == node
                        and int(tree.tokens[b, v]) == int(choices[b, node])]
                if not kids:
                    break
                node = kids[0]
                expect.append(node)
            assert int(num[b]) == len(expect) - 1
            assert path[b, : len(expect)].tolist() == expect and (path[b, len(expect):] == -1).all()


def test_host_walk_of_small_trees_equals_the_vectorised_walk(monkeypatch):
    import random

    from hf_paralleldecode.decoding import verify

    rng = random.Random(2)
    for _ in range(200):
        batch = rng.randint(1, 4)
        cands = [[[rng.randrange(3) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(0, 4))]
                 for _ in range(batch)]
        tree = pack_trees(torch.tensor([rng.randrange(3) for _ in range(batch)]), cands)
        scores = torch.randn(batch, tree.width, 3)
        monkeypatch.setattr(verify, "HOST_WALK_NODES", 10**9)
        host = verify.verify_tree(tree, scores, False)
        monkeypatch.setattr(verify, "HOST_WALK_NODES", 0)
        vec = verify.verify_tree(tree, scores, False)
        assert torch.equal(host.path, vec.path) and torch.equal(host.num_accepted, vec.num_accepted)
        for b in range(batch):
            n = int(vec.num_accepted[b]) + 1
            assert host.tokens[b, :n].tolist() == vec.tokens[b, :n].tolist()


def test_host_packing_of_small_trees_equals_the_vectorised_packing(monkeypatch):
    """Small trees are packed in Python (a trie of dicts, a bitset ancestor mask); every field must equal the
    vectorised packing's, budget cuts and empty rows included."""
    from hf_paralleldecode.decoding import tree as tree_mod

    for _, roots, cands, budget in _random_candidates(seed=3, count=300, longest=7, budgets=[None, 1, 2, 3, 5, 8, 40]):
        monkeypatch.setattr(tree_mod, "HOST_PACK_TOKENS", 10**9)
        host = pack_trees(roots, cands, budget)
        monkeypatch.setattr(tree_mod, "HOST_PACK_TOKENS", -1)
        vec = pack_trees(roots, cands, budget)
        for field in ("tokens", "parents", "depth", "num_nodes", "mask", "candidate_index", "candidate_fresh"):
            a, b = getattr(host, field), getattr(vec, field)
            assert (a is None) == (b is None), field
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), field
        assert host.max_depth == vec.max_depth and host.candidate_nodes == vec.candidate_nodes


def test_host_ancestor_mask_equals_pointer_doubling_on_deep_wide_trees():
    import random

    from hf_paralleldecode.engine.tree import _ancestor_mask_on_host, ancestor_mask

    rng = random.Random(4)
    for width in (1, 7, 8, 9, 70, 130):
        rows = []
        for _ in range(3):
            n = rng.randint(1, width)
            rows.append([-1] + [rng.randrange(v) for v in range(1, n)])  # parents before children
        padded = torch.tensor([p + [-1] * (width - len(p)) for p in rows])
        assert torch.equal(_ancestor_mask_on_host(rows, width, "cpu"), ancestor_mask(padded, width))


def test_ancestor_mask_equals_a_parent_walk_across_bitset_word_boundaries():
    import random

    from hf_paralleldecode.engine.tree import _unpack_bits, _unpack_bits_on_device, ancestor_mask

    rng = random.Random(5)
    assert ancestor_mask(torch.zeros(0, 70, dtype=torch.long) - 1, 70).shape == (0, 70, 70)  # an empty batch
    for width in (1, 2, 63, 64, 65, 127, 128, 129, 200):
        rows = [[-1] + list(range(width - 1))]  # one chain as deep as the tree is wide
        for _ in range(3):
            n = rng.randint(1, width)
            rows.append([-1] + [rng.randrange(max(0, v - 3), v) for v in range(1, n)])  # deep, some branching
        padded = torch.tensor([p + [-1] * (width - len(p)) for p in rows])
        mask = ancestor_mask(padded, width)
        assert mask.shape == (len(rows), width, width) and mask.dtype == torch.bool
        for b, pars in enumerate(padded.tolist()):
            for i in range(width):
                seen, j = {i}, i
                while pars[j] >= 0:
                    j = pars[j]
                    seen.add(j)
                assert set(mask[b, i].nonzero().flatten().tolist()) == seen
        # the accelerator's unpacking gives the same bits as the CPU's
        bits = torch.tensor([[rng.getrandbits(64) - (1 << 63) for _ in range((width + 63) // 64)] for _ in range(5)])
        assert torch.equal(_unpack_bits(bits, width), _unpack_bits_on_device(bits, width))


def test_root_tree_is_a_one_node_chain_whose_structure_is_built_once_per_batch_size():
    from hf_paralleldecode.engine.tree import root_tree

    a, b = root_tree(torch.tensor([5, 6, 7])), root_tree(torch.tensor([8, 9, 10]))
    ref = chain_tree(torch.tensor([[5], [6], [7]]), torch.ones(3, dtype=torch.long))
    for field in ("tokens", "parents", "depth", "num_nodes", "mask"):
        assert torch.equal(getattr(a, field), getattr(ref, field)), field
    assert a.is_chain and a.max_depth == 0 and a.width == 1 and b.parents is a.parents
    assert b.tokens[:, 0].tolist() == [8, 9, 10]
