"""A model changed between calls is decoded as it is now, and concurrent calls on one model do not meet.

The greedy LM-head shortcut (engine/target.py ``GreedyHead``) is the state a model keeps across calls: it is
rebuilt and checked again whenever the head, its weight (vocabulary size, dtype, device) or any hook changes, and
its capture hook acts only in the thread of the call that installed it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from models import prompts, tiny_model

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

STRATEGIES = ["jacobi", "jacobi_forcing", "lookahead", "prompt_lookup", "speculative-head", "speculative-deer"]


def _settings(model, case):
    """``decoding=`` and its settings for a case of :data:`STRATEGIES`, with a drafter built for ``model`` as it is
    now (a drafter is built for one vocabulary: after a resize the user builds or loads another)."""
    decoding, _, kind = case.partition("-")
    torch.manual_seed(0)
    if kind == "head":
        return dict(decoding=decoding, drafter=hfpd.DraftHead.for_target(model, block_size=4))
    if kind == "deer":
        return dict(decoding=decoding, drafter=hfpd.DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4))
    return dict(decoding=decoding, **({"block_size": 64} if decoding == "jacobi" else {}))


@pytest.fixture(autouse=True)
def chunked_head_on_every_step(monkeypatch):
    """The greedy head's chunked path on every checked step (on a real vocabulary it is the path of wide trees)."""
    from hf_paralleldecode.engine.target import GreedyHead

    monkeypatch.setattr(GreedyHead, "worth_it", lambda self, positions: True)
BANNED = list(range(3, 60))  # most of the 97-token vocabulary


class BanningHead(torch.nn.Module):
    """Wraps an LM head and bans tokens (what a user does to constrain output)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    @property
    def weight(self):
        return self.head.weight

    def forward(self, hidden):
        logits = self.head(hidden)
        logits[..., BANNED] = torch.finfo(logits.dtype).min
        return logits


def _ban_hook(module, args, output):
    output = output.clone()
    output[..., BANNED] = torch.finfo(output.dtype).min
    return output


def _model_and_call(arch="llama"):
    model = hfpd.enable(tiny_model(arch))
    ids, mask = prompts(4, length=8, pad_left=(0, 3, 1, 5))
    # blocks wide enough that the chunked greedy head is used after the first (checked) step
    return model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)


def _first_call(model, call, case):
    model.generate(**call, **_settings(model, case))


@pytest.mark.parametrize("change", ["wrap_head", "head_forward_hook", "model_forward_hook"])
@pytest.mark.parametrize("decoding", STRATEGIES)
def test_a_change_that_edits_logits_after_the_first_call_is_honoured(decoding, change):
    model, call = _model_and_call()
    _first_call(model, call, decoding)
    if change == "wrap_head":
        model.set_output_embeddings(BanningHead(model.get_output_embeddings()))
    elif change == "head_forward_hook":
        model.get_output_embeddings().register_forward_hook(_ban_hook)
    else:
        model.register_forward_hook(lambda m, a, out: setattr(out, "logits", _ban_hook(m, a, out.logits)) or out)
    ref = model.generate(**call, decoding="stock")
    out = model.generate(**call, **_settings(model, decoding))
    new = out[:, call["input_ids"].shape[1]:]
    assert not torch.isin(new, torch.tensor(BANNED)).any()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("decoding", STRATEGIES)
def test_resizing_the_vocabulary_after_a_first_call_works(decoding):
    model, call = _model_and_call()
    _first_call(model, call, decoding)
    model.resize_token_embeddings(120)
    ref = model.generate(**call, decoding="stock")
    assert torch.equal(model.generate(**call, **_settings(model, decoding)), ref)


@pytest.mark.parametrize("decoding", STRATEGIES)
def test_a_dtype_change_after_a_first_call_is_exact(decoding):
    model, call = _model_and_call()
    _first_call(model, call, decoding)
    model.to(torch.float64)
    ref = model.generate(**call, decoding="stock")
    assert torch.equal(model.generate(**call, **_settings(model, decoding)), ref)


@pytest.mark.parametrize("other", ["stock", "lookahead", "speculative"])
@pytest.mark.parametrize("decoding", ["jacobi", "prompt_lookup", "speculative"])
def test_a_call_in_another_thread_meets_none_of_the_calls_hooks(decoding, other):
    """Deterministic interleaving: the decoding thread is paused inside its forward, with its hooks installed,
    while the other thread runs a whole generate (stock, or another decoding) on the same model; then it resumes."""
    model, call = _model_and_call()
    settings = {"drafter": hfpd.DraftHead.for_target(model, block_size=4)} if decoding == "speculative" else {}
    _first_call(model, call, "jacobi")  # the greedy head is checked: later steps install the capture hook
    ref_parallel = model.generate(**call, decoding="stock")
    other_settings = {"drafter": hfpd.DraftHead.for_target(model, block_size=4)} if other == "speculative" else {}
    ref_other = model.generate(**call, decoding=other, **other_settings)
    inside, done = threading.Event(), threading.Event()
    paused = {"once": False}
    layer = model.model.layers[-1]

    def pause(module, args):
        if threading.current_thread() is worker and not paused["once"] and model.get_output_embeddings()._forward_pre_hooks:
            paused["once"] = True
            inside.set()
            assert done.wait(60)

    handle = layer.register_forward_pre_hook(pause)
    results, errors = {}, []

    def run():
        try:
            results["parallel"] = model.generate(**call, decoding=decoding, **settings)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)
            inside.set()

    worker = threading.Thread(target=run)
    try:
        worker.start()
        assert inside.wait(60)
        assert not errors, errors
        # while the worker's hooks are installed (a parallel decoding here installs its own, in this thread)
        results["other"] = model.generate(**call, decoding=other, **other_settings)
        done.set()
        worker.join(60)
    finally:
        done.set()
        handle.remove()
    assert not errors, errors
    assert paused["once"], "the decoding thread never reached a step with the capture hook installed"
    assert torch.equal(results["other"], ref_other)
    assert torch.equal(results["parallel"], ref_parallel)
