"""SlotCache: per-row committed slots, tree-shaped keeps, cropping and compaction stay exact."""

from __future__ import annotations

import pytest
import torch
from models import prompts, tiny_model
from transformers import DynamicCache

from hf_paralleldecode.compat import cache_kwargs
from hf_paralleldecode.engine.cache import SlotCache

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

# A 4-node tree: 0 is the root (last committed token), 1 and 2 are children of 0, 3 a child of 2.
PARENT = [-1, 0, 0, 2]
DEPTH = [0, 1, 1, 2]


def tree_mask() -> torch.Tensor:
    mask = torch.eye(4, dtype=torch.bool)
    for node in range(4):
        p = PARENT[node]
        while p >= 0:
            mask[node, p] = True
            p = PARENT[p]
    return mask


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of a plain forward over the whole sequence, no cache."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def _prefilled(model):
    """Two rows (the second left-padded by 2) fed to ``model``: ``(ids, mask, cache, slots)``."""
    ids, mask = prompts(2, length=6, pad_left=(0, 2))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache),
              position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    return ids, mask, cache, SlotCache(cache, mask.bool(), dtype=torch.float32)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("compact", [False, True])
def test_tree_keep_then_continue_matches_full_recompute(arch, compact):
    model = tiny_model(arch)
    ids, mask, cache, slots = _prefilled(model)
    nodes = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    positions = slots.num_valid[:, None] + torch.tensor(DEPTH)[None]
    with torch.no_grad():
        model(input_ids=nodes, position_ids=positions, attention_mask=slots.attention_mask(tree_mask()),
              use_cache=True, **cache_kwargs(model, cache))
    keep = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)  # row 0: path 0-2-3, row 1: 0-1
    slots.commit(keep)
    assert cache.get_seq_length() == slots.num_slots == 6 + 3  # trailing column cropped
    if compact:
        slots.compact()
        assert slots.num_slots == int(slots.num_valid.max())
    nxt = torch.tensor([[30], [40]])
    with torch.no_grad():
        out = model(input_ids=nxt, position_ids=slots.num_valid[:, None],
                    attention_mask=slots.attention_mask(torch.ones(1, 1, dtype=torch.bool)),
                    use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
        paths = [[10, 12, 13, 30], [20, 21, 40]]
        for row in range(2):
            prompt = ids[row][mask[row] == 1].tolist()
            torch.testing.assert_close(out[row], full_logits(model, prompt + paths[row]), rtol=1e-4, atol=1e-4)


def test_prefix_keeps_need_no_gather_and_batch_one_has_no_holes():
    model = tiny_model("llama")
    ids, mask = prompts(1, length=5)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    slots = SlotCache(cache, mask.bool(), dtype=torch.float32)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), position_ids=torch.arange(5, 9)[None],
              attention_mask=slots.attention_mask(torch.ones(4, 4, dtype=torch.bool).tril()),
              use_cache=True, **cache_kwargs(model, cache))
    slots.commit(torch.tensor([[1, 1, 0, 0]], dtype=torch.bool))
    assert cache.get_seq_length() == 7 and bool(slots.valid.all())


def test_attention_mask_is_additive_in_model_dtype_and_never_empty():
    valid = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    slots = SlotCache(DynamicCache(), valid, dtype=torch.bfloat16)
    m = slots.attention_mask(torch.ones(2, 2, dtype=torch.bool).tril())
    assert m.shape == (2, 1, 2, 5) and m.dtype == torch.bfloat16
    assert m[0, 0, 0, 0] == torch.finfo(torch.bfloat16).min and m[0, 0, 0, 1] == 0
    assert (m == 0).any(-1).all()  # every query attends to something


def test_commit_from_host_lists_equals_commit_from_the_keep_table():
    """``commit_kept`` (host lists, no device read) leaves the same KV, valid table and compactions as ``commit``."""
    import random

    rng = random.Random(7)
    compacted = 0
    for trial in range(40):
        batch, heads, dim = rng.randint(1, 4), 2, 3
        start = torch.rand(batch, rng.randint(1, 5)) > 0.3
        start[:, -1] = True
        caches = []
        for _ in range(2):
            cache = DynamicCache()
            g = torch.Generator().manual_seed(trial)
            k = torch.randn(batch, heads, start.shape[1], dim, generator=g)
            cache.update(k, k + 1, 0)
            slots = SlotCache(cache, start, torch.float32)
            slots.compact_min_holes = 2
            caches.append(slots)
        for step in range(6):
            width = rng.randint(1, 6)
            g = torch.Generator().manual_seed(100 * trial + step)
            k = torch.randn(batch, heads, width, dim, generator=g)
            kept = []
            for _ in range(batch):
                nodes = [0] + sorted(rng.sample(range(1, width), rng.randint(0, width - 1)))
                kind = rng.random()  # scattered, a prefix, or (rarely) nothing kept
                kept.append(nodes if kind < 0.45 else list(range(len(nodes))) if kind < 0.9 else [])
            keep = torch.zeros(batch, width, dtype=torch.bool)
            for b, nodes in enumerate(kept):
                keep[b, nodes] = True
            for slots in caches:
                slots.cache.update(k, k + 1, 0)
            caches[0].commit(keep)
            caches[1].commit_kept(kept, width)
            a, b = caches
            assert torch.equal(a.valid, b.valid) and a.num_compactions == b.num_compactions
            assert b.host_num_valid() == a.num_valid.tolist()
            la, lb = a.cache.layers[0], b.cache.layers[0]
            assert torch.equal(la.keys[a.valid[:, None, :, None].expand_as(la.keys)],
                               lb.keys[b.valid[:, None, :, None].expand_as(lb.keys)])
        compacted += a.num_compactions > 0
    assert compacted  # holes were compacted on the way in some trials


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_chain_after_holes_and_padding_is_fed_with_the_2d_padding_mask(arch):
    """A chain (a plain step, a Jacobi block) attends causally: the 2D mask of valid slots plus the new ones gives
    the logits of a full recompute over each row's real tokens, holes and left padding included; with every slot
    valid there is no mask at all (as stock passes none)."""
    model = tiny_model(arch)
    ids, mask, cache, slots = _prefilled(model)
    assert slots.padding_mask(3) is not None and slots.padding_mask(3).shape == (2, 6 + 3)
    nodes = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    with torch.no_grad():
        model(input_ids=nodes, position_ids=slots.num_valid[:, None] + torch.tensor(DEPTH)[None],
              attention_mask=slots.attention_mask(tree_mask()), use_cache=True, **cache_kwargs(model, cache))
    slots.commit(torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool))  # row 1 leaves a hole
    chain = torch.tensor([[30, 31], [40, 41]])
    with torch.no_grad():
        out = model(input_ids=chain, position_ids=slots.num_valid[:, None] + torch.arange(2)[None],
                    attention_mask=slots.padding_mask(2), use_cache=True, **cache_kwargs(model, cache)).logits
    paths = [[10, 12, 13, 30, 31], [20, 21, 40, 41]]
    for row in range(2):
        prompt = ids[row][mask[row] == 1].tolist()
        torch.testing.assert_close(out[row, -1], full_logits(model, prompt + paths[row]), rtol=1e-4, atol=1e-4)
    one = SlotCache(DynamicCache(), torch.ones(1, 4, dtype=torch.bool), dtype=torch.float32)
    assert one.padding_mask(1) is None
