"""Lookahead decoding: exact equivalence with stock greedy generate, edges and bad settings."""

from __future__ import annotations

import pytest
import torch
from models import RecordingStreamer, enabled, prompts

from hf_paralleldecode.engine.ngram_pool import NgramPool

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


def test_repetitive_text_is_found_in_the_pool():
    """A model stuck in a cycle is where n-grams pay off: TPF well above 1, output still exact."""
    model = enabled("llama")
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False, eos_token_id=None)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="lookahead", adaptive=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats["pool_entries"] > 0
    assert out.tokens_per_forward > 1.5


def test_streamer_and_stats():
    model = enabled("llama")
    ids, _ = prompts(1)
    rec = RecordingStreamer()
    out = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None, decoding="lookahead",
                         streamer=rec, return_dict_in_generate=True)
    assert rec.ended == 1 and torch.equal(torch.cat([v.reshape(-1) for v in rec.values[1:]]), out.sequences[0, 7:])
    assert out.decoding == "lookahead" and out.stats["window_size"] == 5


def test_ngram_pool_is_lru_per_key():
    pool = NgramPool(1, max_per_key=2)
    pool.add(0, 5, [1, 2])
    pool.add(0, 5, [3, 4])
    pool.add(0, 5, [1, 2])  # refresh
    pool.add(0, 5, [6, 7])  # evicts (3, 4)
    assert pool.get(0, 5) == [(6, 7), (1, 2)]
    pool.add_sequence(0, [9, 8, 9, 8], 3)
    assert pool.get(0, 9) == [(8, 9)] and pool.get(0, 8) == [(9, 8)]
    assert pool.size(0) == 4 and pool.get(0, 42) == []


def test_ngram_pool_windows_match_a_plain_lru_of_tuples():
    """``add_windows`` (continuations stored as int64 bytes) against a reference LRU of tuples: same entries,
    same order, after random chains with start / stop offsets, tail windows, refreshes and evictions, and
    token ids past 2**31."""
    import random

    rng = random.Random(0)
    for cap in (1, 2, 4):
        pool, ref = NgramPool(2, max_per_key=cap), [{}, {}]
        for _ in range(60):
            row, n = rng.randrange(2), rng.choice([2, 3, 8, 64])
            vocab = rng.choice([3, 50, 2**40])
            seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
            start = rng.randint(0, 2)
            stop = rng.choice([None, max(len(seq) - 1 - rng.randint(0, 3), start)])
            pool.add_windows(row, seq, n, start=start, stop=stop)
            for j in range(start, len(seq) - 1 if stop is None else stop):
                entries = ref[row].setdefault(seq[j], [])
                cont = tuple(seq[j + 1: j + n])
                if cont in entries:
                    entries.remove(cont)
                entries.append(cont)
                del entries[:-cap]
            for key, entries in ref[row].items():
                assert pool.get(row, key) == entries[::-1]
                assert pool.get(row, key, limit=1) == entries[::-1][:1]
        assert [pool.size(r) for r in range(2)] == [sum(map(len, ref[r].values())) for r in range(2)]


def test_window_wider_than_the_budget_still_learns_and_slides():
    model = enabled("llama")
    ids, _ = prompts(1)
    kwargs = dict(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    out = model.generate(**kwargs, decoding="lookahead", window_size=40, ngram_size=2, pool_from_prompt=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(**kwargs))
    assert out.stats["pool_entries"] > 0
