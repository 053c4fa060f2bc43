"""Lookahead decoding: exact equivalence with stock greedy generate, edges and bad settings."""

from __future__ import annotations

import torch
from models import RecordingStreamer, enabled, prompts

from hf_paralleldecode.decoding.ngram_pool import NgramPool


def test_repetitive_text_is_found_in_the_pool():
    """A model stuck in a cycle is where n-grams pay off: TPF well above 1, output still exact."""
    model = enabled("llama")
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False, eos_token_id=None)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="lookahead", return_dict_in_generate=True)
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


def test_window_wider_than_the_budget_still_learns_and_slides():
    model = enabled("llama")
    ids, _ = prompts(1)
    kwargs = dict(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    out = model.generate(**kwargs, decoding="lookahead", window_size=40, ngram_size=2, pool_from_prompt=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(**kwargs))
    assert out.stats["pool_entries"] > 0
