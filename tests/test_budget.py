"""Cost-aware budgets: the forward-cost curve, the acceptance model, the choice rule, and their use in packing."""

from __future__ import annotations

import pytest
import torch
from models import ARCHITECTURES, FakeClock, ForwardRecorder, enabled, prompts

from hf_paralleldecode.decoding.policy import CostAwareBudget, ForwardCost, forward_cost, memory_of, time_forwards
from hf_paralleldecode.engine.tree import pack_trees
from hf_paralleldecode.engine.verify import Verdict, walk_tree

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


def flat_budget(cost=None, mandatory=()):
    return CostAwareBudget(None, num_sources=3, mandatory_sources=mandatory,
                           cost=cost or ForwardCost([(1, 1.0), (256, 1.0)]))


def test_forward_cost_interpolates_is_non_decreasing_and_follows_the_run_level():
    cost = ForwardCost([(1, 1.0), (4, 0.5), (8, 3.0)])  # timing noise: 4 tokens "cheaper" than 1
    assert cost.points == [(1, 1.0), (4, 1.0), (8, 3.0)]
    assert cost(2) == pytest.approx(1.0) and cost(6) == pytest.approx(2.0) and cost(10) == pytest.approx(4.0)
    for _ in range(100):
        cost.observe(8, 6.0)  # the run's forwards take twice the calibration
    assert cost(8) == pytest.approx(6.0, rel=1e-3)
    with pytest.raises(ValueError):
        ForwardCost([(1, 1.0)])


def test_forward_cost_is_measured_once_per_model():
    model = enabled("llama")
    first = forward_cost(model, repeats=1)
    assert [n for n, _ in first.points][:3] == [1, 2, 4] and all(s > 0 for _, s in first.points)
    assert forward_cost(model).points == first.points  # cached: same shape, fresh level


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "gpt2"])
def test_time_forwards_reusing_the_prefix_runs_the_same_forwards_on_one_cropped_cache(arch):
    model = enabled(arch)
    runs = {}
    for reuse in (False, True):
        recorder = ForwardRecorder(model, keep_logits=True)
        try:
            times = time_forwards(model, context=6, repeats=2, tokens=(1, 3), batch=2, warmups=1,
                                  reuse_prefix=reuse)
        finally:
            recorder.restore()
        assert [n for n, _ in times.points] == [1, 3] and all(s > 0 for _, s in times.points) and times.prefill > 0
        prefills = [c for c in recorder.calls if c["cached"] == 0]
        timed = [(c, logits) for c, logits in zip(recorder.calls, recorder.logits) if c["cached"] != 0]
        assert all(c["fed"] == 6 for c in prefills) and len(prefills) == (1 if reuse else 6)
        # every timed forward sees exactly the prefix: the crop takes the cache back to it after each
        assert [(c["fed"], c["cached"]) for c, _ in timed] == [(1, 6)] * 3 + [(3, 6)] * 3
        runs[reuse] = [logits for _, logits in timed]
    for fresh, reused in zip(runs[False], runs[True]):  # the same tokens after the same prefix: the same logits
        torch.testing.assert_close(reused, fresh)


def test_time_forwards_times_prefills_from_an_empty_cache_on_the_given_clock():
    model = enabled("llama")
    clock = FakeClock()
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: clock.advance(0.5), with_kwargs=True)
    recorder = ForwardRecorder(model)
    try:
        times = time_forwards(model, context=0, repeats=3, tokens=(4, 8), warmups=0, clock=clock)
        with_prefix = time_forwards(model, context=5, repeats=1, tokens=(2, 3), warmups=0, reuse_prefix=True,
                                    clock=clock)
    finally:
        recorder.restore()
        hook.remove()
    assert times.points == [(4, 0.5), (8, 0.5)] and times.prefill is None  # one forward each, on the clock given
    assert [(c["fed"], c["cached"]) for c in recorder.calls][:6] == [(4, 0)] * 3 + [(8, 0)] * 3
    assert with_prefix.prefill == 0.5 and with_prefix.points == [(2, 0.5), (3, 0.5)]  # the one prefill, timed too


def test_time_forwards_refuses_what_it_cannot_time():
    model = enabled("llama")
    for bad in (dict(context=-1), dict(batch=0), dict(repeats=0), dict(warmups=-1), dict(tokens=()),
                dict(tokens=(0, 2))):
        with pytest.raises(ValueError, match="time_forwards needs"):
            time_forwards(model, **bad)
    model._is_stateful = True  # transformers' mark of a recurrent state (Mamba, RWKV, linear attention)
    try:
        with pytest.raises(ValueError, match="reuse_prefix=False"):
            time_forwards(model, context=4, tokens=(1, 2), repeats=1, reuse_prefix=True)
    finally:
        del model._is_stateful


def test_acceptance_model_counts_fresh_nodes_by_source_rank_and_depth():
    budget = flat_budget()
    tree = pack_trees(torch.tensor([0]), [[[1, 2, 3, 4], [1, 6], [7]]], sources=[[2, 2, 1]], budget=budget)
    # keys: source 2 rank 0 -> 8, source 2 rank 1 -> 9, source 1 rank 0 -> 4
    assert tree.candidate_sources.tolist() == [[8, 9, 4]]
    choices = torch.tensor([[1, 2, 3, 9, 9, 9, 9]])[:, : tree.width]  # accepts 1, 2, 3; rejects 4
    path, num = walk_tree(tree, choices)
    budget.learn(tree, Verdict(path, num, None, None))
    trials, hits = budget.acceptance.trials - 2, budget.acceptance.hits - 1  # minus the Beta(1, 1) prior
    assert trials[8, :5].tolist() == [1, 1, 1, 1, 0] and hits[8, :5].tolist() == [1, 1, 1, 0, 0]
    # candidate 9 shares its first token with 8: only its second token (depth 1) is its own node
    assert trials[9, :3].tolist() == [0, 1, 0] and hits[9, :3].tolist() == [0, 0, 0]
    assert trials[4, :2].tolist() == [1, 0] and hits[4, :2].tolist() == [0, 0]


def test_choice_takes_optional_nodes_while_they_pay():
    # flat cost: every node with P > 0 pays; steep cost: none does
    optional = torch.tensor([[0.9, 0.5, 0.1, float("-inf")]])
    zero = torch.zeros(1)
    assert flat_budget().choose(optional, zero, zero.long()) == 3
    steep = flat_budget(ForwardCost([(1, 1.0), (2, 10.0)]))
    assert steep.choose(optional, zero, zero.long()) == 0
    # T(n) = 1 + 0.5 n: tokens per second of k = 0..3 optional nodes are (1 + sum of the first k P) / T(k + 1)
    linear = flat_budget(ForwardCost([(1, 1.5), (2, 2.0), (3, 2.5), (4, 3.0)]))
    ratios = [1 / 1.5, 1.9 / 2.0, 2.4 / 2.5, 2.5 / 3.0]
    assert linear.choose(optional, zero, zero.long()) == max(range(4), key=ratios.__getitem__) == 2


def test_budgeted_packing_keeps_mandatory_nodes_and_takes_optional_ones_best_first():
    budget = flat_budget(ForwardCost([(1, 1.0), (2, 10.0)]), mandatory=(0,))  # optional nodes never pay
    tree = pack_trees(torch.tensor([0]), [[[1, 2, 3], [4, 5]]], sources=[[0, 2]], budget=budget)
    assert tree.tokens[0].tolist() == [0, 1, 2, 3]  # the mandatory chain only
    budget = flat_budget(mandatory=(0,))  # every node pays, the cap decides: best P first
    budget.acceptance.hits[8, 0] = budget.acceptance.trials[8, 0]  # context rank 0 at depth 0: always right
    tree = pack_trees(torch.tensor([0]), [[[1, 2, 3], [4, 5], [6, 7]]], sources=[[0, 2, 1]], budget=budget,
                      max_nodes=6)
    assert tree.tokens[0].tolist() == [0, 1, 2, 3, 4, 5]  # chain, then the confident context match
    assert tree.candidate_nodes[0] == [[1, 2, 3], [4, 5], []]
    with pytest.raises(ValueError, match="source id per candidate"):
        pack_trees(torch.tensor([0]), [[[1]]], budget=budget)


@pytest.mark.parametrize("decoding, settings", [("prompt_lookup", {}), ("lookahead", dict(context_matches=2)),
                                                ("jacobi_forcing", dict(block_size=4, context_matches=2))])
def test_cost_aware_strategies_report_their_choice(decoding, settings):
    model = enabled("llama")
    ids, mask = prompts(3)
    ids, mask = torch.cat([ids, ids], 1), torch.cat([mask, mask], 1)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, decoding=decoding,
                         cost_aware=True, return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, ref)
    assert out.stats["budget_optional_nodes_per_step"] >= 0 and out.stats["forward_cost"]["tokens"][0] == 1


def test_trim_keeps_the_best_nodes_by_path_value_parents_first():
    budget = flat_budget()  # flat cost: every node pays
    rates = budget.acceptance
    rates.hits[0], rates.trials[0] = 9.0, 10.0  # key 0: accepted 90% at every depth
    rates.hits[1], rates.trials[1] = 1.0, 10.0  # key 1: 10%
    # root 0; 1 (key 1) -> 3 (key 0); 2 (key 0) -> 4 (key 0); 5 (key 0) under 1
    keys, parents, depth = [-1, 1, 0, 0, 0, 0], [-1, 0, 0, 1, 2, 1], [0, 1, 1, 2, 2, 2]
    assert budget.trim([keys], [parents], [depth]) == [[0, 1, 2, 3, 4, 5]]
    # values: 2 -> 0.9, 4 -> 0.81, 1 -> 0.1, 3 and 5 -> 0.09. Tokens per second of k = 0, 1, 2, 3 nodes:
    # 1 / 1, 1.9 / 1.05, 2.71 / 1.1, 2.81 / 2.88: the 0.9 / 0.81 chain is kept
    steep = flat_budget(ForwardCost([(1, 1.0), (2, 1.05), (3, 1.1), (8, 10.0)]))
    steep.acceptance.hits.copy_(rates.hits)
    steep.acceptance.trials.copy_(rates.trials)
    assert steep.trim([keys], [parents], [depth]) == [[0, 2, 4]]
    # a batch shares k (the forward's width is the widest row's); a row with fewer nodes keeps what it has.
    # 2 rows: k = 0, 1, 2, 3 feed 2, 4, 6, 8 tokens: 2 / 1, 3.8 / 1, 4.61 / 1.1, 4.71 / 10
    batch = flat_budget(ForwardCost([(1, 1.0), (4, 1.0), (6, 1.1), (8, 10.0)]))
    batch.acceptance.hits.copy_(rates.hits)
    batch.acceptance.trials.copy_(rates.trials)
    assert batch.trim([keys, [-1, 0]], [parents, [-1, 0]], [depth, [0, 1]]) == [[0, 2, 4], [0, 1]]


def test_learn_counts_keyed_nodes_of_a_trimmed_tree():
    from hf_paralleldecode.engine.tree import tree_from_parents

    budget = flat_budget()
    tree = tree_from_parents(torch.tensor([0]), [[0, 5, 6, 7]], [[-1, 0, 1, 0]], [[0, 1, 2, 1]])
    tree.node_keys = torch.tensor([[-1, 4, 4, 9]])
    choices = torch.tensor([[5, 8, 9, 9]])  # accepts node 1 (5), rejects its child 6 and the sibling 7
    path, num = walk_tree(tree, choices)
    budget.learn(tree, Verdict(path, num, None, None))
    trials, hits = budget.acceptance.trials - 2, budget.acceptance.hits - 1
    assert trials[4, :2].tolist() == [1, 1] and hits[4, :2].tolist() == [1, 0]
    assert trials[9, :1].tolist() == [1] and hits[9, :1].tolist() == [0]
    assert trials.sum() == 3 and hits.sum() == 1


def test_a_keys_prior_sets_its_starting_rate_and_its_weight():
    budget = flat_budget()
    budget.acceptance.set_prior(3, 0.9)
    assert budget.acceptance.rates()[3, :4].tolist() == pytest.approx([0.9] * 4)
    assert budget.acceptance.rates()[2, 0] == pytest.approx(0.5)  # the other keys keep Beta(1, 1)
    budget.acceptance._count(torch.tensor([3]), torch.tensor([0]), torch.tensor([True]), torch.tensor([False]))
    assert budget.acceptance.rates()[3, 0] == pytest.approx(1.8 / 3)  # two verdicts' worth: one miss moves it a third


def test_statistics_carry_over_to_the_owners_next_call_capped_and_per_name():
    import gc
    import weakref

    class Owner:  # anything weakly referenceable: a model, a drafter
        pass

    owner = Owner()
    first = CostAwareBudget(None, num_sources=3, cost=ForwardCost([(1, 1.0), (256, 1.0)]), memory=(owner, "lookahead"))
    assert not first.carried
    first.acceptance.hits[8, 0], first.acceptance.trials[8, 0] = 91.0, 102.0  # 100 verdicts, 90 accepted
    first.acceptance.hits[4, 1], first.acceptance.trials[4, 1] = 2.0, 4.0  # 2 verdicts
    first.remember()
    second = CostAwareBudget(None, num_sources=3, cost=ForwardCost([(1, 1.0), (256, 1.0)]), memory=(owner, "lookahead"))
    assert second.carried
    rates = second.acceptance.rates()
    assert rates[8, 0] == pytest.approx(91 / 102) and second.acceptance.trials[8, 0] == pytest.approx(32.0)
    assert rates[4, 1] == pytest.approx(0.5) and second.acceptance.trials[4, 1] == pytest.approx(4.0)
    assert not CostAwareBudget(None, num_sources=3, cost=ForwardCost([(1, 1.0), (256, 1.0)]),
                               memory=(owner, "jacobi_forcing")).carried  # another strategy starts afresh
    assert not CostAwareBudget(None, num_sources=3, cost=ForwardCost([(1, 1.0), (256, 1.0)]),
                               memory=(Owner(), "lookahead")).carried  # another owner too
    kept = weakref.ref(memory_of(owner))

    del owner, first, second
    gc.collect()
    assert kept() is None  # kept on the owner: it goes with it


def test_a_second_generate_call_starts_from_the_first_calls_statistics():
    model = enabled("llama")
    ids, mask = prompts(2)
    ids, mask = torch.cat([ids, ids], 1), torch.cat([mask, mask], 1)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    memory_of(model).acceptance.clear()
    carried = []
    for _ in range(2):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             decoding="prompt_lookup", cost_aware=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        carried.append(out.stats["budget_carried_statistics"])
    assert carried == [False, True]
