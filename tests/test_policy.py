"""The batch's tree shape per step (decoding/policy.py): paired token estimates, measured step times, lossless."""

from __future__ import annotations

import pytest
import torch
from models import enabled, prompts, reference

from hf_paralleldecode import DraftHead
from hf_paralleldecode.decoding import policy as policy_module
from hf_paralleldecode.decoding.draft_tree import TreeBuilder
from hf_paralleldecode.decoding.policy import Shape, ShapePolicy, first_child_chain, shapes_from

pytestmark = pytest.mark.core


def test_shapes_are_the_configured_tree_then_shorter_chains_without_context_then_a_plain_step():
    plain = Shape(1, 0, 0, False)
    assert shapes_from(4, 16, 20, True) == [Shape(4, 16, 20, True), Shape(1, 8, 8, False), Shape(1, 4, 4, False),
                                            Shape(1, 2, 2, False), plain]
    assert shapes_from(1, 4, 4, False) == [Shape(1, 4, 4, False), Shape(1, 2, 2, False), plain]  # no repeats
    assert shapes_from(2, 6, 3, False) == [Shape(2, 6, 3, False), Shape(1, 3, 3, False), Shape(1, 2, 2, False), plain]
    assert plain.label == "plain" and Shape(1, 4, 4, False).label == "chain d4 b4"


def test_first_child_chain_follows_the_drafters_first_choice_as_far_as_the_tree_holds_it():
    bld = TreeBuilder(0, budget=6, width=2, max_depth=4, exact=True)
    children = {0: [(5, -0.1), (6, -2.0)]}
    while True:
        wanted = bld.wanted()
        if not wanted:
            break
        for v in wanted:
            bld.give(v, children.get(v, [(7 + bld.depth[v], -0.2), (9, -3.0)]))
    chain = first_child_chain(bld, 8)
    assert [bld.tokens[v] for v in chain] == [5, 8, 9, 10][: len(chain)] and len(chain) >= 3
    assert first_child_chain(bld, 2) == chain[:2]


def _measured(policy, bucket, seconds, relative):
    policy.tokens = [100.0] + [100.0 * r for r in relative]
    for i, s in enumerate(seconds):
        policy.times[(bucket, i)] = [s * 10, 10]


def test_the_policy_measures_every_shape_then_takes_the_best_predicted_rate_and_revisits_the_tree():
    policy = ShapePolicy(shapes_from(4, 16, 20, True), explore_every=4)
    first = [policy.choose(16) for _ in range(3)]
    assert first == [0, 0, 0]  # nothing known yet: the configured tree (it feeds the paired counts)
    _measured(policy, ShapePolicy.bucket(16), seconds=[0.100, 0.050, 0.040, 0.035, 0.030], relative=[0.7, 0.45, 0.3, 0.2])
    picks = [policy.choose(16) for _ in range(8)]
    assert 1 in picks and picks.count(0) >= 1  # chain-8: 0.7 / 0.05 beats the others; the tree is revisited
    _measured(policy, ShapePolicy.bucket(1), seconds=[0.020, 0.018, 0.016, 0.015, 0.014], relative=[0.7, 0.45, 0.3, 0.2])
    assert policy.choose(1) == 0  # at batch 1 the tree is worth its time


def test_paired_counts_come_only_from_steps_of_the_configured_tree():
    policy = ShapePolicy(shapes_from(4, 16, 20, True))
    policy.choose(2)
    policy.observe([5, 3], {1: [3, 2], 2: [2, 2], 3: [2, 1], 4: [1, 1]})
    assert policy.tokens == [8.0, 5.0, 4.0, 3.0, 2.0] and policy.relative_tokens(1) == 5 / 8
    policy.close()
    policy.choose(2)
    policy.observe([2, 2], None)  # a chain step: no counterfactual, the paired sums do not move
    assert policy.tokens == [8.0, 5.0, 4.0, 3.0, 2.0]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_output_is_exact_whichever_shapes_the_policy_picks(monkeypatch, arch, batch):
    """Make the chains look fast: the run switches shapes between steps, and the output is still stock greedy."""
    model = enabled(arch)
    torch.manual_seed(0)
    head = DraftHead.for_target(model, attention="block_bidirectional", block_size=8)
    choices = iter([0, 1, 4, 2, 0, 3, 4, 4, 1] * 20)  # plain steps too, back to back

    def scripted(self, rows):
        k = next(choices)
        self.used[k] += 1
        self._pending, self._done = (k, 0, 0.0), False
        return k

    monkeypatch.setattr(ShapePolicy, "choose", scripted)
    ids, mask = prompts(batch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=head, tree_budget=16, tree_width=3, context_matches=2,
                         return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, reference(arch, batch, 24), rtol=0, atol=0)
    assert len(out.stats["shape_steps"]) == 5


def test_sampling_keeps_the_configured_shape_and_measurements_carry_over():
    model = enabled("llama")
    torch.manual_seed(0)
    head = DraftHead.for_target(model, attention="block_bidirectional", block_size=8)
    ids, mask = prompts(2)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                         decoding="speculative", drafter=head, return_dict_in_generate=True)
    assert "shape_steps" not in out.stats
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         decoding="speculative", drafter=head, return_dict_in_generate=True)
    assert out.stats["shape_steps"] and head in policy_module._MEMORY
    with pytest.raises(ValueError, match="adaptive"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, decoding="speculative", drafter=head,
                       adaptive="yes")
