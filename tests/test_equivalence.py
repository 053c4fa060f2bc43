"""The backbone: every strategy's greedy output equals stock ``generate(do_sample=False)``, token for token.

Table: architectures x batch {1, 3 with left padding} x settings per strategy x max_new_tokens.
"""

from __future__ import annotations

import pytest
import torch
from models import ARCHITECTURES, enabled, prompts, reference

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

SETTINGS = {
    "jacobi": {f"n{n}": dict(block_size=n) for n in (1, 2, 7, 16, 64)},
    "lookahead": {
        "default": dict(),
        "W1": dict(window_size=1),
        "N2": dict(ngram_size=2),
        "G0": dict(guess_set_size=0),
        "wide": dict(window_size=8, ngram_size=5, guess_set_size=8, pool_from_prompt=False),
        "context": dict(context_matches=3, context_tokens=6),
        "context_budget": dict(context_matches=4, tree_budget=6, cost_aware=True),
    },
    "prompt_lookup": {
        "default": dict(),
        "chain": dict(max_matches=1),
        "n1": dict(max_ngram_size=1, num_tokens=3),
        "small_budget": dict(tree_budget=2),
        "wide": dict(num_tokens=16, max_ngram_size=4, max_matches=8, tree_budget=64),
        "cost_aware": dict(cost_aware=True),
    },
    "jacobi_forcing": {
        "default": dict(),
        "K1": dict(num_blocks=1),
        "pool0": dict(pool_size=0),
        "K3_r05": dict(num_blocks=3, activation_ratio=0.5, block_size=8),
        "r1": dict(activation_ratio=1.0, block_size=4),
        "n1": dict(block_size=1, pool_size=2, ngram_size=2),
        "context": dict(context_matches=3, context_tokens=5, block_size=6),
        "context_budget": dict(context_matches=2, cost_aware=True, tree_budget=9, block_size=8),
    },
}
CASES = [(decoding, name) for decoding, table in SETTINGS.items() for name in table]


@pytest.mark.parametrize("max_new_tokens", [1, 5, 40])
@pytest.mark.parametrize("decoding, setting", CASES, ids=[f"{d}-{s}" for d, s in CASES])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_matches_stock_greedy(arch, batch, decoding, setting, max_new_tokens):
    ids, mask = prompts(batch)
    out = enabled(arch).generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, decoding=decoding, **SETTINGS[decoding][setting])
    torch.testing.assert_close(out, reference(arch, batch, max_new_tokens), rtol=0, atol=0)


@pytest.mark.parametrize("decoding, settings", [("jacobi", dict(block_size=8)), ("lookahead", {}),
                                                ("jacobi_forcing", dict(block_size=8, activation_ratio=0.3))])
def test_eos_and_processors_inside_accepted_tokens(decoding, settings):
    model = enabled("qwen2")
    ids, mask = prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    eos = int(ref[0, ids.shape[1] + 12])
    for extra in (dict(eos_token_id=eos), dict(eos_token_id=eos, repetition_penalty=1.2), dict(no_repeat_ngram_size=3)):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, **extra)
        assert torch.equal(model.generate(**kwargs, decoding=decoding, **settings), model.generate(**kwargs))
