"""EAGLE-3 drafters: lossless greedy and sampling, trees under tree_budget, a reduced draft vocabulary, clear errors."""

from __future__ import annotations

import pytest
import torch
from models import ARCHITECTURES, enabled, prompts, reference, small_prompts, tiny_model
from test_sampling import chi_square_two_sample, outcomes

import hf_paralleldecode as hfpd
from hf_paralleldecode.drafters.eagle3 import Eagle3Drafter

pytestmark = pytest.mark.core

MAIN_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def eagle_for(model, seed=0, **kwargs):
    torch.manual_seed(seed)
    return Eagle3Drafter.for_target(model, **kwargs)


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", MAIN_ARCHS)
def test_matches_stock_greedy(arch, batch, budget):
    model = enabled(arch)
    ids, mask = prompts(batch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=eagle_for(model), tree_budget=budget, tree_width=4)
    torch.testing.assert_close(out, reference(arch, batch, 24), rtol=0, atol=0)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in MAIN_ARCHS])
def test_other_architectures_match_stock_greedy(arch):
    model = enabled(arch)
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=eagle_for(model), tree_budget=16)
    torch.testing.assert_close(out, reference(arch, 3, 24), rtol=0, atol=0)


@pytest.mark.parametrize("settings", [dict(num_hidden_layers=2), dict(norm_before_residual=True, norm_output=True),
                                      dict(norm_before_fc=True, fc_norm=True), dict(draft_vocab_size=40)],
                         ids=["two_layers", "norms", "fc_norms", "reduced_vocab"])
def test_variants_match_stock_greedy(settings):
    model = enabled("qwen3")
    ids, mask = prompts(3)
    drafter = eagle_for(model, **settings)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=drafter, tree_budget=12, tree_width=3,
                         return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, reference("qwen3", 3, 24), rtol=0, atol=0)
    assert out.draft_stats.drafter == "eagle3" and out.stats["drafter"] == "eagle3"


def test_trees_are_grown_per_level_and_accept_many_tokens(small_vocab):
    """An EAGLE-3 drafter that learned the target (here: a random one on an 8-token target, where random drafts
    are often right) commits several tokens per forward; waves are capped by tree_waves."""
    ids, mask = small_prompts()
    ref = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    drafter = eagle_for(small_vocab)
    for waves in (1, 3, None):
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                   decoding="speculative", drafter=drafter, tree_budget=16, tree_width=3,
                                   tree_waves=waves, adaptive=False, return_dict_in_generate=True)
        torch.testing.assert_close(out.sequences, ref, rtol=0, atol=0)
        assert out.draft_stats.drafter_forwards_per_step <= (waves or drafter.config.default_depth)
        assert out.tokens_per_forward > 1.2


def test_draft_vocabulary_bounds_q():
    """q is zero outside the draft vocabulary: a drafter that can only propose ids >= 40 drafts nothing else."""
    model = enabled("llama")
    drafter = eagle_for(model, draft_vocab_size=16)
    drafter.set_draft_vocab(torch.arange(40, 56))
    ids, mask = prompts(2)
    proposed = []
    from hf_paralleldecode.decoding.speculative import DraftProposer

    pack = DraftProposer._pack

    def record(self, nodes, q_store, sample_then_match=False):
        proposed.extend(t for tokens, _, _ in nodes for t in tokens[1:])
        return pack(self, nodes, q_store, sample_then_match)

    DraftProposer._pack = record
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             decoding="speculative", drafter=drafter, tree_budget=8)
    finally:
        DraftProposer._pack = pack
    torch.testing.assert_close(out, reference("llama", 2, 12)[:, : out.shape[1]], rtol=0, atol=0)
    assert proposed and all(40 <= t < 56 for t in proposed)


@pytest.mark.slow
@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
def test_sampled_output_distribution_equals_stock(reduced):
    vocab, rows = 5, 4000
    model = hfpd.enable(tiny_model("llama", vocab_size=vocab, initializer_range=0.05))
    drafter = eagle_for(model, draft_vocab_size=3 if reduced else None)
    if reduced:
        drafter.set_draft_vocab(torch.tensor([1, 3, 4]))
    ids = torch.tensor([[3, 4, 3, 4, 3]]).repeat(rows, 1)
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=True, eos_token_id=None)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)
    torch.manual_seed(1)
    ours = model.generate(**kwargs, decoding="speculative", drafter=drafter, tree_budget=6, tree_width=2,
                          return_dict_in_generate=True)
    assert ours.tokens_per_forward > 1.05, "multi-token acceptance must happen for the test to mean anything"
    p = chi_square_two_sample(outcomes(stock, 5), outcomes(ours.sequences, 5), vocab**3)
    assert p > 1e-3, f"sampled distribution differs from stock sampling (p={p:.2e})"


def test_wrong_target_and_settings_are_refused_before_any_forward():
    model = enabled("llama")
    other = hfpd.enable(tiny_model("llama", vocab_size=77))
    drafter = eagle_for(other)
    ids, mask = prompts(1)
    with pytest.raises(ValueError, match="built for another target"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, decoding="speculative", drafter=drafter)
    with pytest.raises(ValueError, match="denoise_steps"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, decoding="speculative",
                       drafter=eagle_for(model), denoise_steps=2)


def test_save_and_load_round_trip(tmp_path):
    model = enabled("qwen3")
    drafter = eagle_for(model, draft_vocab_size=40, norm_before_residual=True)
    drafter.save_pretrained(tmp_path)
    again = hfpd.load_drafter(tmp_path)
    assert isinstance(again, Eagle3Drafter)
    for (k, a), (_, b) in zip(sorted(drafter.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), k
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                         decoding="speculative", drafter=str(tmp_path))
    torch.testing.assert_close(out, reference("qwen3", 3, 16), rtol=0, atol=0)
