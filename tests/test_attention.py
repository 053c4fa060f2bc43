"""The attention priority of decoding calls (hf_paralleldecode.attention): cuDNN's attention after the others on GPUs
where torch tries it first, torch's order left alone elsewhere, restored after every call."""

from __future__ import annotations

import pytest
import torch
from models import enabled, prompts, tiny_model, word_tokenizer
from torch.nn.attention import SDPBackend

import hf_paralleldecode as hfpd
from hf_paralleldecode import attention, cli
from hf_paralleldecode.bench import parse_strategy, run_benchmark

CUDNN, FLASH, EFFICIENT, MATH = (int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION),
                                 int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.MATH))


@pytest.fixture
def cudnn_first(monkeypatch):
    """Torch's order as on a Hopper GPU with cuDNN >= 9.15 (cuDNN first), the probe a recorder; restored after."""
    before = torch._C._get_sdp_priority_order()
    probes = []
    monkeypatch.setattr(attention, "_probe", lambda device: probes.append(str(device)))
    monkeypatch.setattr(attention, "_probed", set())
    order = [CUDNN, FLASH, EFFICIENT, MATH] + [b for b in before if b not in (CUDNN, FLASH, EFFICIENT, MATH)]
    torch._C._set_sdp_priority_order(order)
    try:
        yield order, probes
    finally:
        torch._C._set_sdp_priority_order(before)


def _enabled_backends():
    return (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())


def test_auto_puts_cudnn_after_the_others_on_cuda_and_restores_torch_order(cudnn_first):
    order, probes = cudnn_first
    flags = _enabled_backends()
    with attention.decoding_attention("cuda") as done:
        inside = torch._C._get_sdp_priority_order()
        assert done == {"attention_priority": "auto", "sdpa_order": "cudnn_last"}
        assert _enabled_backends() == flags  # which backends are enabled is the user's business
    assert inside[:4] == [FLASH, EFFICIENT, MATH, CUDNN]
    assert torch._C._get_sdp_priority_order() == order
    with pytest.raises(RuntimeError, match="boom"), attention.decoding_attention("cuda:0"):
        raise RuntimeError("boom")
    assert torch._C._get_sdp_priority_order() == order  # restored when the call raises too
    with attention.decoding_attention("cuda"):
        pass
    assert probes == ["cuda", "cuda:0"]  # torch's default order is settled once per device


def test_torch_order_is_left_alone_off_cuda_under_torch_when_cudnn_is_disabled_or_already_last(cudnn_first,
                                                                                                monkeypatch):
    order, probes = cudnn_first
    sets = []
    monkeypatch.setattr(attention, "_set_priority_order", sets.append)
    for device in ("cpu", "meta"):
        with attention.decoding_attention(device) as done:
            assert done["sdpa_order"] == "torch"
    with attention.attention_priority("torch"), attention.decoding_attention("cuda") as done:
        assert done == {"attention_priority": "torch", "sdpa_order": "torch"}
    monkeypatch.setattr(attention, "_cudnn_enabled", lambda: False)  # the user turned cuDNN's attention off
    with attention.decoding_attention("cuda") as done:
        assert done["sdpa_order"] == "torch"
    monkeypatch.setattr(attention, "_cudnn_enabled", lambda: True)
    torch._C._set_sdp_priority_order([FLASH, EFFICIENT, MATH, CUDNN])  # torch's order on other GPUs
    with attention.decoding_attention("cuda") as done:
        assert done["sdpa_order"] == "torch"
    assert sets == [] and probes == ["cuda"]


def test_an_explicit_order_restricts_and_orders_the_backends_for_the_call(cudnn_first):
    order, _ = cudnn_first
    flags = _enabled_backends()
    with attention.attention_priority(["efficient", "math"]):
        assert attention.get_attention_priority() == ("efficient", "math")
        with attention.decoding_attention("cuda") as done:
            assert torch._C._get_sdp_priority_order()[:2] == [EFFICIENT, MATH]
            assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
            assert done == {"attention_priority": ["efficient", "math"], "sdpa_order": "explicit"}
    assert attention.get_attention_priority() == "auto"
    assert _enabled_backends() == flags and torch._C._get_sdp_priority_order() == order


def test_set_attention_priority_is_process_wide_and_exported(cudnn_first):
    assert hfpd.set_attention_priority is attention.set_attention_priority
    assert hfpd.attention_priority is attention.attention_priority
    try:
        hfpd.set_attention_priority("torch")
        with attention.decoding_attention("cuda") as done:
            assert done["sdpa_order"] == "torch"
    finally:
        hfpd.set_attention_priority("auto")


@pytest.mark.parametrize("bad", ["fast", "", [], ["flash", "flash"], ["flashy"], 3, [1, 2], None])
def test_a_bad_attention_priority_is_a_clear_error_naming_the_choices(bad):
    with pytest.raises(ValueError, match="attention priority"):
        attention.set_attention_priority(bad)
    with pytest.raises(ValueError):
        with attention.attention_priority(bad):
            pass
    assert attention.get_attention_priority() == "auto"


def test_an_unknown_backend_in_a_priority_list_is_named_under_the_setting_the_user_called():
    with pytest.raises(ValueError, match=r"attention priority takes .*cudnn.*efficient.*flash.*math.*'flashy'") as e:
        attention.set_attention_priority(["flash", "flashy"])
    assert "sdpa_backends" not in str(e.value)
    assert attention.get_attention_priority() == "auto"


def test_every_decoding_call_runs_inside_the_attention_priority_of_its_device(monkeypatch):
    """decode() enters decoding_attention with the prompt's device, around the prefill and the loop, and leaves it
    before returning; the output stays stock greedy's."""
    import contextlib

    import hf_paralleldecode.engine.run as run

    events = []

    @contextlib.contextmanager
    def spy(device):
        events.append(("enter", str(device)))
        yield {}
        events.append(("exit", str(device)))

    forward = run.TargetForward.forward

    def counted(self, *args, **kwargs):
        events.append("forward")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(run, "decoding_attention", spy)
    monkeypatch.setattr(run.TargetForward, "forward", counted)
    model = enabled("llama")
    ids, mask = prompts(2)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, decoding="jacobi")
    assert torch.equal(out, ref)
    assert events[0] == ("enter", "cpu") and events[-1] == ("exit", "cpu") and "forward" in events[1:-1]
    assert events.count(("enter", "cpu")) == 1


def test_the_bench_records_the_priority_of_its_decoding_entries_and_refuses_a_bad_one(capsys):
    model = tiny_model("llama")
    report = run_benchmark(model, word_tokenizer(), ["t5 t6 t7 t5 t6 t7"], [parse_strategy("jacobi")],
                           max_new_tokens=4, repeats=1, progress=False, attention_priority="torch")
    assert report["attention_priority"] == "torch" and report["sdpa_priority_order"] is None  # CPU: no order
    assert attention.get_attention_priority() == "auto"  # the process's setting is back
    default = run_benchmark(model, word_tokenizer(), ["t5 t6"], [], max_new_tokens=2, repeats=1, progress=False)
    assert default["attention_priority"] == "auto"
    with pytest.raises(ValueError, match="attention priority must be one of"):
        run_benchmark(None, None, ["t5"], [], attention_priority="cudnn-last")
    with pytest.raises(SystemExit) as exc:  # before the model loads
        cli.main(["bench", "--model", "random-tiny", "--attention-priority", "quick", "--output-dir", ""])
    assert exc.value.code == 2 and "quick" in capsys.readouterr().err


def test_the_forward_cost_curve_is_measured_with_the_attention_order_of_decoding_calls(monkeypatch):
    """forward_cost (the policy's and tune's curve) times forwards under decoding_attention on the model's device,
    and a curve measured under one priority is not reused under another."""
    import contextlib

    from hf_paralleldecode.decoding.policy import budget

    entered = []

    @contextlib.contextmanager
    def spy(device):
        entered.append(str(device))
        yield {}

    monkeypatch.setattr(budget, "decoding_attention", spy)
    model = tiny_model("llama")
    budget.forward_cost(model, context=4, repeats=1, tokens=(1, 2))
    budget.forward_cost(model, context=4, repeats=1, tokens=(1, 2))  # the same probe: remembered
    assert entered == ["cpu"]
    with attention.attention_priority("torch"):
        budget.forward_cost(model, context=4, repeats=1, tokens=(1, 2))
    assert entered == ["cpu", "cpu"]
