"""Sampling: every strategy's output is distributed exactly as stock sampling (statistical test).

Tiny vocabulary (5 tokens), 3 new tokens (125 outcomes), thousands of rows in one batch, the
user's warpers (temperature, top-k) active. A two-sample chi-square test compares the joint
distribution of the three tokens with stock ``generate(do_sample=True)``; the test also checks
that multi-token acceptance really happened (TPF > 1), so more than the AR path is exercised.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_model

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

VOCAB, NEW, ROWS = 5, 3, 4000


def chi_square_two_sample(a: torch.Tensor, b: torch.Tensor, categories: int) -> float:
    """p-value of the two-sample chi-square test that ``a`` and ``b`` come from one distribution."""
    ca = torch.bincount(a, minlength=categories).double()
    cb = torch.bincount(b, minlength=categories).double()
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    na, nb = ca.sum(), cb.sum()
    stat = (((ca * (nb / na).sqrt() - cb * (na / nb).sqrt()) ** 2) / (ca + cb)).sum()
    dof = keep.sum() - 1
    return float(torch.special.gammaincc(dof / 2.0, stat / 2.0))


def outcomes(sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    gen = sequences[:, prompt_len : prompt_len + NEW]
    return (gen * torch.tensor([VOCAB**2, VOCAB, 1])).sum(-1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "decoding, settings",
    [("jacobi", dict(block_size=3, jacobi_init="repeat")), ("lookahead", dict(window_size=3, ngram_size=3)),
     ("jacobi_forcing", dict(block_size=2, activation_ratio=0.5, pool_size=2, ngram_size=3)),
     ("prompt_lookup", dict(num_tokens=2, max_ngram_size=1, max_matches=5)),
     ("lookahead", dict(window_size=2, ngram_size=2, context_matches=3, context_tokens=2, context_ngram_size=1,
                        cost_aware=True)),
     ("jacobi_forcing", dict(block_size=2, pool_size=1, context_matches=4, context_tokens=2, context_ngram_size=1))],
)
def test_sampled_output_distribution_equals_stock(decoding, settings):
    model = hfpd.enable(tiny_model("llama", vocab_size=VOCAB, initializer_range=0.05))
    ids = torch.tensor([[3, 4, 3, 4, 3]]).repeat(ROWS, 1)
    if decoding == "prompt_lookup" or "context_matches" in settings:  # every token has several successors to draft
        ids = torch.tensor([[3, 4, 0, 3, 1, 4, 2, 0, 1, 3, 2, 4, 1, 0, 2, 1, 4, 4, 0, 0, 3, 3, 2, 2, 3]]).repeat(ROWS, 1)
    kwargs = dict(input_ids=ids, max_new_tokens=NEW, do_sample=True, temperature=1.3, top_k=4, eos_token_id=None)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)
    torch.manual_seed(1)
    ours = model.generate(**kwargs, decoding=decoding, return_dict_in_generate=True, **settings)
    assert ours.tokens_per_forward > 1.05, "multi-token acceptance must happen for the test to mean anything"
    p = chi_square_two_sample(outcomes(stock, ids.shape[1]), outcomes(ours.sequences, ids.shape[1]), VOCAB**NEW)
    assert p > 1e-3, f"sampled distribution differs from stock sampling (p={p:.2e})"


def test_chi_square_detects_a_different_distribution():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 10, (4000,), generator=g)
    b = torch.randint(0, 9, (4000,), generator=g)  # never draws category 9
    assert chi_square_two_sample(a, b, 10) < 1e-6
    c = torch.randint(0, 10, (4000,), generator=g)
    assert chi_square_two_sample(a, c, 10) > 1e-3


def test_sampling_respects_processors_and_seeds():
    model = hfpd.enable(tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(input_ids=ids, max_new_tokens=20, do_sample=True, top_k=1, eos_token_id=None)
    # top_k=1 makes sampling greedy: every strategy must then return exactly the greedy tokens
    greedy = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    for decoding in ("jacobi", "lookahead", "jacobi_forcing"):
        assert torch.equal(model.generate(**kwargs, decoding=decoding), greedy)
    torch.manual_seed(3)
    a = model.generate(input_ids=ids, max_new_tokens=20, do_sample=True, decoding="jacobi_forcing")
    torch.manual_seed(3)
    b = model.generate(input_ids=ids, max_new_tokens=20, do_sample=True, decoding="jacobi_forcing")
    assert torch.equal(a, b)
