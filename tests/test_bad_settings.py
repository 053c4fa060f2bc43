"""Bad input: a clear ValueError naming the fix, raised before any forward pass, for every strategy."""

from __future__ import annotations

import pytest
from models import ForwardRecorder, prompts, tiny_model

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

STRATEGIES = ["jacobi", "lookahead", "jacobi_forcing"]

COMMON = [
    (dict(num_beams=2), "num_beams"),
    (dict(use_cache=False), "use_cache"),
    (dict(num_return_sequences=2), "num_return_sequences"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(guidance_scale=1.5), "guidance"),
]

SPECIFIC = {
    "jacobi": [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-3), "block_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(block_size="8"), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(jacobi_init="zeros"), "jacobi_init"),
        (dict(jacobi_seed=-1), "jacobi_seed"),
    ],
    "lookahead": [
        (dict(window_size=0), "window_size"),
        (dict(ngram_size=1), "ngram_size"),
        (dict(guess_set_size=-1), "guess_set_size"),
        (dict(window_size=2.0), "window_size"),
        (dict(pool_from_prompt="yes"), "pool_from_prompt"),
    ],
    "jacobi_forcing": [
        (dict(num_blocks=0), "num_blocks"),
        (dict(activation_ratio=0.0), "activation_ratio"),
        (dict(activation_ratio=1.5), "activation_ratio"),
        (dict(activation_ratio="0.8"), "activation_ratio"),
        (dict(pool_size=-1), "pool_size"),
        (dict(ngram_size=1), "ngram_size"),
        (dict(block_size=0), "block_size"),
    ],
}

CASES = [(d, kw, m) for d in STRATEGIES for kw, m in COMMON + SPECIFIC[d]]


@pytest.mark.parametrize("decoding, kwargs, match", CASES,
                         ids=[f"{d}-{'-'.join(map(str, kw.items()))}" for d, kw, _ in CASES])
def test_bad_settings_raise_before_any_forward(decoding, kwargs, match):
    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    rec = ForwardRecorder(model)
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(input_ids=ids, max_new_tokens=5, decoding=decoding, **kwargs)
    finally:
        rec.restore()
    assert rec.calls == []
