"""Models whose exactness depends on how far a generation reaches, and models no parallel decoding can serve.

* Rotary scaling whose frequencies depend on the forward's length (``rope_type="dynamic"``, ``"longrope"``):
  exact while the whole generation stays at or below the rotary limit, refused before any forward beyond it.
* Checkpoint defaults step aside (stock runs) for every call a strategy would refuse: one function decides both.
* Refusals name the actual cause (recurrent state, sliding window, ALiBi).
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from models import prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode import compat

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

LIMIT = 16
ROPES = {
    "llama-dynamic": ("llama", dict(max_position_embeddings=LIMIT, rope_parameters={
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})),
    "qwen3-dynamic": ("qwen3", dict(max_position_embeddings=LIMIT, rope_parameters={
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})),
    "llama-longrope": ("llama", dict(max_position_embeddings=4 * LIMIT, rope_parameters={
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
        "original_max_position_embeddings": LIMIT, "rope_theta": 10000.0})),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=4 * LIMIT, original_max_position_embeddings=LIMIT,
                                   rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                    "long_factor": [4.0] * 4, "rope_theta": 10000.0})),
}
#: a case name -> (decoding, drafter kind or None)
DECODINGS = {
    "jacobi": ("jacobi", None), "jacobi_forcing": ("jacobi_forcing", None), "lookahead": ("lookahead", None),
    "prompt_lookup": ("prompt_lookup", None), "speculative-head": ("speculative", "head"),
    "speculative-deer": ("speculative", "deer"),
}


def _rope_model(case):
    arch, overrides = ROPES[case]
    return hfpd.enable(tiny_model(arch, **overrides))


def _settings(model, case):
    """``decoding=`` and its settings for a case of :data:`DECODINGS` (a fresh drafter built for ``model``)."""
    decoding, drafter = DECODINGS[case]
    torch.manual_seed(0)
    if drafter == "head":
        return dict(decoding=decoding, drafter=hfpd.DraftHead.for_target(model, block_size=4))
    if drafter == "deer":
        return dict(decoding=decoding, drafter=hfpd.DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4))
    return dict(decoding=decoding)


class CountForwards:
    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, *args):
        self.n += 1


@pytest.mark.parametrize("case", list(ROPES))
def test_length_dependent_rotary_types_are_found_with_their_limit(case):
    model = _rope_model(case)
    kind, limit = compat.length_dependent_rope(model)
    assert limit == LIMIT and kind == ROPES[case][1]["rope_parameters"]["rope_type"]
    assert compat.length_dependent_rope(tiny_model("llama")) is None  # default rotary: no limit


@pytest.mark.parametrize("decoding", list(DECODINGS))
@pytest.mark.parametrize("case", list(ROPES))
def test_generation_within_the_rotary_limit_is_exact(case, decoding):
    model = _rope_model(case)
    ids, mask = prompts(3, length=8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=LIMIT - 8, do_sample=False, eos_token_id=None)
    ref = model.generate(**kwargs, decoding="stock")
    out = model.generate(**kwargs, **_settings(model, decoding))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("decoding", list(DECODINGS))
@pytest.mark.parametrize("case", list(ROPES))
def test_generation_past_the_rotary_limit_is_refused_before_any_forward(case, decoding):
    model = _rope_model(case)
    ids, mask = prompts(3, length=8)
    settings = _settings(model, decoding)
    counter = CountForwards(model)
    with pytest.raises(ValueError, match=rf"rope_type='\w+'.*position {LIMIT}.*prompt \+ new tokens <= {LIMIT}"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **settings)
    assert counter.n == 0


@pytest.mark.parametrize("decoding", ["jacobi", "prompt_lookup"])
def test_a_strategy_called_directly_refuses_past_the_rotary_limit_too(decoding):
    """custom_generate=<strategy> skips enable()'s pre-check: the strategy's own check is the same function."""
    model = _rope_model("llama-dynamic")
    ids, _ = prompts(1, length=8)
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        model.generate(input_ids=ids, max_new_tokens=20, custom_generate=hfpd.get_decoding(decoding))


def test_a_checkpoint_default_steps_aside_past_the_rotary_limit(caplog):
    model = _rope_model("llama-dynamic")
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("jacobi", {"block_size": 4})
    ids, mask = prompts(2, length=8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    with caplog.at_level(logging.INFO, logger="hf_paralleldecode"):
        out = model.generate(**kwargs)
    assert "steps aside" in caplog.text and "rope_type" in caplog.text
    assert torch.equal(out, model.generate(**kwargs, decoding="stock"))
    within = dict(kwargs, max_new_tokens=LIMIT - 8)
    res = model.generate(**within, return_dict_in_generate=True)
    assert res.decoding == "jacobi" and torch.equal(res.sequences, model.generate(**within, decoding="stock"))


# ---- every refusal is also a step-aside: the pre-check and the strategies are one function -------------
def _sliding_model():
    return tiny_model("mistral", sliding_window=8)


def _cfg_processor(model):
    return transformers.LogitsProcessorList(
        [transformers.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model)])


@pytest.mark.parametrize("case", ["cfg_processor", "sliding_window_outgrown", "rope_outgrown"])
def test_checkpoint_defaults_step_aside_wherever_the_strategy_would_refuse(case, caplog):
    model = {"cfg_processor": lambda: tiny_model("llama"), "sliding_window_outgrown": _sliding_model,
             "rope_outgrown": lambda: _rope_model("qwen3-dynamic")}[case]()
    model = hfpd.enable(model)
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("jacobi", {"block_size": 4})
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    base = dict(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None)

    def call():  # the guidance processor keeps state: a fresh one per call
        return dict(base, logits_processor=_cfg_processor(model)) if case == "cfg_processor" else base

    with caplog.at_level(logging.INFO, logger="hf_paralleldecode"):
        out = model.generate(**call())
    assert "steps aside" in caplog.text
    assert torch.equal(out, model.generate(**call(), decoding="stock"))
    counter = CountForwards(model)
    with pytest.raises(ValueError):  # asked for explicitly, refused before any forward
        model.generate(**call(), decoding="jacobi")
    assert counter.n == 0


# ---- refusals name the actual cause -------------------------------------------------------------------
def test_a_model_with_recurrent_state_is_refused_as_such_not_as_alibi():
    config = transformers.MambaConfig(vocab_size=97, hidden_size=32, state_size=4, num_hidden_layers=2,
                                      pad_token_id=0, eos_token_id=2, bos_token_id=1)
    model = hfpd.enable(transformers.MambaForCausalLM(config).eval())
    with pytest.raises(ValueError, match="recurrent state") as err:
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, decoding="jacobi")
    assert "ALiBi" not in str(err.value)


def test_alibi_is_still_refused_as_alibi():
    model = hfpd.enable(tiny_model("bloom"))
    with pytest.raises(ValueError, match="ALiBi"):
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, decoding="jacobi")


def test_a_cache_without_a_window_is_never_told_to_fit_in_the_window():
    """Stateful cache layers with sliding_window=None: the refusal names the layers, not a window."""
    from hf_paralleldecode.engine.cache import prepare_cache

    class Recurrent(compat.DynamicLayer):
        pass

    model = tiny_model("llama")
    cache = compat.DynamicCache()
    cache.layers = [Recurrent(), compat.DynamicLayer()]
    with pytest.raises(ValueError, match="cannot be cut back") as err:
        prepare_cache(model, cache, 10_000)
    assert "window" not in str(err.value)


def test_sliding_window_outgrown_names_the_window():
    model = hfpd.enable(_sliding_model())
    with pytest.raises(ValueError, match="sliding_window=8"):
        model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=20, decoding="jacobi")


# ---- probes stay inside the model's position limits ---------------------------------------------------
def test_the_cost_probe_stays_inside_a_learned_position_table():
    """cost_aware=True measures forwards of up to 256 tokens after a 64-token prefix: not past GPT-2's table."""
    from hf_paralleldecode.decoding.policy import forward_cost
    from hf_paralleldecode.engine.support import position_table_size

    model = hfpd.enable(tiny_model("gpt2", n_positions=128))
    assert position_table_size(model) == 128 and position_table_size(tiny_model("llama")) is None
    curve = forward_cost(model)
    assert curve.points and max(n for n, _ in curve.points) <= 128 - 32
    ids, mask = prompts(2, length=8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    out = model.generate(**kwargs, decoding="prompt_lookup", cost_aware=True)
    assert torch.equal(out, model.generate(**kwargs, decoding="stock"))


# ---- CLI numbers and files ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv,flag", [
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "--num-prompts", "-1"], "--num-prompts"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--batch-sizes", "4", "0"], "--batch-sizes"),
    (["bench", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--repeats", "-2"], "--repeats"),
    (["tune", "--latency-budget-ms", "0"], "--latency-budget-ms"),
    (["tune", "--repeats", "x"], "--repeats"),
    (["regenerate", "--prompts", "p.jsonl", "--output-dir", "o", "--top-p", "1.5"], "--top-p"),
    (["regenerate", "--prompts", "p.jsonl", "--output-dir", "o", "--temperature", "0"], "--temperature"),
    (["collect", "--prompts", "p.jsonl", "--output-dir", "o", "--block-size", "0"], "--block-size"),
    (["collect", "--prompts", "p.jsonl", "--output-dir", "o", "--max-repeat", "-1"], "--max-repeat"),
])
def test_every_cli_number_is_validated_naming_its_flag(argv, flag, capsys):
    from hf_paralleldecode import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".json"])
def test_a_prompts_file_that_is_not_utf8_is_named_in_the_error(tmp_path, suffix):
    from hf_paralleldecode.prompts import read_prompts

    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{path.name}.*not UTF-8"):
        read_prompts(str(path))
    with pytest.raises(ValueError, match="missing.jsonl"):
        read_prompts(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_a_diffusion_drafter_with_a_short_position_table_is_bounded_before_any_forward(attention):
    """A block-causal drafter reads every committed position plus its block: past its table it is refused before
    any target forward (a bidirectional one reads a window of the table's size and is exact at any length)."""
    from models import reference

    from hf_paralleldecode import DiffusionDrafter

    model = hfpd.enable(tiny_model("llama"))
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=98, n_positions=32, n_embd=32, n_layer=1, n_head=4)).eval()
    gpt2.set_attn_implementation("sdpa")
    drafter = DiffusionDrafter(gpt2, mask_token_id=97, block_size=4, attention=attention)
    ids, mask = prompts(3)  # 7 positions
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, decoding="speculative", drafter=drafter,
                  tree_budget=8)
    out = model.generate(max_new_tokens=16, **kwargs)  # 7 + 16 + the block fit in 32 positions
    torch.testing.assert_close(out, reference("llama", 3, 24)[:, :7 + 16], rtol=0, atol=0)
    counter = CountForwards(model)
    if attention == "block_causal":
        with pytest.raises(ValueError, match="max_position_embeddings=32|32 positions"):
            model.generate(max_new_tokens=24, **kwargs)
        assert counter.n == 0
    else:
        torch.testing.assert_close(model.generate(max_new_tokens=24, **kwargs), reference("llama", 3, 24),
                                   rtol=0, atol=0)


def test_a_checkpoint_default_steps_aside_for_a_drafter_that_cannot_reach(caplog):
    """The pre-check asks the strategy's drafter check too: an attached block-causal drafter with a short table."""
    from hf_paralleldecode import DiffusionDrafter
    from hf_paralleldecode.integration import attach_drafter

    model = hfpd.enable(tiny_model("llama"))
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=98, n_positions=32, n_embd=32, n_layer=1, n_head=4)).eval()
    gpt2.set_attn_implementation("sdpa")
    attach_drafter(model, DiffusionDrafter(gpt2, mask_token_id=97, block_size=4, attention="block_causal"))
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("speculative", {"tree_budget": 8})
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    with caplog.at_level(logging.INFO, logger="hf_paralleldecode"):
        out = model.generate(**kwargs)
    assert "steps aside" in caplog.text and "block_causal" in caplog.text
    assert torch.equal(out, model.generate(**kwargs, decoding="stock"))
    res = model.generate(**dict(kwargs, max_new_tokens=16), return_dict_in_generate=True)
    assert res.decoding == "speculative"
    with pytest.raises(ValueError, match="cannot draft this call"):
        model.generate(**kwargs, decoding="speculative")
