"""Full garbage collections inside the decode loop skip the objects that existed before the call.

A process that holds a model, a tokenizer and transformers has a few hundred thousand objects the collector tracks
(410k in the bench's process); a full collection walks all of them, about 230 ms on this CPU, and one that lands on
a decoding step makes it several steps long. The loop freezes what existed before the call (``gc.freeze``) and
unfreezes it after, so the collections it triggers walk only what the call allocated; it leaves a collector the user
froze or disabled as it is. The bench also collects before every timed run, so no strategy pays for garbage another
one left.
"""

from __future__ import annotations

import gc

import pytest
import torch
from models import enabled, prompts, tiny_model, word_tokenizer
from transformers import LogitsProcessor, LogitsProcessorList

import hf_paralleldecode as hfpd
from hf_paralleldecode.bench import parse_strategy, run_benchmark


class _Watch(LogitsProcessor):
    """Records, at every processor call inside the loop, how many objects the collector has frozen."""

    def __init__(self, fail_at: int | None = None):
        self.frozen, self.fail_at = [], fail_at

    def __call__(self, input_ids, scores):
        self.frozen.append(gc.get_freeze_count())
        if self.fail_at is not None and len(self.frozen) >= self.fail_at:
            raise RuntimeError("stop here")
        return scores


def _generate(model, watch, **settings):
    ids, mask = prompts(2)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                          logits_processor=LogitsProcessorList([watch]), **settings)


@pytest.mark.parametrize("decoding", ["jacobi", "speculative", "lookahead"])
def test_the_loop_freezes_what_existed_before_the_call_and_unfreezes_it_after(decoding):
    model = enabled("llama")
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    before = len(gc.get_objects())
    settings = {}
    if decoding == "speculative":
        torch.manual_seed(0)
        settings = dict(drafter=hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=3), tree_budget=5)
    watch = _Watch()
    out = _generate(model, watch, decoding=decoding, **settings)
    assert watch.frozen and min(watch.frozen) >= before // 2  # the process's objects, frozen inside the loop
    assert gc.get_freeze_count() == 0  # and back in the collector's care after it
    ref = _generate(model, _Watch(), decoding="stock")
    assert torch.equal(out, ref)


def test_an_error_inside_the_loop_still_unfreezes():
    model = enabled("llama")
    with pytest.raises(RuntimeError, match="stop here"):
        _generate(model, _Watch(fail_at=2), decoding="jacobi")
    assert gc.get_freeze_count() == 0


def test_a_collector_the_user_froze_or_disabled_is_left_as_it_is():
    model = enabled("llama")
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        watch = _Watch()
        _generate(model, watch, decoding="jacobi")
        # (frozen objects that die leave the count): nothing added to theirs, and theirs not unfrozen by the call
        assert max(watch.frozen) <= mine and mine // 2 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        watch = _Watch()
        _generate(model, watch, decoding="jacobi")
        assert set(watch.frozen) == {0} and not gc.isenabled()
    finally:
        gc.enable()


def test_the_bench_collects_garbage_before_every_timed_run(monkeypatch):
    import hf_paralleldecode.bench as bench

    calls = []
    real = gc.collect
    monkeypatch.setattr(bench.gc, "collect", lambda *a: calls.append(a) or real(*a))
    model = hfpd.enable(tiny_model("llama"))
    run_benchmark(model, word_tokenizer(), ["t5 t6", "t7 t8 t9"], [parse_strategy("jacobi:block_size=4")],
                  max_new_tokens=4, repeats=2, progress=False, batch_size=1)
    # per repeat, per prompt batch (2), per entry (stock and jacobi): one collection before the timed run
    assert len(calls) >= 2 * 2 * 2
