"""The batch policy's memory (owned by the model or drafter that learned it), its tuning object and its clock."""

from __future__ import annotations

import copy
import pickle
import time
import unittest.mock
from dataclasses import FrozenInstanceError, fields
from types import SimpleNamespace

import pytest
import torch
from models import FakeClock, prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode.decoding.policy import (
    BatchPolicy,
    CostAwareBudget,
    ForwardCost,
    PolicyMemory,
    PolicyTuning,
    batch_policy,
    forward_cost,
    memory_of,
    memory_scope,
    shapes_from,
)
from hf_paralleldecode.engine.tree import chain_tree

pytestmark = pytest.mark.core


def _fresh_model(**overrides):
    """An enabled tiny model of its own: a memory no other test wrote to."""
    return hfpd.enable(tiny_model("llama", **overrides))


def _generate(model, decoding="prompt_lookup", **kwargs):
    ids, mask = prompts(2)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, decoding=decoding,
                          return_dict_in_generate=True, **kwargs)


def _starting_times(call):
    """The step times each BatchPolicy built during ``call()`` starts from."""
    seen = []
    real = BatchPolicy.__init__

    def spy(self, shapes, *args, **kw):
        real(self, shapes, *args, **kw)
        seen.append({k: list(v) for k, v in self.times.items()})

    with unittest.mock.patch.object(BatchPolicy, "__init__", spy):
        call()
    return seen


def _tick_per_forward(model, clock, seconds=1.0):
    """Advance ``clock`` by ``seconds`` at each forward of ``model`` (a step of one forward then takes exactly that)."""
    return model.register_forward_pre_hook(lambda module, args, kwargs: clock.advance(seconds), with_kwargs=True)


# ---- the memory --------------------------------------------------------------------------------------------------
def test_the_memory_is_kept_on_the_model_and_its_next_call_starts_from_it():
    model = _fresh_model()
    assert "_hfpd_policy_memory" not in vars(model)  # made on first use
    first = _starting_times(lambda: _generate(model))
    memory = memory_of(model)
    assert vars(model)["_hfpd_policy_memory"] is memory and isinstance(memory, PolicyMemory)
    assert first == [{}] and [key[0] for key in memory.policy] == ["prompt_lookup"]
    stored = next(iter(memory.policy.values()))
    again = _starting_times(lambda: _generate(model))
    assert again == [stored["times"]] and again[0]  # the model's next call starts from its last one's times


def test_a_memory_scope_keeps_what_calls_learn_apart():
    """Inside ``memory_scope(name)`` a call learns from, and leaves what it learns to, the owner's memory of that scope
    only (same clock and token): how a benchmark runs several settings of one model or drafter in one process, each
    as if alone."""
    model = _fresh_model()
    with memory_scope("a"):
        _generate(model)
        scoped = memory_of(model)
    main = memory_of(model)
    assert scoped is not main and scoped.policy and not main.policy  # nothing reached the model's own memory
    assert scoped.token == main.token and scoped.clock is main.clock and scoped.forward_costs is main.forward_costs
    clock = FakeClock()
    main.clock = clock  # the owner's clock, set after the scope was made, is the scope's too
    assert scoped.clock is clock
    main.clock = time.perf_counter
    stored = next(iter(scoped.policy.values()))["times"]
    with memory_scope("a"):
        assert memory_of(model) is scoped
        again = _starting_times(lambda: _generate(model))
    assert again == [stored] and again[0]  # the scope's next call starts from its last one's times
    with memory_scope("b"):
        assert _starting_times(lambda: _generate(model)) == [{}]  # another scope starts afresh
        b = memory_of(model)
        with memory_scope("c"):  # an inner scope holds until it ends
            assert memory_of(model) is not b
        assert memory_of(model) is b
    assert memory_of(model) is main and not main.policy
    copied = copy.deepcopy(model)  # a copy starts afresh, scopes included
    assert not memory_of(copied).scopes and memory_of(copied).token != main.token
    main.forget()
    assert not main.scopes
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="memory_scope takes a non-empty name"), memory_scope(bad):
            pass


def test_two_models_do_not_share_a_memory():
    one, other = _fresh_model(), _fresh_model()
    _generate(one)
    assert memory_of(one) is not memory_of(other) and not memory_of(other).policy
    assert _starting_times(lambda: _generate(other)) == [{}]  # nothing of the first model's times
    assert len(memory_of(one).policy) == len(memory_of(other).policy) == 1
    assert memory_of(one).token != memory_of(other).token


def test_a_new_dtype_device_or_target_starts_afresh():
    model = _fresh_model()
    _generate(model)
    assert _starting_times(lambda: _generate(model.to(torch.float64))) == [{}]  # another dtype: its own times
    assert _starting_times(lambda: _generate(model.to(torch.float32)))[0]  # back: the fp32 times again
    assert len(memory_of(model).policy) == 2
    # another device (one the batch policy is only told of: the run's rows), another target model
    shapes = shapes_from(1, 4, 4, False)

    def run(target, device="cpu"):
        return SimpleNamespace(name="jacobi", rows=torch.zeros(2, device=device), model=target,
                               generation_config=SimpleNamespace(do_sample=False), logits_processor=None)

    drafter = torch.nn.Linear(2, 2)  # an owner other than the model: what a drafter learns is keyed per target
    policy = batch_policy(run(model), shapes, drafter, adaptive=True)
    policy.times[(0, 0)] = [0.5, 0.5]
    policy.finish()
    assert batch_policy(run(model), shapes, drafter, adaptive=True).times == {(0, 0): [0.5, 0.5]}
    assert batch_policy(run(model, "meta"), shapes, drafter, adaptive=True).times == {}
    assert batch_policy(run(_fresh_model()), shapes, drafter, adaptive=True).times == {}
    assert memory_of(drafter) is not memory_of(model) and len(memory_of(drafter).policy) == 1


def test_forward_costs_and_acceptance_counts_live_in_the_same_memory():
    model = _fresh_model()
    curve = forward_cost(model, repeats=1, tokens=(1, 2))
    memory = memory_of(model)
    assert list(memory.forward_costs.values()) == [curve.points]
    assert forward_cost(model, repeats=1, tokens=(1, 2)).points == curve.points  # measured once
    assert not memory_of(_fresh_model()).forward_costs  # another model measures its own
    out = _generate(model, cost_aware=True)
    assert out.stats["budget_carried_statistics"] is False and list(memory.acceptance) == ["prompt_lookup"]
    assert _generate(model, cost_aware=True).stats["budget_carried_statistics"] is True


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_model_starts_with_an_empty_memory(how):
    model = _fresh_model()
    _generate(model)
    memory_of(model).clock = FakeClock()
    clone = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    memory = memory_of(clone)
    assert memory is not memory_of(model) and not memory.policy and memory.token != memory_of(model).token
    assert memory.clock is time.perf_counter  # (a fake clock is the original's own)
    assert memory_of(model).policy  # the original keeps its own


def test_the_module_level_memories_are_gone():
    from hf_paralleldecode.decoding import policy
    from hf_paralleldecode.decoding.policy import budget, rule

    assert not any(hasattr(module, name) for module in (policy, budget, rule)
                   for name in ("_MEMORY", "_COSTS", "_LEARNED"))


# ---- the clock ---------------------------------------------------------------------------------------------------
def test_a_step_is_timed_on_the_policy_clock_and_the_budget_is_told_its_start():
    clock = FakeClock(5.0)
    nodes = CostAwareBudget(None, num_sources=3, cost=ForwardCost([(1, 1.0), (256, 1.0)]))
    policy = BatchPolicy(shapes_from(1, 4, 4, False), nodes=nodes, clock=clock)
    assert BatchPolicy(shapes_from(1, 4, 4, False)).clock is time.perf_counter  # the default
    tree = chain_tree(torch.tensor([[9, 1, 2, 3, 4]]), torch.tensor([5]))
    verdict = SimpleNamespace(path=torch.tensor([[0, 1, 2, -1, -1]]), num_accepted=torch.tensor([2]))
    assert policy.start_step(1, 0.0, None) == 0
    clock.advance(0.25)  # the step: 0.25 s on the clock, 0.1 s of it in the target's forwards
    policy.observe(tree, verdict)
    policy.start_step(1, 0.1, 5)
    assert policy.seconds(0, 0) == 0.25  # (the call's first drafting step: it stands in for the shape's time)
    assert nodes.host_seconds == pytest.approx(0.25 - 0.1)  # the step's time less its forwards, on the same clock


def test_a_models_calls_are_timed_on_its_memorys_clock():
    model = _fresh_model()
    clock = memory_of(model).clock = FakeClock()
    hook = _tick_per_forward(model, clock)
    try:
        _generate(model)  # prompt_lookup: one target forward per step, so every step takes one tick
        curve = forward_cost(model, repeats=1, tokens=(1, 2, 4))  # the forward-cost probe reads the same clock
    finally:
        hook.remove()
    times = next(iter(memory_of(model).policy.values()))["times"]
    assert times and {t for window in times.values() for t in window} == {1.0}
    assert curve.points == [(1, 1.0), (2, 1.0), (4, 1.0)]


# ---- the tuning --------------------------------------------------------------------------------------------------
def test_the_tuning_is_one_frozen_documented_and_checked_object():
    tuning = PolicyTuning()
    assert (tuning.decay, tuning.step_decay, tuning.prior, tuning.min_samples, tuning.window, tuning.max_gap,
            tuning.explore_share, tuning.margin_rows, tuning.margin, tuning.explore_margin, tuning.tree_margin,
            tuning.decisive, tuning.stale, tuning.explore_after) == (0.98, 0.9, 1.0, 2, 8, 256, 0.01, 8, 0.05, 0.15,
                                                                     0.05, 2.0, 1.5, 3)
    assert all(f.metadata.get("help") for f in fields(PolicyTuning))
    assert BatchPolicy(shapes_from(1, 4, 4, False)).tuning == tuning
    with pytest.raises(FrozenInstanceError):
        tuning.margin = 0.3
    for bad, name in [(dict(window=1), "window"), (dict(decay=0.0), "decay"), (dict(step_decay=1.5), "step_decay"), (dict(margin=-0.1), "margin"),
                      (dict(min_samples=0), "min_samples"), (dict(margin_rows=True), "margin_rows"),
                      (dict(stale=0.5), "stale"), (dict(margin=0.2), "explore_margin"),
                      (dict(explore_after=-1), "explore_after"), (dict(explore_after=1.5), "explore_after")]:
        with pytest.raises(ValueError, match=f"PolicyTuning.{name} must be"):
            PolicyTuning(**bad)


def test_the_batch_policy_page_lists_every_tuning_field_with_its_default():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "batch-policy.md").read_text()
    rows = {f.name: f"| `{f.name}` | {f.default} |" for f in fields(PolicyTuning)}
    assert not [row for row in rows.values() if row not in page]


def _drive(tuning, rows=8, seconds=(0.028, 0.010), steps=60):
    """Run a chain of 4 (each row accepts 2 of its tokens) or a plain step, each taking ``seconds`` on a fake clock:
    the tree commits 3 tokens per row in 2.8 plain steps' time, 7% more per second than the plain step."""
    clock = FakeClock()
    policy = BatchPolicy(shapes_from(1, 4, 4, False, chains=False), clock=clock, tuning=tuning)
    tree = chain_tree(torch.tensor([[9, 1, 2, 3, 4]] * rows), torch.tensor([5] * rows))
    verdict = SimpleNamespace(path=torch.tensor([[0, 1, 2, -1, -1]] * rows), num_accepted=torch.tensor([2] * rows))
    picks = []
    for _ in range(steps):
        picks.append(policy.choose(rows))
        clock.advance(seconds[picks[-1]])
        policy.observe(tree, verdict)
    return picks


def test_another_tuning_changes_the_decisions_on_a_fake_clock():
    default = _drive(PolicyTuning())
    assert _drive(PolicyTuning()) == default  # the clock is the test's: the same run twice
    assert default.count(0) >= 50  # from 8 rows a measured 7% gain beats the 5% margin: the tree
    strict = _drive(PolicyTuning(margin=0.15))  # a 15% margin: plain steps, rare revisits
    assert strict.count(0) <= 5
    assert _drive(PolicyTuning(margin=0.0)).count(0) >= 50  # no margin: the tree wins
    assert _drive(PolicyTuning(margin=0.15, margin_rows=16)).count(0) >= 50  # below the margin's rows, any gain
    # min_samples: the tree is timed twice before its time is trusted, or once (from margin_rows rows its first step,
    # the call's first drafting step, counts: there the tree runs in bursts, each a switch, whose cost is its own)
    assert [i for i, p in enumerate(strict[:10]) if p == 0] == [0, 3]
    assert [i for i, p in enumerate(_drive(PolicyTuning(margin=0.15, min_samples=1))[:10]) if p == 0] == [0]


# ---- the old import paths ----------------------------------------------------------------------------------------
def test_the_old_import_paths_name_the_package():
    import importlib

    from hf_paralleldecode.decoding import budget, policy

    old_budget = importlib.import_module("hf_paralleldecode.decoding.budget")  # the module it was
    assert old_budget is budget is policy.budget and old_budget.CostAwareBudget is CostAwareBudget
    assert old_budget.forward_cost is forward_cost
    # the names the strategies and users import from decoding.policy
    assert all(hasattr(policy, name) for name in ("BatchPolicy", "Shape", "batch_policy", "check_policy_settings",
                                                  "shapes_from", "first_child_prefix", "path_prefix", "PLAIN",
                                                  "CHAIN_DEPTHS", "target_key", "acceptance_rule"))
