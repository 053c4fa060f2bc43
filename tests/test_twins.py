"""Cost twins (``hf_paralleldecode.twins``): a bigger model computing the source's function."""

from __future__ import annotations

import pytest
import torch
from models import prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode.twins import TWIN_SHAPES, TwinShape, cost_twin, twin_of, twin_shape

TWIN_ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def _shape(arch, *, q_heads=12, kv_heads=6, layers=4):
    head_dim = 8  # the tiny models' head size (hidden 32 / 4 heads; qwen3 sets head_dim=8)
    return TwinShape(hidden_size=96, intermediate_size=200, num_hidden_layers=layers, q_width=q_heads * head_dim,
                     kv_width=kv_heads * head_dim)


@pytest.mark.parametrize("dead", ["random", "zeros"])
@pytest.mark.parametrize("heads", [(12, 6), (12, 12), (8, 2)], ids=["group2", "group1-copies", "group4"])
@pytest.mark.parametrize("arch", TWIN_ARCHS)
def test_twin_logits_equal_source(arch, heads, dead):
    """fp32 logits of the twin equal the source's to rounding, padded rows included, for every head layout (a twin
    group smaller than the source's copies key/value heads)."""
    model = tiny_model(arch)
    twin = cost_twin(model, _shape(arch, q_heads=heads[0], kv_heads=heads[1]), dead_weights=dead)
    assert twin.config.hidden_size == 96 and twin.config.num_hidden_layers == 4
    assert sum(p.numel() for p in twin.parameters()) > 3 * sum(p.numel() for p in model.parameters())
    ids, mask = prompts(3)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        got = twin(input_ids=ids, attention_mask=mask).logits
    assert (ref - got)[mask.bool()].abs().max().item() < 1e-4
    if dead == "random":  # the dead weights really are non-zero: a forward does a real model's arithmetic
        assert twin.model.layers[-1].self_attn.q_proj.weight.abs().sum() > 0
        assert twin.model.layers[-1].mlp.down_proj.weight.abs().sum() == 0


@pytest.mark.parametrize("arch", TWIN_ARCHS)
def test_twin_greedy_and_strategies(arch):
    """Stock greedy of the twin is the source's here; every strategy on the twin equals the twin's stock greedy."""
    model = hfpd.enable(tiny_model(arch))
    twin = cost_twin(model, _shape(arch))
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    ref = model.generate(**kwargs)
    stock = twin.generate(**kwargs)
    assert torch.equal(stock, ref)
    for decoding, settings in [("jacobi", dict(block_size=8)), ("prompt_lookup", {}), ("lookahead", {}),
                               ("jacobi_forcing", {})]:
        assert torch.equal(twin.generate(**kwargs, decoding=decoding, **settings), stock), decoding


@pytest.mark.filterwarnings("ignore::hf_paralleldecode.hardware.SlowMatmulWarning")  # (a bf16 copy, not timed)
def test_twin_keeps_the_token_drafter_and_config():
    """The embedded model's twin carries its decoding config and DEER drafter (a copy where the dtype differs: the
    source's drafter is never moved), and its default decoding equals its stock greedy."""
    model, tok = hfpd.load_default_model("default")
    drafter = model._hfpd_drafter
    twin = cost_twin(model, "135m")
    assert twin.parallel_decoding_config is model.parallel_decoding_config
    assert twin._hfpd_drafter is drafter
    half = cost_twin(model, "135m", dtype=torch.bfloat16)
    assert half._hfpd_drafter is not drafter and half._hfpd_drafter.dtype == torch.bfloat16
    assert drafter.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
    enc = tok(["import os\n\n\ndef main(argv):\n    "], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=24, decoding="stock", do_sample=False)
    stock = twin.generate(**enc, max_new_tokens=24, decoding="stock", do_sample=False)
    assert torch.equal(stock, ref)
    assert torch.equal(twin.generate(**enc, max_new_tokens=24, do_sample=False), stock)


@pytest.mark.parametrize("fast", [False, True])
def test_a_half_precision_twin_on_a_cpu_without_a_fast_kernel_for_it_is_warned_of(monkeypatch, fast):
    """From Python as from the command line: on a CPU whose oneDNN has no bf16 matrix kernel a twin's forward costs
    a fallback's time, not a model's of its shape, so ``cost_twin`` warns, naming the fix (once, with a category
    callers can filter); float32, a fast kernel or another device: no warning."""
    import warnings

    from hf_paralleldecode import hardware

    monkeypatch.setattr(hardware, "cpu_has_fast_matmul", lambda dtype: fast or dtype == torch.float32)
    model = tiny_model("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cost_twin(model, _shape("llama"), dtype=torch.bfloat16)
        cost_twin(model, _shape("llama"))  # the source's float32
    slow = [w for w in caught if issubclass(w.category, hardware.SlowMatmulWarning)]
    if fast:
        assert not slow
    else:
        assert len(slow) == 1 and "bfloat16" in str(slow[0].message) and "float32" in str(slow[0].message)
        assert slow[0].filename == __file__  # attributed to the caller's line


def test_twin_refuses_hidden_state_drafters():
    model = hfpd.enable(tiny_model("llama"))
    head = hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=4)
    hfpd.integration.attach_drafter(model, head)
    with pytest.raises(ValueError, match="hidden states"):
        cost_twin(model, _shape("llama"))


@pytest.mark.parametrize("arch", ["gpt2", "gemma", "phi3"])
def test_twin_refuses_other_layouts(arch):
    with pytest.raises(ValueError, match="cost_twin widens"):
        cost_twin(tiny_model(arch), _shape("llama"))


@pytest.mark.parametrize("shape, match", [
    (dict(hidden_size=16, intermediate_size=200, num_hidden_layers=4, q_width=96, kv_width=48), "shrink"),
    (dict(hidden_size=96, intermediate_size=200, num_hidden_layers=1, q_width=96, kv_width=48), "shrink"),
    (dict(hidden_size=96, intermediate_size=200, num_hidden_layers=4, q_width=100, kv_width=48), "multiples"),
    (dict(hidden_size=96, intermediate_size=200, num_hidden_layers=4, q_width=96, kv_width=40), "whole query groups"),
    (dict(hidden_size=96, intermediate_size=200, num_hidden_layers=4, q_width=24, kv_width=24), "shrink"),
])
def test_twin_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        cost_twin(tiny_model("llama"), shape)


def test_twin_head_groups_that_do_not_fit():
    """6 query heads in groups of 3 cannot be seated in 3 key-value heads of 2 query heads each."""
    model = tiny_model("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ValueError, match="cannot hold"):
        cost_twin(model, dict(hidden_size=96, intermediate_size=200, num_hidden_layers=4, q_width=48, kv_width=24))
    twin = cost_twin(model, dict(hidden_size=96, intermediate_size=200, num_hidden_layers=4, q_width=96, kv_width=48))
    ids, mask = prompts(2)
    with torch.no_grad():
        assert torch.allclose(twin(input_ids=ids, attention_mask=mask).logits,
                              model(input_ids=ids, attention_mask=mask).logits, atol=1e-4)


def test_twin_shape_names_and_errors():
    assert twin_shape("1B") is TWIN_SHAPES["1b"]
    assert TWIN_SHAPES["8b"].q_width == 4096
    with pytest.raises(ValueError, match="choose one of"):
        twin_shape("2b")
    with pytest.raises(TypeError, match="Unknown TwinShape field"):
        twin_shape(dict(hidden=1))
    with pytest.raises(ValueError, match="`TwinShape.hidden_size` must be >= 1, got 0"):
        TwinShape(0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="dead_weights"):
        cost_twin(tiny_model("llama"), _shape("llama"), dead_weights="ones")
    assert twin_of("default-1b") == ("default", "1b")
    assert twin_of("default-trained-8b") == ("default-trained", "8b")
    assert twin_of("default-trained") is None and twin_of("default-2b") is None and twin_of("random-1b") is None


def test_twin_saves_and_reloads(tmp_path):
    """A saved twin is a plain checkpoint of its architecture (its config records the source's sizes)."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    twin = cost_twin(model, _shape("llama"))
    twin.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.config.cost_twin["source_hidden_size"] == 32
    ids, mask = prompts(2)
    with torch.no_grad():
        assert torch.allclose(back(input_ids=ids, attention_mask=mask).logits,
                              model(input_ids=ids, attention_mask=mask).logits, atol=1e-4)


@pytest.mark.parametrize("bad", [True, False, 4.0, "64", None])
@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers", "q_width", "kv_width"])
def test_a_twin_shape_takes_positive_integers_only(field, bad):
    """A bool is not a size (``True`` would build a twin of hidden size 1), nor a float or a string."""
    sizes = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=4, q_width=96, kv_width=48)
    with pytest.raises(ValueError, match=f"`TwinShape.{field}` must be an integer >= 1, got {bad!r}"):
        TwinShape(**{**sizes, field: bad})
    with pytest.raises(ValueError, match=f"`TwinShape.{field}`"):
        cost_twin(tiny_model("llama"), {**sizes, field: bad})
    with pytest.raises(ValueError, match="`TwinShape.like` must be a string"):
        TwinShape(**sizes, like=1)


@pytest.mark.parametrize("model", [object(), None, torch.nn.Linear(2, 2), "default"], ids=["object", "None", "module",
                                                                                        "str"])
def test_cost_twin_takes_a_transformers_causal_lm(model):
    with pytest.raises(ValueError, match="cost_twin takes a transformers causal LM .*got"):
        cost_twin(model, "1b")


@pytest.mark.parametrize("kwargs, match", [(dict(dtype="bfloat16"), "`dtype` must be a torch.dtype"),
                                           (dict(seed=True), "`seed` must be an integer"),
                                           (dict(seed=-1), "`seed` must be >= 0")])
def test_cost_twin_checks_its_other_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cost_twin(tiny_model("llama"), _shape("llama"), **kwargs)
