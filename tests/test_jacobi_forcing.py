"""Jacobi Forcing decoding: exact equivalence with stock greedy generate, multiblock and recycling edges."""

from __future__ import annotations

import pytest
import torch
from models import enabled, prompts

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


def test_k1_pool0_reduces_to_plain_jacobi():
    model = enabled("llama")
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True)
    jf = model.generate(**kwargs, decoding="jacobi_forcing", num_blocks=1, pool_size=0, context_matches=0, block_size=8)
    jac = model.generate(**kwargs, decoding="jacobi", block_size=8)
    assert torch.equal(jf.sequences, jac.sequences)
    assert jf.stats["recycled_wins"] == 0 and jf.stats["blocks_activated"] == 0


def test_pseudo_blocks_are_activated_and_recycled_ngrams_win_across_blocks():
    model = enabled("gpt2")
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=80, do_sample=False, eos_token_id=None)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="jacobi_forcing", block_size=8, num_blocks=3, activation_ratio=0.25,
                         pool_size=4, adaptive=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats["blocks_activated"] > 0
    assert out.stats["recycled_wins"] > 0  # the pool outlives block boundaries (80 tokens = 10 blocks)
    # both with fixed shapes: the batch policy's choices depend on measured times, so would the comparison
    plain = model.generate(**kwargs, decoding="jacobi", block_size=8, adaptive=False, return_dict_in_generate=True)
    assert out.tokens_per_forward > plain.tokens_per_forward


def test_device_presets_and_stats():
    from hf_paralleldecode.decoding.jacobi_forcing import CPU_DEFAULTS

    model = enabled("llama")
    ids, _ = prompts(1)
    out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, decoding="jacobi_forcing",
                         return_dict_in_generate=True)
    for key, value in CPU_DEFAULTS.items():
        assert out.stats[key] == value
    assert out.stats["ngram_size"] == CPU_DEFAULTS["block_size"]


def test_block_size_one_works_with_default_ngram_size():
    model = enabled("llama")
    ids, _ = prompts(1)
    kwargs = dict(input_ids=ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(**kwargs, decoding="jacobi_forcing", block_size=1), model.generate(**kwargs))


def test_context_draws_come_from_each_rows_own_context_and_match_the_tensor_form():
    """The host-list draw (what the Jacobi Forcing / lookahead proposers use) returns, per active row,
    tokens of its real prompt or of what it committed so far: the same tokens as indexing tensors with the same
    draw. A row read in part (``take``) or cycled past ``k`` gives the same tokens as the row read in full."""
    from hf_paralleldecode.engine.run import DecodeRun

    model = enabled("llama")
    ids, mask = prompts(3)
    seen = []
    orig = DecodeRun.context_draw

    def spy(self, k, generator):
        state = generator.get_state()
        draw = orig(self, k, generator)
        out = [draw[i] for i in range(len(draw))]
        # the same draw through tensor indexing: [real prompt tokens, committed tokens] per row
        u = torch.rand(self.rows.shape[0], k, generator=torch.Generator().set_state(state))
        plen = self.prompt_lengths[self.rows]
        pick = (u * (plen + self.log.count[self.rows])[:, None]).long()
        index = torch.where(pick < plen[:, None], pick, ids.shape[1] + pick - plen[:, None])
        context = torch.cat([self.packed_prompt[self.rows], self.log.tokens[self.rows]], dim=1)
        assert context.gather(1, index).tolist() == out
        for i, row in enumerate(out):
            assert draw.take(i, 3) == row[:3] and draw.cycled(i, 0) == []
            assert draw.cycled(i, 2 * k + 1) == (row * 3)[: 2 * k + 1]
        seen.append((self.rows.tolist(), [list(self.log.host_tokens(r)) for r in self.rows.tolist()], out))
        return draw

    DecodeRun.context_draw = spy
    try:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                       decoding="jacobi_forcing", block_size=8, num_blocks=2, pool_size=2)
    finally:
        DecodeRun.context_draw = orig
    assert len(seen) > 3
    for rows, committed, draws in seen:
        assert len(draws) == len(rows) and all(len(d) == 8 for d in draws)
        for row, done, drawn in zip(rows, committed, draws):
            allowed = set(ids[row][mask[row] == 1].tolist()) | set(done)
            assert set(drawn) <= allowed
