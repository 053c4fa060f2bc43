"""Issue class: model inputs besides input_ids / attention_mask / position_ids.

``token_type_ids`` (GPT-2 and other segment-embedding models) is honoured at every step exactly as
stock generation extends it (each new token repeats the prompt's last type); any other model input
is refused by name before any forward, with a message naming decoding="stock".
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import enabled, prompts

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


@functools.cache
def _head(arch):
    torch.manual_seed(0)
    return hfpd.DraftHead.for_target(enabled(arch), num_hidden_layers=1, block_size=4)


SETTINGS = {
    "jacobi": lambda arch: dict(block_size=5),
    "jacobi_forcing": lambda arch: dict(block_size=4),
    "lookahead": lambda arch: dict(),
    "speculative": lambda arch: dict(drafter=_head(arch), tree_budget=6, tree_width=2),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("decoding", list(SETTINGS))
def test_token_type_ids_are_honoured_at_every_step(decoding, batch):
    model = enabled("gpt2")
    ids, mask = prompts(batch)
    types = torch.zeros_like(ids)
    types[:, 4:] = 1  # the last type differs from the first: generated tokens must get type 1
    if batch > 1:
        types[1, 4:] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, token_type_ids=types, max_new_tokens=20, do_sample=False)
    ref = model.generate(**kwargs, decoding="stock")
    assert not torch.equal(ref, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                                               do_sample=False, decoding="stock")), "types must matter"
    assert torch.equal(model.generate(**kwargs, decoding=decoding, **SETTINGS[decoding]("gpt2")), ref)


@pytest.mark.parametrize("extra", ["labels", "output_router_logits"])
@pytest.mark.parametrize("decoding", list(SETTINGS))
def test_other_model_inputs_are_refused_by_name_before_any_forward(decoding, extra):
    model = enabled("llama")
    settings = SETTINGS[decoding]("llama")
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids, mask = prompts(1)
    # inputs Llama's forward accepts, so transformers passes them on (a VLM's pixel_values arrive the same way)
    value = ids if extra == "labels" else True
    with pytest.raises(ValueError, match=rf"{extra}.*decoding=\"stock\""):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, decoding=decoding, **{extra: value},
                       **settings)
    hook.remove()
    assert not calls


@pytest.mark.parametrize("decoding, extra, match", [
    ("jacobi", "block_sise", r"unknown setting.*'block_sise'.*did you mean 'block_size'"),  # a typo
    ("speculative", "pool_size", r"unknown setting.*'pool_size' is a setting of decoding=.*'jacobi_forcing'"),
    ("lookahead", "tree_depth", r"unknown setting.*'tree_depth' is a setting of decoding='speculative'"),
    ("jacobi", "bogus", r"unknown setting.*'bogus'.*not inputs of LlamaForCausalLM"),  # stock refuses it too
])
def test_a_misspelt_or_foreign_setting_is_named_as_a_setting_before_any_forward(decoding, extra, match):
    """A key that is a near miss of one of the decoding's settings, or a setting of another decoding, is reported
    as an unknown setting (with the decoding's settings listed), not as a model input; through ``generate`` and
    through the checkpoint config alike."""
    model = enabled("llama")
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids, mask = prompts(1)
    try:
        with pytest.raises(ValueError, match=match) as err:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, decoding=decoding, **{extra: 4})
    finally:
        hook.remove()
    assert not calls
    assert "Its settings:" in str(err.value)
    with pytest.raises(ValueError, match="Unknown settings"):
        hfpd.ParallelDecodingConfig(decoding, {extra: 4})
