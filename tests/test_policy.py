"""The batch's tree shape per step (decoding/policy.py): paired token estimates, measured step times, lossless."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from models import FakeClock, enabled, prompts, reference, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode import DraftHead, Eagle3Drafter
from hf_paralleldecode.decoding.policy import (
    BatchPolicy,
    PolicyTuning,
    Shape,
    expected_max,
    first_child_prefix,
    memory_of,
    path_prefix,
    shapes_from,
)
from hf_paralleldecode.engine.tree import chain_tree, tree_from_parents

pytestmark = pytest.mark.core


def test_shapes_are_the_configured_tree_then_shorter_chains_without_context_then_a_plain_step():
    plain = Shape(1, 0, 0, False)
    assert shapes_from(4, 16, 20, True) == [Shape(4, 16, 20, True), Shape(1, 8, 8, False), Shape(1, 4, 4, False),
                                            Shape(1, 2, 2, False), plain]
    assert shapes_from(1, 4, 4, False) == [Shape(1, 4, 4, False), Shape(1, 2, 2, False), plain]  # no repeats
    assert shapes_from(2, 6, 3, False) == [Shape(2, 6, 3, False), Shape(1, 3, 3, False), Shape(1, 2, 2, False), plain]
    assert plain.label == "plain" and Shape(1, 4, 4, False).label == "chain d4 b4"
    assert shapes_from(12, 3, 50, True, chains=False) == [Shape(12, 3, 50, True), plain]  # a lookahead window
    # context chains: the first context match alone, no drafter forward
    assert shapes_from(4, 16, 20, True, context_depth=6)[4:] == [Shape(1, 6, 6, True, drafter=False),
                                                                  Shape(1, 4, 4, True, drafter=False),
                                                                  Shape(1, 2, 2, True, drafter=False), plain]
    assert Shape(1, 4, 4, True, drafter=False).label == "context chain d4"


def test_shapes_of_one_kind_differ_by_depth_and_budget_only():
    """A kind (width, context matches, drafter forward) is what lets one shape's time floor another's: the drafter's
    chains are one kind, the context chains another, the configured tree a third."""
    chains = [Shape(1, d, d, False) for d in (8, 4, 2)]
    assert len({c.kind for c in chains}) == 1
    assert Shape(1, 4, 4, True, drafter=False).kind != chains[0].kind != Shape(4, 16, 20, True).kind


def test_path_prefix_counts_the_accepted_nodes_that_follow_a_given_path():
    verdict = _verdict([[0, 3, 7, 8], [0, 3, -1, -1], [0, 1, 2, 5]])
    nodes = torch.tensor([[3, 7, 9], [3, 7, -1], [4, -1, -1]])
    assert path_prefix(verdict, nodes).tolist() == [2, 1, 0]


def _verdict(path):
    return SimpleNamespace(path=torch.tensor(path))


def test_first_child_prefix_is_how_far_the_accepted_path_ran_along_first_children():
    # row 0: root -> 1 (first child) -> 3 (first child of 1) -> 5 (second child of 3)
    # row 1: root -> 2 (second child of the root)
    tree = tree_from_parents(torch.tensor([9, 9]), [[9, 1, 2, 3, 4, 5, 6], [9, 1, 2]],
                             [[-1, 0, 0, 1, 1, 3, 3], [-1, 0, 0]], [[0, 1, 1, 2, 2, 3, 3], [0, 1, 1]])
    assert first_child_prefix(tree, _verdict([[0, 1, 3, 6], [0, 2, -1, -1]])).tolist() == [2, 0]
    assert first_child_prefix(tree, _verdict([[0, 1, 3, 5], [0, 1, -1, -1]])).tolist() == [3, 1]
    assert first_child_prefix(tree, _verdict([[0], [0]])).tolist() == [0, 0]
    chain = chain_tree(torch.tensor([[4, 5, 6, 7]]), torch.tensor([4]))
    assert first_child_prefix(chain, _verdict([[0, 1, 2, -1]])).tolist() == [2]


def _measured(policy, bucket, seconds, relative):
    policy.tokens = [100.0] + [100.0 * r for r in relative]
    policy.own[0] = [100.0, 20.0]  # the tree has run
    for i, s in enumerate(seconds):
        policy.times[(bucket, i)] = [s] * 4


def test_the_policy_measures_every_shape_then_takes_the_best_predicted_rate_and_revisits_the_tree():
    policy = BatchPolicy(shapes_from(4, 16, 20, True), explore_every=4)
    first = [policy.choose(16) for _ in range(3)]
    assert first == [0, 0, 0]  # nothing known yet: the configured tree (it feeds the paired counts)
    _measured(policy, BatchPolicy.bucket(16), seconds=[0.100, 0.050, 0.040, 0.035, 0.030], relative=[0.7, 0.45, 0.3, 0.2])
    policy.budget = 1.0  # (an exploration budget that covers a revisit; see the revisit tests)
    picks = [policy.choose(16) for _ in range(8)]
    assert 1 in picks and picks.count(0) >= 1  # chain-8: 0.7 / 0.05 beats the others; the tree is revisited
    _measured(policy, BatchPolicy.bucket(1), seconds=[0.020, 0.018, 0.016, 0.015, 0.014], relative=[0.7, 0.45, 0.3, 0.2])
    assert policy.choose(1) == 0  # at batch 1 the tree is worth its time


def test_a_losing_tree_is_revisited_only_when_the_budget_covers_the_loss_and_the_gap_has_passed():
    policy = BatchPolicy(shapes_from(4, 16, 20, True), explore_every=4)
    b = BatchPolicy.bucket(16)
    # tree: 1.0 / 0.1 = 10 per second; chain 8: 0.7 / 0.05 = 14, the best; a revisit loses 0.1 * (1 - 10 / 14)
    _measured(policy, b, seconds=[0.100, 0.050, 0.040, 0.035, 0.030], relative=[0.7, 0.45, 0.3, 0.2])
    loss = 0.1 * (1 - 10 / 14)
    policy.since_tree, policy.budget = 100, 0.9 * loss
    assert {policy.choose(16) for _ in range(20)} == {1}  # the gap has passed, the budget does not cover the loss
    policy.budget = 1.1 * loss
    assert policy.choose(16) == 0 and policy.gap == 8 and abs(policy.budget - 0.1 * loss) < 1e-12
    policy.budget = 10.0
    picks = [policy.choose(16) for _ in range(30)]
    assert picks == [1] * 8 + [0] + [1] * 16 + [0] + [1] * 4 and policy.gap == 32  # the gap doubles each visit
    # the budget grows by explore_share of the measured time of each step away from the tree, not on the tree's own
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    policy._pending, policy._done = (1, b, 0.0), True
    policy.close()
    grown = policy.budget
    assert grown > 0
    policy._pending, policy._done = (0, b, 0.0), True
    policy.close()
    assert policy.budget == grown


def test_a_revisit_pays_its_measured_time_not_its_estimate():
    """A revisit's first drafting step of a call also reads the whole prompt (left out of the tree's step times), a
    drafter that skipped the plain steps catches up on them: the budget pays what the step took, so revisits that cost
    more than estimated come less often (measured at temperature 0.8, batch 1, JF model: 6.4% of steps speculated
    before, 2.3% after)."""
    clock = FakeClock(100.0)
    policy = BatchPolicy(shapes_from(4, 16, 20, True), explore_every=4, clock=clock)
    b = BatchPolicy.bucket(1)
    _measured(policy, b, seconds=[0.100, 0.050, 0.040, 0.035, 0.030], relative=[0.7, 0.45, 0.3, 0.2])
    loss = 0.1 * (1 - 10 / 14)
    policy.since_tree, policy.budget = 100, loss + 0.01
    assert policy.choose(1) == 0
    policy._pending, policy._done = (0, b, clock() - 0.4), True  # the step took 0.4 s, 4x its estimate
    policy.close()
    assert policy.budget == pytest.approx(0.01 - 0.3)
    # steps away from the tree refill it before the next revisit is paid for
    policy.since_tree = 1000
    picks = []
    for _ in range(40):
        picks.append(policy.choose(1))
        policy._pending, policy._done = (picks[-1], b, clock() - 0.05), True
    assert 0 not in picks and policy.budget == pytest.approx(0.01 - 0.3 + 39 * 0.01 * 0.05)
    # a revisit that took less than its estimate gives the difference back; a step of the tree that was not a
    # revisit paid from the budget (the policy's first steps, a tree that wins) changes nothing
    policy.budget = loss
    policy.since_tree = 1000
    assert policy.choose(1) == 0
    policy._pending, policy._done = (0, b, clock() - 0.06), True
    policy.close()
    refund = 0.04 + 0.01 * 0.05  # (and the last chain step, closed by that choice, added its share)
    assert policy.budget == pytest.approx(refund)
    policy._pending, policy._done = (0, b, clock() - 0.5), True
    policy.close()
    assert policy.budget == pytest.approx(refund)


def test_a_tree_whose_time_rests_on_a_slow_first_step_is_revisited_without_budget():
    """Two steps of the tree in a bucket, one slowed by a warm-up, make its mean time 5x too high: a budget sized on
    that loss would lock the tree out for good. Until three steps (the slowest then left out) the tree is revisited
    at its gaps whatever the budget."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), explore_every=4)
    b = BatchPolicy.bucket(1)
    _measured(policy, b, seconds=[0.100, 0.050, 0.040, 0.035, 0.030], relative=[0.7, 0.45, 0.3, 0.2])
    policy.times[(b, 0)] = [0.190, 0.010]  # a warm-up step and a real one: mean 0.1
    policy.since_tree, policy.budget = 100, 0.0
    assert policy.choose(1) == 0 and policy.budget == 0.0  # revisited, no budget spent
    policy.times[(b, 0)].append(0.010)  # three steps: the slowest is left out, 10 ms: the tree is the best
    assert policy.choose(1) == 0
    policy.times[(b, 0)] = [0.1] * 3  # a trusted time that loses: the budget rule again
    policy.since_tree, policy.budget = 100, 0.0
    assert policy.choose(1) == 1


def test_revisit_state_carries_over_to_the_next_call_of_the_same_owner():
    class Owner:
        pass

    owner, shapes = Owner(), shapes_from(4, 16, 20, True)
    policy = BatchPolicy(shapes, memory=(owner, "key"))
    policy.since_tree, policy.gap, policy.budget = 37, 64, 0.25
    policy.finish()
    again = BatchPolicy(shapes, memory=(owner, "key"))
    assert (again.since_tree, again.gap, again.budget) == (37, 64, 0.25)
    assert (BatchPolicy(shapes, memory=(owner, "other")).gap, BatchPolicy(shapes).gap) == (16, 16)


def test_paired_counts_come_only_from_steps_of_the_configured_tree():
    clock = FakeClock()
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock)  # tree, chain 8, chain 4, chain 2, plain
    assert policy.tokens == [17.0, 1.0, 1.0, 1.0, 1.0]  # the prior: the tree commits its depth + 1, the others 1
    policy.tokens = [0.0] * 5  # (plain sums below)
    tree = tree_from_parents(torch.tensor([9, 9]), [[9, 1, 2, 3, 4], [9, 1, 2]], [[-1, 0, 1, 2, 3], [-1, 0, 0]],
                             [[0, 1, 2, 3, 4], [0, 1, 1]])
    policy.choose(2)
    verdict = SimpleNamespace(path=torch.tensor([[0, 1, 2, 3, 4], [0, 2, -1, -1, -1]]), num_accepted=torch.tensor([4, 1]))
    policy.observe(tree, verdict)  # row 0 accepted 4 along first children, row 1 a second child
    assert policy.tokens == [7.0, 6.0, 6.0, 4.0, 2.0] and policy.relative_tokens(1) == 6 / 7
    # the tree's and the plain step's times are known: chain 8 is the next to measure, since its tokens over the
    # plain step's time (6/7 / 0.05) beat the tree's rate (1 / 0.1)
    policy.times[(BatchPolicy.bucket(2), 0)] = [0.1] * 4
    policy.times[(BatchPolicy.bucket(2), 4)] = [0.05] * 4
    clock.advance(0.1)  # (the tree's step took its time)
    policy.choose(2)  # a chain step: its own counts, and a paired step of what it says
    assert policy.index == 1
    policy.observe(chain_tree(torch.tensor([[9, 1], [9, 1]]), torch.tensor([2, 2])),
                   SimpleNamespace(path=torch.tensor([[0, 1], [0, -1]]), num_accepted=torch.tensor([1, 0])))
    assert policy.own[1] == [3.0, 2.0]
    # chain 8 committed 1.5 tokens a row where the paired sums (2.9604 row-steps: a 2-row step decays them by
    # 0.98 ** 2) said 6 / 2.9604: the tree moves with it (its share scaled by 0.74), the shorter chains get what they
    # would have committed on it (2 and 1 tokens), the plain step one token a row
    d, paired = 0.98 ** 2, 0.98 ** 2 + 2
    scale = 1.5 * paired / 6
    assert policy.tokens == pytest.approx([d * 7 + 2 * 7 / paired * scale, d * 6 + 3, d * 6 + 3, d * 4 + 3, d * 2 + 2])
    assert policy.relative_tokens(1) == pytest.approx(6 / 7)  # the tree's paired ratio to chain 8 stays


def test_a_tree_seen_only_on_hard_text_does_not_value_the_chains_low_for_good():
    """At a large batch the configured tree may run only on a call's first steps, the least predictable text; what
    the chains then commit on their own steps moves the level of every speculating shape against the plain step (the
    base model's 1B twin at 16 rows ran plain steps beside a chain of 2 alone 1.06x faster)."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=FakeClock())  # tree, chain 8, chain 4, chain 2, plain
    b, rows = BatchPolicy.bucket(16), 16
    policy.tokens, policy.paired_rows = [320.0, 190.0, 180.0, 160.0, 100.0], 100.0  # tree 3.2, chain 2 1.6 a row
    policy.squares = [t * t / 100.0 for t in policy.tokens]
    policy.own[0] = [320.0, 100.0]
    for i, t in ((0, 0.50), (1, 0.40), (2, 0.30), (3, 0.20), (4, 0.11)):
        policy.times[(b, i)] = [t] * 4
    assert policy.choose(rows) == 4  # chain 2: 1.6 / 0.2 = 8 tokens a second; plain 1 / 0.11 = 9.1
    chain = chain_tree(torch.tensor([[9, 1, 2]] * rows), torch.tensor([3] * rows))
    accepted = SimpleNamespace(path=torch.tensor([[0, 1, 2]] * rows), num_accepted=torch.tensor([2] * rows))
    for _ in range(3):  # the chain runs on easier text: 3 tokens a row
        policy._pending = (3, b, policy.clock())
        policy.observe(chain, accepted)
        policy._done = False
    assert policy.relative_tokens(3) / policy.relative_tokens(4) > 1.9  # chain 2 against the plain step
    assert policy.relative_tokens(3) / policy.relative_tokens(0) == pytest.approx(0.5)  # the paired ratio stays
    assert policy.choose(rows) == 3
    # a lagged step (a hole in the drafter's context) and a plain step do not move the level
    before = list(policy.tokens)
    policy.lagged()
    policy.observe(chain, SimpleNamespace(path=torch.tensor([[0, -1, -1]] * rows), num_accepted=torch.tensor([0] * rows)))
    policy._pending, policy._done = (4, b, policy.clock()), False
    policy.observe(chain_tree(torch.tensor([[9]] * rows), torch.tensor([1] * rows)),
                   SimpleNamespace(path=torch.tensor([[0]] * rows), num_accepted=torch.tensor([0] * rows)))
    assert policy.tokens == before


def test_a_large_batch_step_outweighs_the_steps_before_it_but_not_the_whole_history():
    """The token sums decay per row-step (``decay``) and by at least ``step_decay`` a step: with 0.98 a step, the JF
    model's 1B twin at 64 rows saw a chain of 4 commit 4 tokens a row-step on two steps and still valued it at 3.1
    from the steps before (chain 2's, at the call's start), and took plain steps for the rest of the call."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=FakeClock())  # tree, chain 8, chain 4, chain 2, plain
    assert policy.decay(1) == pytest.approx(0.98) and policy.decay(2) == pytest.approx(0.98 ** 2)
    assert policy.decay(64) == pytest.approx(0.9) and policy.decay(0) == pytest.approx(0.98)
    assert BatchPolicy(policy.shapes, tuning=PolicyTuning(step_decay=1.0)).decay(64) == 1.0  # (no decay at all)
    b, rows = BatchPolicy.bucket(64), 64
    policy.tokens, policy.paired_rows = [1280.0, 900.0, 800.0, 700.0, 256.0], 256.0  # chain 4: 3.1 a row-step
    policy.squares = [t * t / 256.0 for t in policy.tokens]
    policy.own[0] = [1280.0, 256.0]
    chain = chain_tree(torch.cat([torch.full((rows, 1), 9), torch.arange(1, 5).repeat(rows, 1)], 1),
                       torch.tensor([5] * rows))
    full = SimpleNamespace(path=torch.arange(5).repeat(rows, 1), num_accepted=torch.tensor([3] * rows))
    for _ in range(2):  # two steps of chain 4, 4 tokens a row
        policy._pending, policy._done = (2, b, policy.clock()), False
        policy.observe(chain, full)
    assert policy.tokens[2] == pytest.approx(0.81 * 800 + 0.9 * 256 + 256)
    assert policy.paired_rows == pytest.approx(0.81 * 256 + 0.9 * 64 + 64)
    assert policy.tokens[2] / policy.paired_rows > 3.4  # (0.98 a step: 3.35)


def test_while_the_plain_step_wins_a_revisit_takes_the_speculating_shape_that_loses_least():
    """At 64 rows a tree step may cost a dozen plain steps, so its revisits are never covered by the budget; a
    chain measured on a call's first steps (the least predictable text) was then never measured again (the base
    model's 1B twin at 64 rows in fp32: plain steps beside a chain of 2 alone 1.07x faster). While the plain step
    wins, a revisit takes the speculating shape predicted to lose least, paid from the same budget and gaps."""
    clock = FakeClock()
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock)  # tree, chain 8, chain 4, chain 2, plain
    b, rows = BatchPolicy.bucket(64), 64
    per_row = [5.0, 3.4, 3.0, 2.2, 1.0]
    policy.paired_rows = 100.0
    policy.tokens = [t * 100 for t in per_row]
    policy.squares = [t * t * 100 for t in per_row]
    policy.own[0] = [500.0, 100.0]
    for i, t in enumerate((47.0, 21.0, 12.8, 8.4, 3.65)):  # chain 2: 2.2 / 8.4 = 0.262 a second; plain 0.274
        policy.times[(b, i)] = [t] * 4
    policy.used = [1, 0, 0, 2, 10]  # (past a call's first steps)
    policy.since_tree, policy.gap, policy.budget = 20, 16, 1.0  # the gap has passed; 1 s covers chain 2's loss only
    assert policy.choose(rows) == 3
    loss = 8.4 * (1 - (2.2 / 8.4) / (1 / 3.65))
    assert policy.budget == pytest.approx(1.0 - loss) and (policy.since_tree, policy.gap) == (0, 32)
    policy.observe(chain_tree(torch.tensor([[9, 1, 2]] * rows), torch.tensor([3] * rows)),
                   SimpleNamespace(path=torch.tensor([[0, 1, 2]] * rows), num_accepted=torch.tensor([2] * rows)))
    clock.advance(9.0)
    assert policy.choose(rows) in (3, 4)  # (the revisit said chain 2 commits 3 a row-step: it may win now)
    assert policy.budget == pytest.approx(1.0 - loss - (9.0 - 8.4))  # it paid what it took, and earned nothing
    # the tree still gets the revisit while a chain wins, and no chain is revisited then
    other = BatchPolicy(shapes_from(4, 16, 20, True), clock=FakeClock())
    other.paired_rows, other.tokens, other.squares = policy.paired_rows, list(policy.tokens), list(policy.squares)
    other.tokens[3] = 3.0 * other.paired_rows  # chain 2 now wins
    other.own[0] = [500.0, 100.0]
    other.times = {k: list(v) for k, v in policy.times.items()}
    other.used, other.since_tree, other.gap, other.budget = [1, 0, 0, 2, 10], 20, 16, 1.0
    assert other.choose(rows) == 3 and other.budget == pytest.approx(1.0)  # the tree's loss is not covered


def test_a_chain_step_says_what_a_deeper_chain_commits_through_what_it_was_seen_to_commit_beyond_it():
    """A chain's step is exact for every row that stopped short of its depth (a deeper chain of the same drafter stops
    there too); on the rows that accepted its whole depth, the deeper chain commits that depth + 1 plus what it was
    seen to commit beyond it on such rows (the tree's steps, and the deeper chain's own). Scaling every deeper chain
    by the shallow chain's tokens froze their ratio at the one the tree's steps had seen (the JF model's 1B twin at
    batch 4 ran a chain of 2 for a whole process beside a chain of 4 alone 1.14x faster)."""
    owner = SimpleNamespace()
    shapes = shapes_from(4, 16, 20, True)  # tree, chain 8, chain 4, chain 2, plain
    policy = BatchPolicy(shapes, clock=FakeClock(), memory=(owner, "key"))
    b, rows, decay = BatchPolicy.bucket(4), 4, policy.decay(4)

    def step(pick, accepted, depth):
        policy._pending, policy._done = (pick, b, policy.clock()), False
        drafts = torch.arange(1, depth + 1).repeat(rows, 1)
        path = torch.tensor([[*range(a + 1), *[-1] * (depth - a)] for a in accepted])
        policy.observe(chain_tree(torch.cat([torch.full((rows, 1), 9), drafts], 1), torch.tensor([depth + 1] * rows)),
                       SimpleNamespace(path=path, num_accepted=torch.tensor(accepted)))

    step(0, [1, 1, 6, 6], 8)  # the tree: two rows stop at 1, two run 6 along the drafter's chain
    assert policy.beyond[(3, 2)] == [4.0, 2.0]  # chain 4 beyond chain 2's depth where chain 2 was full: 2 a row
    assert policy.beyond[(3, 1)] == [8.0, 2.0] and policy.beyond[(2, 1)] == [4.0, 2.0]
    before = list(policy.tokens)
    step(3, [2, 2, 2, 0], 2)  # chain 2 on easier text: three rows full, one stops at once
    assert policy.tokens[3] == pytest.approx(decay * before[3] + 3 + 3 + 3 + 1)  # its own: exact
    assert policy.tokens[2] == pytest.approx(decay * before[2] + 5 + 5 + 5 + 1)  # chain 4: 2 + 1 + 2 where full
    assert policy.tokens[1] == pytest.approx(decay * before[1] + 7 + 7 + 7 + 1)  # chain 8: 2 + 1 + 4 where full
    step(2, [4, 3, 1, 4], 4)  # chain 4's own step is exact for chain 2 beyond its depth, and censored for chain 8
    assert policy.beyond[(3, 2)] == pytest.approx([decay * 4.0 + 2 + 1 + 2, decay * 2.0 + 3])
    assert policy.beyond[(2, 1)] == [4.0, 2.0]
    policy.finish()  # it carries over to the owner's next call, with the rest
    assert BatchPolicy(shapes, memory=(owner, "key")).beyond == policy.beyond


def test_a_chain_that_cannot_beat_the_tree_is_never_measured():
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    b = BatchPolicy.bucket(1)
    policy.tokens = [100.0, 70.0, 45.0, 30.0, 15.0]  # the tree commits 6.7 tokens per step, chain 8 0.7 of that
    policy.own[0] = [100.0, 15.0]
    policy.times[(b, 0)] = [0.010] * 4  # rate 1.0
    assert policy.choose(1) == 4  # the plain step is measured first
    policy.times[(b, 4)] = [0.009] * 4  # 9 ms: chain 8 could reach 0.7 / 0.009 = 78 < 1 / 0.010 = 100: no chain is tried
    assert {policy.choose(1) for _ in range(40)} == {0}
    policy.times[(b, 0)] = [0.050] * 4  # the tree becomes slow (50 ms): the chains are worth measuring again
    assert policy.choose(1) == 1


def test_a_token_cap_keeps_wide_shapes_out_and_the_plain_step_in():
    policy = BatchPolicy(shapes_from(4, 16, 20, True), max_step_tokens=40)
    assert policy.allowed(1) == [0, 1, 2, 3, 4]
    assert policy.allowed(8) == [2, 3, 4]  # 8 x 5 tokens fit, 8 x 9 do not
    assert policy.allowed(40) == [4]
    for _ in range(30):
        assert policy.choose(8) in (2, 3, 4)
        policy.observe(chain_tree(torch.tensor([[9, 1]] * 8), torch.tensor([2] * 8)),
                       SimpleNamespace(path=torch.tensor([[0, 1]] * 8), num_accepted=torch.tensor([1] * 8)))


def _script(monkeypatch, picks):
    """Make the policy pick ``picks`` (cycled; an index past the strategy's shapes wraps around)."""
    choices = itertools.cycle(picks)

    def scripted(self, rows):
        self.close()
        k = next(choices) % len(self.shapes)
        self.used[k] += 1
        self.row_steps[k] += rows
        self._pending, self._done = (k, 0, 0.0), False
        return k

    monkeypatch.setattr(BatchPolicy, "choose", scripted)


STRATEGIES = [
    ("speculative", dict(tree_budget=16, tree_width=3, context_matches=2)),
    ("speculative", dict(tree_budget=12, tree_width=2, context_matches=2, context_tokens=5, drafter="eagle3")),
    ("speculative", dict(tree_budget=12, tree_width=2, tree_depth=4, context_matches=1, drafter="tree_causal")),
    ("speculative", dict(tree_budget=10, tree_width=2, tree_depth=4, context_matches=2, drafter="deer")),
    ("jacobi", dict(block_size=6)),
    ("jacobi_forcing", dict(block_size=3, num_blocks=2, pool_size=2, context_matches=2)),
    ("lookahead", dict(window_size=3, ngram_size=3, guess_set_size=2, context_matches=1)),
    ("prompt_lookup", dict(num_tokens=4, max_matches=3)),
]


def _settings(model, decoding, settings):
    if decoding == "speculative":
        torch.manual_seed(0)
        kind = settings.get("drafter", "block_bidirectional")
        if kind == "deer":  # a block-causal DEER drafter (the embedded checkpoints' kind): it catches up after plain steps
            drafter = hfpd.DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4)
        else:
            drafter = (Eagle3Drafter.for_target(model) if kind == "eagle3"
                       else DraftHead.for_target(model, attention=kind, block_size=8))
        return {**settings, "drafter": drafter}
    return settings


def _ids(strategies):
    return [d if d != "speculative" else f"speculative-{s.get('drafter', 'block_bidirectional')}" for d, s in strategies]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("decoding, settings", STRATEGIES, ids=_ids(STRATEGIES))
def test_output_is_exact_whichever_shapes_the_policy_picks(monkeypatch, arch, batch, decoding, settings):
    """The shapes switch between steps (plain steps back to back too), and the output is still stock greedy."""
    from hf_paralleldecode.decoding.speculative import DraftProposer

    monkeypatch.setattr(DraftProposer, "context_chains", True)  # speculative's context chains too (shapes 4 to 6)
    model = enabled(arch)
    _script(monkeypatch, [0, 1, -1, 2, 0, 3, 4, 5, -1, -1, 6, 1, 4])
    ids, mask = prompts(batch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, decoding=decoding,
                         return_dict_in_generate=True, **_settings(model, decoding, settings))
    torch.testing.assert_close(out.sequences, reference(arch, batch, 24), rtol=0, atol=0)
    assert len(out.stats["shape_steps"]) >= 2 and 0 < out.stats["speculated_row_share"] < 1


@pytest.mark.parametrize("batch", [1, 3])
def test_the_step_trace_records_every_step_in_order_with_its_rows_tokens_time_and_setup(monkeypatch, batch):
    """``stats["step_trace"]``: one ``[shape, rows, committed tokens, seconds, setup]`` per step, in the order run,
    summing to the shape counts; the call's first drafting step is its setup step (the drafter read the prompt)."""
    model = enabled("llama")
    _script(monkeypatch, [0, -1, -1, 1, 0])
    ids, mask = prompts(batch)
    decoding, settings = "speculative", dict(tree_budget=10, tree_width=2, tree_depth=4, drafter="deer")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, decoding=decoding,
                         return_dict_in_generate=True, **_settings(model, decoding, settings))
    torch.testing.assert_close(out.sequences, reference("llama", batch, 24), rtol=0, atol=0)
    trace = out.stats["step_trace"]
    assert [t[0] for t in trace[:3]] == [trace[0][0], "plain", "plain"] and trace[0][0] != "plain"
    assert trace[0][4] == "first" and all(t[4] is None for t in trace if t[0] == "plain")
    assert all(1 <= rows <= batch and rows <= tokens and seconds > 0 for _, rows, tokens, seconds, _ in trace)
    assert all(tokens == rows for shape, rows, tokens, _, _ in trace if shape == "plain")  # a plain step: one a row
    steps, row_steps = {}, {}
    for shape, rows, *_ in trace:
        steps[shape], row_steps[shape] = steps.get(shape, 0) + 1, row_steps.get(shape, 0) + rows
    assert steps == out.stats["shape_steps"] and row_steps == out.stats["shape_row_steps"]
    assert out.num_forward_passes > len(trace)  # (the prefill is a forward too)


@pytest.mark.parametrize("kind", ["block_bidirectional", "deer"])
def test_plain_steps_are_not_drafting_steps_in_the_drafters_statistics(monkeypatch, kind):
    # tau (accepted drafted tokens + 1 per drafting step), the acceptance by depth the bench derives from the
    # accepted lengths, and the drafter forwards per step describe the drafter: a plain step the policy chose
    # commits one token without a draft, and counting it would read as a worse drafter
    model = enabled("llama")
    settings = _settings(model, "speculative", dict(tree_budget=10, tree_width=2, tree_depth=4, drafter=kind))
    ids, mask = prompts(3)
    _script(monkeypatch, [0, -1, -1, 0, -1])  # the configured tree, then two plain steps (the last shape), ...
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, decoding="speculative",
                         return_dict_in_generate=True, **settings)
    torch.testing.assert_close(out.sequences, reference("llama", 3, 24), rtol=0, atol=0)
    stats, draft = out.stats, out.draft_stats
    drafting = sum(n for label, n in stats["shape_steps"].items() if label != "plain")
    assert stats["shape_steps"]["plain"] > 0 and draft.steps == drafting == len(stats["accepted_lengths"])
    flat = [t for step in stats["accepted_lengths"] for t in step]
    assert stats["mean_accepted_length"] == pytest.approx(sum(flat) / len(flat))
    assert stats["drafter_forwards_per_step"] == pytest.approx(draft.drafter_forwards / drafting)
    assert out.num_forward_passes == drafting + stats["shape_steps"]["plain"] + 1


@pytest.mark.parametrize("decoding, settings", STRATEGIES, ids=_ids(STRATEGIES))
def test_the_policy_is_on_by_default_and_its_measurements_carry_over(decoding, settings):
    model = enabled("llama")
    settings = _settings(model, decoding, settings)
    ids, mask = prompts(2)
    for sample in (False, True):  # greedy and sampled runs both use it
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=sample,
                             decoding=decoding, return_dict_in_generate=True, **settings)
        assert out.stats["shape_steps"] and out.stats["adaptive"] is True
    owner = settings.get("drafter", model)
    assert any(key[0] == decoding for key in memory_of(owner).policy)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, decoding=decoding, adaptive=False,
                         return_dict_in_generate=True, **settings)
    assert "shape_steps" not in out.stats


@pytest.mark.parametrize("adaptive", [False, True])
def test_which_statistics_are_reproducible_depends_on_adaptive(monkeypatch, small_vocab, adaptive):
    """What docs/batch-policy.md promises: with adaptive=False the forwards and accepted lengths of a call are the
    same whatever the clock reads; with adaptive=True the policy times its steps, and a device where each fed token
    costs (a CPU) gets other shapes, so other counts, than one where a forward costs the same at any width."""
    from models import small_prompts

    now = [0.0]
    monkeypatch.setattr(memory_of(small_vocab), "clock", lambda: now[0])  # the clock the model's calls are timed on
    ids, mask = small_prompts(1)
    counts = {}
    for per_token in (0.0, 1.0):  # the clock a forward advances: per forward (flat), or per token fed (steep)
        def tick(module, args, kwargs, per_token=per_token):
            now[0] += 1.0 + per_token * kwargs["input_ids"].numel()

        hook = small_vocab.register_forward_pre_hook(tick, with_kwargs=True)
        try:
            torch.manual_seed(0)
            head = DraftHead.for_target(small_vocab, attention="tree_causal", block_size=4)  # no memory carried
            out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                       decoding="speculative", drafter=head, tree_budget=8, adaptive=adaptive,
                                       return_dict_in_generate=True)
        finally:
            hook.remove()
        counts[per_token] = (out.num_forward_passes, out.stats["accepted_lengths"])
    assert (counts[0.0] == counts[1.0]) is (not adaptive)


def test_greedy_and_sampled_calls_do_not_share_measurements():
    """A sampled call at temperature 0.8 accepts far less than a greedy one: it must not start from the greedy calls'
    token counts (nor a call at another temperature from its)."""
    model = enabled("llama")
    ids, mask = prompts(2)
    owner = model
    memory_of(owner).policy.clear()
    kinds = [dict(do_sample=False), dict(do_sample=True, temperature=0.8), dict(do_sample=True, temperature=0.3),
             dict(do_sample=False, repetition_penalty=1.3)]
    for kind in kinds + kinds:  # the second round reuses each kind's own measurements
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, decoding="prompt_lookup", **kind)
    keys = list(memory_of(owner).policy)
    assert len(keys) == 4 and len({k[:4] for k in keys}) == 1  # one entry per rule, the rest of the key alike
    rules = [k[4] for k in keys]
    assert rules[0] == (False, ()) and rules[1][0] and rules[1] != rules[2]
    assert any("repetition" in name.lower() for name, _ in rules[3][1])


@pytest.mark.parametrize("decoding, settings", STRATEGIES, ids=_ids(STRATEGIES))
def test_a_one_token_cap_makes_every_step_plain_and_exact(decoding, settings):
    model = enabled("qwen3")
    ids, mask = prompts(3)
    # a plain step is fed as stock decoding feeds it: one token per row and the 2D padding mask (the model's own
    # causal path), never a 4D tree mask
    fed = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append((kwargs["input_ids"].shape[1], kwargs.get("attention_mask"))),
        with_kwargs=True)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, decoding=decoding,
                             max_step_tokens=1, return_dict_in_generate=True, **_settings(model, decoding, settings))
    finally:
        handle.remove()
    torch.testing.assert_close(out.sequences, reference("qwen3", 3, 24), rtol=0, atol=0)
    assert set(out.stats["shape_steps"]) == {"plain"} and out.stats["speculated_row_share"] == 0
    steps = fed[1:]  # (after the prefill)
    assert steps and all(width == 1 and m is not None and m.dim() == 2 for width, m in steps)


@pytest.mark.parametrize("decoding", [d for d, _ in STRATEGIES])
def test_bad_policy_settings_are_refused_before_any_forward(decoding):
    model = enabled("llama")
    ids, mask = prompts(1)
    for bad, match in ((dict(adaptive="yes"), "adaptive"), (dict(max_step_tokens=0), "max_step_tokens"),
                       (dict(max_step_tokens=2.5), "max_step_tokens"),
                       (dict(adaptive=False, max_step_tokens=64), "adaptive=True")):
        with pytest.raises(ValueError, match=match):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, decoding=decoding,
                           **_settings(model, decoding, {}), **bad)


VOCAB, NEW, ROWS = 5, 3, 4000


@pytest.mark.slow
@pytest.mark.parametrize("picks", [[-1, 0, 1], [1, -1, 0], [0, 2, -1], [3, 0, 3]],
                         ids=["plain-tree-chain", "chain-plain-tree", "tree-chain-plain", "shape3-tree-shape3"])
@pytest.mark.parametrize("decoding, settings", [
    ("speculative", dict(tree_budget=6, tree_width=2, tree_depth=3, context_matches=2, context_tokens=2,
                         context_ngram_size=1)),
    ("jacobi", dict(block_size=4, jacobi_init="repeat")),
    ("jacobi_forcing", dict(block_size=2, pool_size=1, context_matches=2, context_tokens=2, context_ngram_size=1)),
    ("lookahead", dict(window_size=2, ngram_size=3)),
    ("prompt_lookup", dict(num_tokens=2, max_ngram_size=1, max_matches=4)),
], ids=["speculative", "jacobi", "jacobi_forcing", "lookahead", "prompt_lookup"])
def test_sampled_output_is_distributed_as_stock_whichever_shapes_the_policy_picks(monkeypatch, decoding, settings,
                                                                                  picks):
    from test_sampling import chi_square_two_sample, outcomes

    model = hfpd.enable(tiny_model("llama", vocab_size=VOCAB, initializer_range=0.05))
    ids = torch.tensor([[3, 4, 0, 3, 1, 4, 2, 0, 1, 3, 2, 4, 1, 0, 2, 1, 4, 4, 0, 0, 3, 3, 2, 2, 3]]).repeat(ROWS, 1)
    kwargs = dict(input_ids=ids, max_new_tokens=NEW, do_sample=True, temperature=1.3, top_k=4, eos_token_id=None)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)
    if decoding == "speculative":
        from hf_paralleldecode.decoding.speculative import DraftProposer

        monkeypatch.setattr(DraftProposer, "context_chains", True)  # shape 3: a context chain
        torch.manual_seed(0)
        settings = {**settings, "drafter": DraftHead.for_target(model, attention="block_bidirectional", block_size=4)}
    _script(monkeypatch, picks)
    torch.manual_seed(1)
    ours = model.generate(**kwargs, decoding=decoding, return_dict_in_generate=True, **settings)
    assert sum(ours.stats["shape_steps"].values()) >= 2  # (lookahead has two shapes: chain-plain-tree is plain twice)
    p = chi_square_two_sample(outcomes(stock, ids.shape[1]), outcomes(ours.sequences, ids.shape[1]), VOCAB**NEW)
    assert p > 1e-3, f"sampled distribution differs from stock sampling (p={p:.2e})"


@pytest.mark.parametrize("cap", [None, 2])
def test_a_deer_drafter_catches_up_on_at_most_max_catch_up_tokens_after_plain_steps(monkeypatch, cap):
    """After a run of plain steps a block-causal drafter is fed the rows' latest ``max_catch_up`` tokens only (the
    rest stays a hole in its context): its drafts change, the output does not."""
    from hf_paralleldecode.drafters.diffusion import DiffusionState

    seen = []
    original = DiffusionState._causal_forward

    def spy(self, block, root_pos, first):
        if first and self._fed_prompt:
            seen.append(self.pending[0].shape[1])
        out = original(self, block, root_pos, first)
        spy.skipped = self.skipped_tokens
        return out

    monkeypatch.setattr(DiffusionState, "_causal_forward", spy)
    monkeypatch.setattr(DiffusionState, "max_catch_up", cap)
    model = enabled("llama")
    _script(monkeypatch, [0] + [-1] * 6 + [0, 1])  # six plain steps: seven tokens per row to catch up on
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", tree_budget=8, tree_width=2, tree_depth=4, return_dict_in_generate=True,
                         drafter=hfpd.DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4))
    torch.testing.assert_close(out.sequences, reference("llama", 3, 24), rtol=0, atol=0)
    if cap is None:
        assert max(seen) >= 7  # every token of the plain steps is queued
    else:  # at most the cap, or the last drafted step's tokens (its depth + 1)
        assert max(seen) <= 5
    assert (spy.skipped > 0) == (cap is not None)
    # reported: what the drafter's context left out, for the whole call
    assert out.stats["drafter_skipped_tokens"] == out.draft_stats.drafter_skipped_tokens >= spy.skipped
    assert (out.stats["drafter_skipped_tokens"] > 0) == (cap is not None)



def test_a_hole_left_by_plain_steps_is_reported_on_the_next_drafting_step_after_a_context_chain(monkeypatch):
    """Plain steps past the drafter's catch-up cap, then a context chain (no drafter forward), then a drafting step: the
    hole is reported on the drafting step, whose drafts it spoils, not swallowed by the context chain between."""
    from hf_paralleldecode.decoding.speculative import DraftProposer
    from hf_paralleldecode.drafters.diffusion import DiffusionState

    monkeypatch.setattr(DraftProposer, "context_chains", True)
    monkeypatch.setattr(DiffusionState, "max_catch_up", 2)
    plan = iter(["tree"] + ["plain"] * 6 + ["context"] + ["tree"] * 40)
    lagged_on = []

    def scripted(self, rows):
        self.close()
        self._lagged = False
        want = next(plan)
        k = {"tree": 0, "plain": self.plain,
             "context": next(i for i, s in enumerate(self.shapes) if not s.drafter and not s.plain)}[want]
        self.used[k] += 1
        self.row_steps[k] += rows
        self._pending, self._done = (k, 0, 0.0), False
        return k

    def lagged(self):
        lagged_on.append((sum(self.used), "context" if not self.current.drafter else self.current.label))
        self._lagged = True

    monkeypatch.setattr(BatchPolicy, "choose", scripted)
    monkeypatch.setattr(BatchPolicy, "lagged", lagged)
    model = enabled("llama")
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", tree_budget=8, tree_width=2, tree_depth=4, context_matches=2,
                         return_dict_in_generate=True,
                         drafter=hfpd.DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4))
    torch.testing.assert_close(out.sequences, reference("llama", 3, 24), rtol=0, atol=0)
    assert any(label.startswith("context chain") for label in out.stats["shape_steps"])
    assert out.stats["drafter_skipped_tokens"] > 0
    # once, on the ninth step: the tree's first drafting step after the plain run and the context chain
    tree = next(label for label in out.stats["shape_steps"] if label.startswith("tree"))
    assert lagged_on == [(9, tree)]

def test_one_slow_first_step_does_not_lock_a_shape_out():
    """A shape's step time is the lower median of its recent steps: a first step slowed by a warm-up is outvoted."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    b = BatchPolicy.bucket(3)
    policy.tokens = [100.0, 70.0, 45.0, 30.0, 20.0]
    policy.times[(b, 0)] = [0.500]  # a first call's warm-up: 50x the tree's real time
    assert policy.seconds(b, 0) == 0.500
    policy.times[(b, 0)] += [0.010, 0.012]
    assert policy.seconds(b, 0) == pytest.approx(0.011)  # the slowest step is left out
    policy.times[(b, 4)] = [0.008, 0.008]
    assert policy.choose(3) == 0  # the tree: 1 / 0.010 beats the plain step's 0.2 / 0.008


def test_cost_aware_without_adaptive_keeps_the_configured_tree_as_the_batch_shrinks():
    model = enabled("llama")
    ids, mask = prompts(3)
    for decoding, settings in STRATEGIES:
        if decoding == "jacobi":
            continue  # (no node budget)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, decoding=decoding,
                             adaptive=False, cost_aware=True, return_dict_in_generate=True,
                             **_settings(model, decoding, settings))
        torch.testing.assert_close(out.sequences, reference("llama", 3, 24), rtol=0, atol=0)
        assert len(out.stats["shape_steps"]) == 1 and "budget_optional_nodes_per_step" in out.stats


@pytest.mark.parametrize("decoding, settings", STRATEGIES, ids=_ids(STRATEGIES))
def test_batch_16_of_mixed_lengths_is_exact_with_the_policys_own_choices(decoding, settings):
    """The policy deciding from its own measurements (no script) while rows of different lengths finish at different
    steps and the batch shrinks through every bucket: still stock greedy, over three calls (memory carried)."""
    model = enabled("qwen3")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 90, (16, 12), generator=g)
    mask = torch.ones_like(ids)
    for i in range(16):
        mask[i, : i % 7] = 0  # 0 to 6 pad tokens
    ids[mask == 0] = 0
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    settings = _settings(model, decoding, settings)
    for _ in range(3):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                             decoding=decoding, return_dict_in_generate=True, **settings)
        torch.testing.assert_close(out.sequences, ref, rtol=0, atol=0)


def test_at_a_large_batch_a_small_predicted_gain_keeps_the_plain_step():
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    policy.tokens, policy.own[0] = [100.0, 60.0, 40.0, 30.0, 20.0], [100.0, 20.0]
    for rows, chain_seconds, expected in ((16, 0.058, 4), (16, 0.055, 1), (16, 0.040, 1), (4, 0.058, 1)):
        b = BatchPolicy.bucket(rows)
        policy.times = {(b, 0): [0.5] * 3, (b, 1): [chain_seconds] * 3, (b, 2): [1.0] * 3, (b, 3): [1.0] * 3,
                        (b, 4): [0.020] * 3}
        # chain 8 against the plain step: 0.6 / 0.058 = 10.3 is 3% above 0.2 / 0.020 = 10 (not enough at 16 rows);
        # 0.6 / 0.055 = 10.9 is 9% above (a measured shape needs 5%); at 4 rows any gain counts
        assert policy.choose(rows) == expected


def test_a_shrinking_batch_reuses_the_times_of_a_larger_bucket_instead_of_measuring_again():
    # a static batch's rows finish at different steps: the batch shrinks through buckets never measured. A step
    # of fewer rows is never slower, so a larger bucket's times bound them from above: the policy keeps its
    # choice (here the chain of 8) rather than spend plain steps and every shape's two samples in each new bucket
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    big = BatchPolicy.bucket(64)
    _measured(policy, big, seconds=[0.100, 0.050, 0.040, 0.035, 0.030], relative=[0.9, 0.6, 0.35, 0.2])
    assert policy.choose(64) == 1  # 0.9 / 0.05 beats the tree (1 / 0.1) and the plain step (0.2 / 0.03)
    for rows in (40, 21, 13, 6, 3):
        assert policy.choose(rows) == 1, rows
    # once a shape's own time in the smaller bucket is known it wins over the bound: a tree that turns cheap at 3
    # rows is chosen there
    policy.times[(BatchPolicy.bucket(3), 0)] = [0.012] * 4
    assert policy.choose(3) == 0
    # without a larger bucket (a batch that grows) the new bucket is measured as before: plain step first
    fresh = BatchPolicy(shapes_from(4, 16, 20, True))
    _measured(fresh, BatchPolicy.bucket(4), seconds=[0.100, 0.050, 0.040, 0.035, 0.030], relative=[0.9, 0.6, 0.35, 0.2])
    assert fresh.choose(64) == 4
    # a first step in the smaller bucket counts where it beats the bound (a revisit found the tree cheap there)
    policy.times[(BatchPolicy.bucket(5), 0)] = [0.011]
    assert policy.estimate(BatchPolicy.bucket(5), 0) == 0.011 and policy.choose(5) == 0
    policy.times[(BatchPolicy.bucket(5), 0)] = [0.900]  # a slow first step (a warm-up): the bound stands
    assert policy.estimate(BatchPolicy.bucket(5), 0) == pytest.approx(0.100)


def test_the_first_drafting_step_of_a_call_does_not_set_the_shapes_time_once_it_is_known():
    # a call's first step with a drafter also runs the drafter over the whole prompt: a one-time cost. When the
    # policy runs plain steps first and revisits the tree once per call, every tree step it times would be such a
    # step, the tree would look slower than it is and stay locked out. So a call's first drafting step never joins
    # a shape's window (it stands in while the window is empty; its tokens still count)
    ticks = iter(range(1000))

    def clock():  # one second per reading
        return float(next(ticks))

    shapes = shapes_from(4, 16, 20, True)
    b = BatchPolicy.bucket(1)
    tree = tree_from_parents(torch.tensor([9]), [[9, 1]], [[-1, 0]], [[0, 1]])
    verdict = SimpleNamespace(path=torch.tensor([[0, 1]]), num_accepted=torch.tensor([1]))

    def step(policy, pick):
        policy.choose(1)
        policy._pending = (pick, b, policy._pending[2])  # (the shape under test, whatever the rule picked)
        policy.observe(tree, verdict)
        policy.close()

    policy = BatchPolicy(shapes, clock=clock)
    step(policy, 4)
    step(policy, 0)  # the call's first drafting step, no tree time yet: it stands in, outside the window
    assert not policy.times.get((b, 0)) and policy.seconds(b, 0) is not None
    step(policy, 0)
    step(policy, 0)
    assert len(policy.times[(b, 0)]) == 2
    later = BatchPolicy(shapes, clock=clock)
    later.times = {k: list(v) for k, v in policy.times.items()}
    step(later, 4)
    step(later, 0)  # first drafting step of this call: the tree has its samples, not timed
    assert len(later.times[(b, 0)]) == 2 and later.own[0][1] > 0
    step(later, 0)  # the next one is
    step(later, 1)  # a drafter chain after the tree: the drafter has read the prompt already, timed
    assert len(later.times[(b, 0)]) == 3 and len(later.times[(b, 1)]) == 1


FIRST = PolicyTuning(explore_after=0)  # a large batch's choices at a call's very first step (no deferral)


def _bucket_times(policy, rows, seconds):
    b = BatchPolicy.bucket(rows)
    for i, s in enumerate(seconds):
        if s is not None:
            policy.times[(b, i)] = [s] * 4


def test_a_new_larger_bucket_measures_only_the_shapes_whose_floor_leaves_hope():
    # step times measured on this CPU (JF model) at 16 and 32 rows. At 64 rows the plain step is measured first;
    # each other shape's floor is its time at 32 rows times its growth from 16 to 32, or the plain step's time
    # times its ratio to the plain step at 32 rows: none leaves hope against the plain step (15% margin), so none is
    # measured (each would cost 4 to 10 plain steps)
    policy = BatchPolicy(shapes_from(4, 16, 20, True), tuning=FIRST)
    policy.tokens, policy.own[0] = [100.0, 65.7, 44.7, 30.3, 11.3], [100.0, 20.0]
    _bucket_times(policy, 16, [0.0892, 0.0568, 0.0388, 0.0400, 0.0126])
    _bucket_times(policy, 32, [0.1737, 0.1091, 0.0709, 0.0600, 0.0203])
    b = BatchPolicy.bucket(64)
    assert policy.choose(64) == 4  # the plain step first
    policy.times[(b, 4)] = [0.0342] * 2
    assert policy.floor(b, 0) == pytest.approx(0.1737 ** 2 / 0.0892)  # the tree's growth: 1.95 per doubling
    assert policy.floor(b, 3) == pytest.approx(0.0342 * 0.0600 / 0.0203)  # the chain of 2: ratio 3.0, not growth 1.5
    assert {policy.choose(64) for _ in range(40)} == {4}
    # at 32 rows, from 8 and 16: the tree's floor (7.1 plain steps, 8.9x their tokens) leaves hope
    policy = BatchPolicy(shapes_from(4, 16, 20, True), tuning=FIRST)
    policy.tokens, policy.own[0] = [100.0, 65.7, 44.7, 30.3, 11.3], [100.0, 20.0]
    _bucket_times(policy, 8, [0.0638, 0.0433, 0.0271, 0.0277, 0.0123])
    _bucket_times(policy, 16, [0.0892, 0.0568, 0.0388, None, 0.0126])
    b = BatchPolicy.bucket(32)
    policy.times[(b, 4)] = [0.0203] * 2
    assert policy.floor(b, 0) == pytest.approx(0.0203 * 0.0892 / 0.0126)
    assert policy.hopeful(b, 32, 0, {4: 0.113 / 0.0203})
    assert policy.choose(32) == 3  # from 8 rows the narrowest hopeful shape first: the chain of 2
    # a growth below 1 (noise) is not carried forward: the slowest time at fewer rows stands (more rows are never faster)
    policy.times[(BatchPolicy.bucket(16), 1)] = [0.0400] * 4
    assert policy.floor(BatchPolicy.bucket(64), 1) == pytest.approx(0.0433)  # no plain step there yet
    assert policy.floor(BatchPolicy.bucket(64), 1) < policy.floor(BatchPolicy.bucket(64), 0)


def test_a_tree_with_few_steps_in_a_bucket_is_revisited_only_while_its_floor_leaves_hope():
    # the revisit of a tree whose time rests on fewer than three steps (one may be a warm-up) is for a tree that
    # could still win; one that cannot even at its floor (its smaller-bucket ratio to the plain step) is left to
    # the exploration budget like any losing tree: at 64 rows on this CPU a tree step costs ten plain steps
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    policy.tokens, policy.own[0] = [100.0, 65.7, 44.7, 30.3, 11.3], [100.0, 20.0]
    _bucket_times(policy, 32, [0.174, 0.109, 0.071, 0.104, 0.0203])
    b = BatchPolicy.bucket(64)
    policy.times.update({(b, 0): [0.33], (b, 1): [0.27] * 2, (b, 2): [0.13] * 2, (b, 3): [0.12] * 2,
                         (b, 4): [0.034] * 2})
    policy.since_tree, policy.budget = 100, 0.0
    # (the one other step: chain 4, predicted within the plain step's margin, so a revisit that loses nothing)
    assert {policy.choose(64) for _ in range(20)} == {2, 4} and policy.used[2] == 1
    # the same tree at 4 rows, where its floor beats the plain step: revisited at its gap without budget
    small = BatchPolicy(shapes_from(4, 16, 20, True))
    small.tokens, small.own[0] = list(policy.tokens), [100.0, 20.0]
    _bucket_times(small, 4, [None, 0.025, 0.020, 0.018, 0.012])
    small.times[(BatchPolicy.bucket(4), 0)] = [0.2]  # one slow (warm-up) step
    small.since_tree, small.budget = 100, 0.0
    assert small.choose(4) == 0


def test_exploration_at_a_large_batch_needs_the_margin_the_choice_needs():
    # from 8 rows a shape must be predicted 15% faster than the plain step to be used, so it is not measured
    # when even its floor is not: chain of 8 at 16 rows, 6x the plain step's tokens, floor 5.5x its time (+9%)
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    policy.tokens, policy.own[0] = [100.0, 60.0, 40.0, 30.0, 10.0], [100.0, 20.0]
    _bucket_times(policy, 8, [None, 0.055, 0.050, 0.045, 0.010])
    b = BatchPolicy.bucket(16)
    policy.times[(b, 4)] = [0.010] * 2
    policy.times[(b, 0)] = [0.5] * 4
    assert policy.hopeful(b, 16, 1, {4: 0.1 / 0.010}) is False
    assert policy.hopeful(b, 4, 1, {4: 0.1 / 0.010}) is True  # below 8 rows any gain counts
    assert {policy.choose(16) for _ in range(10)} == {4}


def _spread(policy, mus_sigmas, row_steps=100.0):
    """Paired sums giving each shape the mean ``mu`` and spread ``sigma`` of tokens per row-step."""
    policy.paired_rows = row_steps
    policy.tokens = [mu * row_steps for mu, _ in mus_sigmas]
    policy.squares = [(sigma ** 2 + mu ** 2) * row_steps for mu, sigma in mus_sigmas]
    policy.own[0] = [mus_sigmas[0][0] * 20.0, 20.0]  # the tree has run


def test_the_tail_factor_charges_the_steps_a_static_batch_runs_with_finished_rows():
    """Rows that accept more finish first; the batch then runs its last steps with fewer rows. With ``n`` steps for
    a typical row and the rows spread over ``n +- w`` (``w = z * sigma * sqrt(n) / mu``), a shape keeps
    ``n full / ((n - w) full + 2 w drain)`` of its per-step rate: nothing at one row or for the plain step, most
    where a step of a few rows costs what a full one costs, least where step time is proportional to the rows."""
    shapes = shapes_from(4, 16, 20, True)
    policy = BatchPolicy(shapes)
    _spread(policy, [(5.0, 3.0), (4.0, 2.5), (3.0, 1.2), (2.5, 0.6), (1.0, 0.0)])
    policy.remaining = 64
    b = BatchPolicy.bucket(16)
    for k in range(b + 1):  # flat: a step costs the same whatever its rows
        policy.times.update({(k, i): [0.05] * 4 for i in range(len(shapes))})
    flat = [policy.tail_factor(b, 16, i) for i in range(len(shapes))]
    mu, sigma, n = 5.0, 3.0, 64 / 5.0
    w = expected_max(16) * sigma * n ** 0.5 / mu
    assert flat[0] == pytest.approx(n / (n + w))
    assert flat[-1] == 1.0 and flat[0] < flat[1] < flat[2] < flat[3] < 1.0  # the wider the spread, the larger the tail
    assert policy.tail_factor(0, 1, 0) == 1.0  # one row has no tail
    for k in range(b + 1):  # proportional to the rows: a draining batch is cheap, the tail costs little
        policy.times.update({(k, i): [0.05 * 2 ** k / 16] * 4 for i in range(len(shapes))})
    assert flat[0] < policy.tail_factor(b, 16, 0) <= 1.0
    policy.remaining = None  # (a policy driven without the rows' remaining tokens)
    assert policy.tail_factor(b, 16, 0) == 1.0
    assert expected_max(1) == 0.0 and 1.7 < expected_max(16) < 1.8


def test_at_a_large_batch_the_shape_with_the_smaller_tail_wins_a_close_per_step_race():
    """Per step an 8-level chain beats a 2-level one by 10%; over a batch of 16 whose small steps cost what full ones
    cost, its wider spread of tokens per row makes it lose; at one row the per-step rate decides."""
    shapes = shapes_from(4, 16, 20, True)
    policy = BatchPolicy(shapes)
    _spread(policy, [(5.0, 3.0), (4.4, 2.8), (3.0, 1.2), (2.0, 0.4), (1.0, 0.0)])
    for rows in (16, 1):
        b = BatchPolicy.bucket(rows)
        for k in range(b + 1):
            # seconds: the tree 0.2 (out of the race), chain 8 0.040 (110 tokens per second), chain 4 0.05 (60),
            # chain 2 0.020 (100), plain 0.020 (50)
            policy.times.update({(k, 0): [0.2] * 4, (k, 1): [0.040] * 4, (k, 2): [0.05] * 4, (k, 3): [0.020] * 4,
                                 (k, 4): [0.020] * 4})
        policy.since_tree, policy.gap = 0, 1000  # no revisit of the tree
        assert policy.start_step(rows, 0.0, None, remaining=64) == (3 if rows == 16 else 1)


def test_the_policy_gets_the_rows_remaining_tokens_and_keeps_the_spread_across_calls(monkeypatch):
    model = enabled("llama")
    ids, mask = prompts(3)
    seen = []
    real = BatchPolicy.start_step

    def spy(self, rows, seconds, fed, remaining=None):
        seen.append((rows, remaining))
        return real(self, rows, seconds, fed, remaining)

    monkeypatch.setattr(BatchPolicy, "start_step", spy)
    memory_of(model).policy.clear()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, decoding="prompt_lookup")
    assert seen[0] == (3, 11)  # the prefill committed each row's first token
    assert all(0 < r <= 11 for _, r in seen) and [r for _, r in seen] == sorted((r for _, r in seen), reverse=True)
    stored = next(iter(memory_of(model).policy.values()))
    assert stored["paired_rows"] > PolicyTuning.prior and len(stored["squares"]) == len(stored["tokens"])
    again = BatchPolicy(list(next(iter(memory_of(model).policy))[3]),
                        memory=(model, next(iter(memory_of(model).policy))))
    assert again.squares == stored["squares"] and again.paired_rows == stored["paired_rows"]


def test_a_drafter_shared_by_two_models_does_not_carry_one_models_times_to_the_other():
    """The policy's measurements (step times, paired token counts) belong to one target: a drafter attached to a model
    and to its cost twin (same device and dtype, another cost curve) starts afresh on the twin, and each model's next
    call starts from its own last call."""
    from hf_paralleldecode.twins import cost_twin

    model = enabled("llama")
    twin = cost_twin(model, dict(hidden_size=96, intermediate_size=200, num_hidden_layers=4, q_width=96, kv_width=48))
    drafter = hfpd.DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4)
    ids, mask = prompts(2)
    memory_of(drafter).policy.clear()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, decoding="speculative", drafter=drafter)
    model.generate(**kwargs)
    first = dict(memory_of(drafter).policy)
    assert len(first) == 1
    seen = []
    real = BatchPolicy.__init__

    def spy(self, shapes, *args, **kw):
        real(self, shapes, *args, **kw)
        seen.append(dict(self.times))

    import unittest.mock

    with unittest.mock.patch.object(BatchPolicy, "__init__", spy):
        twin.generate(**kwargs)
    assert seen and seen[0] == {}  # nothing of the source model's times
    assert len(memory_of(drafter).policy) == 2  # one entry per target
    with unittest.mock.patch.object(BatchPolicy, "__init__", spy):
        model.generate(**kwargs)
    assert seen[-1]  # the source model's own times come back


def test_a_tree_whose_floor_wins_decisively_is_revisited_at_its_gaps_without_budget():
    """At a real model's cost a batch-1 tree step costs about a plain step and commits 7 tokens. Step times inflated
    by another process (the tree's window measured during a burst) must not lock it out until a 1% budget refills:
    a tree whose fastest step here would win by 2x is revisited at its gaps."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), explore_every=4)
    b = BatchPolicy.bucket(1)
    _measured(policy, b, seconds=[2.0, 0.30, 0.28, 0.26, 0.21], relative=[0.6, 0.4, 0.25, 1 / 7])
    policy.since_tree, policy.budget = 3, -5.0  # a costly revisit left the budget deep in debt
    assert policy.choose(1) != 0  # the tree never ran fast here: the budget rule
    policy.since_tree = 3
    policy.best_seen[(b, 0)] = 0.20  # before the burst its steps took 0.2 s: 1 / 0.2 is 2.5x 0.6 / 0.3
    assert policy.choose(1) != 0  # inside the gap: the best measured shape
    policy.since_tree = 4
    assert policy.choose(1) == 0  # the gap passed: revisited although the budget covers nothing
    assert policy.gap == 8  # and the gap doubles, as for any revisit


def test_a_step_much_faster_than_its_shapes_estimate_replaces_the_stale_window():
    """A shape's window measured while another process ran is stale once a step of it runs much faster: its time is
    then that step's, not the mean of the burst's (which would keep it locked out)."""
    clock = FakeClock(10.0)
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock)
    b = BatchPolicy.bucket(1)
    policy.times[(b, 0)] = [1.0] * 8
    policy._pending, policy._done, policy._drafted = (0, b, clock() - 0.2), True, True
    policy.close()
    assert policy.seconds(b, 0) == pytest.approx(0.2)
    policy.times[(b, 0)] = [0.20] * 4  # a step a little slower than the estimate joins the window as before
    policy._pending, policy._done = (0, b, clock() - 0.25), True
    policy.close()
    assert len(policy.times[(b, 0)]) == 5


def test_a_stale_window_found_below_margin_rows_makes_the_other_shapes_there_measured_again():
    """The conditions a stale window was measured under held for every shape of the bucket: below margin_rows rows
    the others are measured again (a step there is cheap). On the JF model's 1B twin at batch 1, sampling at T=0.8,
    the process's first calls timed the plain step at 300 ms and the chains at 430-480 ms; the tree, which kept
    running, was re-timed at 100-140 ms and ran on every step for the rest of the process, at 1.24x stock beside
    1.56x for the same code choosing the chain of 2 in an earlier run."""
    clock = FakeClock(10.0)
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock)  # tree, chain 8, chain 4, chain 2, plain
    policy.tokens, policy.own[0] = [190.0, 150.0, 150.0, 140.0, 100.0], [190.0, 100.0]
    b, smaller = BatchPolicy.bucket(4), BatchPolicy.bucket(2)
    for i, t in ((0, 0.50), (1, 0.44), (2, 0.48), (3, 0.43), (4, 0.30)):
        policy.times[(b, i)] = [t] * 4
    policy.times[(smaller, 4)] = [0.3] * 4
    policy._pending, policy._done, policy._drafted = (0, b, clock() - 0.12), True, True
    policy.close()  # the tree: 0.12 s where its window says 0.5
    assert policy.times[(b, 0)] == [pytest.approx(0.12)]
    assert policy.best_seen == {(b, 0): pytest.approx(0.12)}  # the step is the tree's, not another shape's
    assert not any(policy.steps.trusted(b, i) for i in range(1, 5))  # measured again, the plain step first
    assert policy.times[(smaller, 4)] == [0.3] * 4  # (another bucket's conditions are its own)
    assert policy.choose(4) == 4
    large = BatchPolicy.bucket(16)
    policy.times[(large, 4)] = [0.5] * 4
    # from margin_rows rows a step is mostly the forward's compute and measuring a shape again costs several plain
    # steps: there the others keep their windows
    for i, t in ((0, 5.0), (3, 2.0)):
        policy.times[(large, i)] = [t] * 4
    policy._pending, policy._done = (0, large, clock() - 1.0), True
    policy.close()
    assert policy.times[(large, 3)] == [2.0] * 4 and policy.times[(large, 4)] == [0.5] * 4


def test_a_tree_is_not_revisited_for_its_few_steps_in_a_bucket_a_shrinking_batch_passes_through():
    """A batch of 16 whose rows finish apart passes through 8-15, 4-7, ... rows, where the tree has no steps: there its
    time at 16 rows stands in and nothing is measured, so the rule that revisits a tree resting on fewer than three
    steps does not apply (the 8.4M JF model ran its tree at 14, 9, 5 and 4 rows at the end of calls, 40-80 ms a step
    beside 9 ms plain steps at 16 rows); the budget still can."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    _measured(policy, BatchPolicy.bucket(16), seconds=[0.080, 0.060, 0.040, 0.018, 0.008],
              relative=[0.625, 0.575, 0.5, 0.25])
    policy.since_tree, policy.budget = 100, 0.0
    assert all(policy.choose(rows) != 0 for rows in (14, 9, 5, 4))
    policy.budget = 1.0
    assert policy.choose(5) == 3  # the budget still can (while the plain step wins: the shape that loses least)


def test_a_chain_must_beat_the_configured_tree_by_a_margin_to_replace_it():
    """A chain's tokens are read off the tree's steps (how far the accepted path ran along first children), which
    flatters a chain a little (on the base model's 1B twin at batch 1: predicted 0.65 of the tree's tokens, 0.61
    run alone). In a close race the configured tree keeps the step; a chain clearly faster takes it."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), explore_every=4)
    b = BatchPolicy.bucket(1)
    _measured(policy, b, seconds=[0.120, 0.100, 0.0765, 0.070, 0.082], relative=[0.72, 0.65, 0.53, 0.23])
    assert 0.65 / 0.0765 > 1 / 0.120  # the chain of 4 is predicted 2% faster
    assert policy.choose(1) == 0
    policy.times[(b, 2)] = [0.070] * 4  # now 11% faster
    assert policy.choose(1) == 2


def test_a_large_batch_measures_the_narrowest_hopeful_chain_first_and_its_time_floors_the_wider_ones():
    """At 64 rows a chain of 8 feeds 576 tokens: in a process that never saw a smaller batch, only the plain step
    floors it. The narrowest chain is measured first, and the measured chains floor the wider ones (never faster; on
    a convex curve, no cheaper per node), so a chain of 8 that cannot win is never measured."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), tuning=FIRST)
    b = BatchPolicy.bucket(64)
    policy.tokens = [100.0, 60.0, 45.0, 30.0, 15.0]
    policy.own[0] = [100.0, 20.0]
    policy.times[(b, 0)] = [3.5] * 2  # the tree: 3.5 s at 64 rows
    policy.times[(b, 4)] = [0.5] * 2  # the plain step
    assert policy.choose(64) == 3  # the chain of 2 first, not the (more promising on paper) chain of 8
    policy.times[(b, 3)] = [1.0] * 2  # 0.30 / 1.0 loses to the plain step's 0.15 / 0.5 (with the margin)
    assert policy.floor(b, 2) == 1.0  # the chain of 4 is never faster than the chain of 2
    assert policy.choose(64) == 2  # 0.45 over that floor still beats 1.15 x 0.3: measured next
    policy.times[(b, 2)] = [1.5] * 2
    assert policy.floor(b, 1) == pytest.approx(1.5 + 4 * 0.5 / 2)  # 9 nodes: the slope from 3 to 5 nodes, extrapolated
    assert policy.choose(64) == 4  # the chain of 8 (0.6 / 2.5) cannot beat the plain step: never measured


def test_a_large_batch_measures_and_revisits_nothing_in_a_calls_first_steps():
    """From ``margin_rows`` rows a call's first ``explore_after`` steps take the best measured shape (here the plain
    step) and neither measure a hopeful new shape nor revisit the tree: those steps draft the least predictable text,
    so what they measure values every speculating shape low (the 8.4M JF model at 16 rows: a chain of 4 commits 2.1
    tokens a row-step on a call's first step, 4.3-4.6 from its sixth). From the next step on the policy measures as
    before; below ``margin_rows`` rows, and with ``explore_after=0``, nothing is deferred."""

    def fresh(rows, **tuning):
        policy = BatchPolicy(shapes_from(4, 16, 20, True), tuning=PolicyTuning(**tuning))
        b = BatchPolicy.bucket(rows)
        policy.tokens, policy.own[0] = [100.0, 60.0, 45.0, 30.0, 15.0], [100.0, 20.0]
        policy.times[(b, 0)] = [3.5] * 2  # the tree: losing, but young (two steps) and hopeful at its floor
        policy.times[(b, 4)] = [0.5] * 2  # the plain step; the chains are untimed, the chain of 2 hopeful
        policy.since_tree, policy.budget = 100, 100.0
        return policy

    policy = fresh(64)
    assert PolicyTuning().explore_after == 3
    assert [policy.choose(64) for _ in range(3)] == [4, 4, 4]  # neither the young chain nor the tree
    assert policy.choose(64) == 3  # then the narrowest hopeful chain is measured, as without the deferral
    assert fresh(64, explore_after=0).choose(64) == 3
    assert fresh(64, explore_after=1).choose(64) == 4
    assert fresh(4).choose(4) in (1, 2, 3)  # below margin_rows rows an untimed chain is measured at once
    # a shape already measured and fastest is still taken during the deferral (it defers measuring, not exploiting)
    timed = fresh(64)
    timed.times[(BatchPolicy.bucket(64), 3)] = [0.1] * 4  # the chain of 2 measured fast in an earlier call
    assert timed.choose(64) == 3
    with pytest.raises(ValueError, match="PolicyTuning.explore_after must be an integer >= 0"):
        PolicyTuning(explore_after=-1)


def test_the_deferral_counts_a_calls_own_steps_not_the_buckets():
    """The deferral covers each call's first ``explore_after`` steps, also when the owner's memory already holds many
    steps in the bucket from earlier calls: every call starts on the least predictable text (a server's next request
    included). What an earlier call measured is used at once; what it left unmeasured is measured after the deferred
    steps, as in the first call."""
    owner, clock, shapes = SimpleNamespace(), FakeClock(), shapes_from(4, 16, 20, True)  # tree, chains 8 4 2, plain
    b = BatchPolicy.bucket(64)

    def call(steps, seconds):
        policy = BatchPolicy(shapes, clock=clock, memory=(owner, "key"))
        picks = []
        for _ in range(steps):
            picks.append(policy.choose(64))
            policy._done = True  # (the step's verification ran: close() times it on the next choose)
            clock.advance(seconds[picks[-1]])
        policy.finish()
        return picks, policy

    first = BatchPolicy(shapes, clock=clock, memory=(owner, "key"))
    first.tokens, first.own[0] = [100.0, 60.0, 45.0, 30.0, 15.0], [100.0, 20.0]
    first.times[(b, 0)] = [3.5] * 2  # the tree: losing, but young and hopeful at its floor
    first.times[(b, 4)] = [0.5] * 4  # the plain step, trusted; the chains untimed, the chain of 2 hopeful
    first.since_tree, first.budget = 100, 100.0
    first.finish()
    seconds = {0: 3.5, 1: 2.0, 2: 1.2, 3: 0.7, 4: 0.5}
    picks, _ = call(2, seconds)  # a short call: both its steps deferred, nothing new measured
    assert picks == [4, 4]
    picks, policy = call(4, seconds)  # the bucket now holds 6 plain steps: the next call still defers its first 3
    assert picks == [4, 4, 4, 3]  # then measures the chain of 2, as the first call would have
    assert policy.steps.runs(b, 3) == 1
    picks, _ = call(4, seconds)  # the chain of 2 (3 tokens in 0.7 s against 1 in 0.5 s) is measured: used at once
    assert picks[0] == 3


def _stale_plain(rows=16, memory=None, clock=None):
    """A policy at ``rows`` rows whose plain step's window was timed slow (45 ms, a burst of another process: it runs
    in 31 ms) while the chain of 2 took 80 ms: the chain is predicted 12% faster than the plain step and taken."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock or FakeClock(), memory=memory)
    policy.tokens, policy.own[0] = [100.0, 60.0, 45.0, 30.0, 15.0], [100.0, 20.0]  # chain of 2: 2x the plain step
    _bucket_times(policy, rows, [1.0, 0.5, 0.5, 0.080, 0.045])  # the tree and the deeper chains lose clearly
    policy.times[(BatchPolicy.bucket(rows), 4)] = [0.045] * 8
    return policy


def _steps(policy, rows, n, seconds):
    """Run ``n`` steps of ``rows`` rows on the policy's fake clock; each shape's step takes ``seconds[shape]``."""
    picks = []
    for _ in range(n):
        picks.append(policy.choose(rows))
        policy._done = True  # (the step's verification ran: close() times it on the next choose)
        policy.clock.advance(seconds[picks[-1]])
    return picks


def test_a_large_batch_times_the_plain_step_again_when_its_window_is_old_and_the_race_is_close():
    """From ``margin_rows`` rows, while a speculating shape is taken over the plain step, the plain step's window is
    not refreshed by anything else: one timed during another process's burst kept a chain on for whole calls (the
    8.4M base model at 16 rows: the plain step's window said 40-45 ms where it ran in 31 ms, and the chain of 2,
    8% slower per token than the plain step on that CPU, ran three calls in a row). After ``explore_every`` steps
    in the bucket, once the exploration budget (``explore_share`` of those steps' time) covers the predicted loss of
    ``min_samples`` plain steps, the plain step runs again and its new steps replace its window."""
    clock = FakeClock()
    policy = _stale_plain(clock=clock)
    real = {0: 1.0, 1: 0.5, 2: 0.5, 3: 0.080, 4: 0.031}
    picks = _steps(policy, 16, 40, real)
    assert picks[:16] == [3] * 16  # a close race: the chain of 2 is taken on the stale window
    first = picks.index(4)
    assert 16 <= first <= 20 and picks[first:first + 2] == [4, 4]  # then the plain step, twice (its new window)
    # 1/0.031 beats 2/0.080: the plain step stays, but for a revisit of the chain of 2 (the speculating shape that
    # loses least) at the doubling gaps the budget covers
    assert set(picks[first:]) <= {3, 4} and picks[first:].count(3) <= 1
    assert all(t == pytest.approx(0.031) for t in policy.times[(BatchPolicy.bucket(16), 4)])  # the old one replaced
    # a renewal cut short (the batch shrank into another bucket after its first step) keeps the old window, trusted
    cut = _stale_plain(clock=FakeClock())
    picks = _steps(cut, 16, 17, real)
    assert picks[-1] == 4 and cut._renewing is not None
    _steps(cut, 7, 1, real)
    assert cut.times[(BatchPolicy.bucket(16), 4)] == [0.045] * 8 and cut._renewing is None
    # below margin_rows rows (a step is cheap, and a fast step there sends the others back to be measured) nothing
    # changes: the chain runs on
    small = _stale_plain(rows=4)
    assert set(_steps(small, 4, 40, real)) == {3}


def test_the_plain_steps_refresh_waits_longer_the_more_it_is_predicted_to_lose_and_carries_over():
    """The budget rule: a plain step predicted to lose little is timed again after ``explore_every`` steps, one
    predicted to lose half its step's time only after enough steps that 1% of their time covers that loss (the chain
    of 2 predicted 2x the plain step: 2 x 45 ms x 0.5 over 1% of 45 ms steps, 100 steps). What the bucket has run
    since the plain step's last step carries over to the owner's next call, like the tree's revisits."""
    owner, clock = SimpleNamespace(), FakeClock()
    policy = _stale_plain(memory=(owner, "key"), clock=clock)
    policy.times[(BatchPolicy.bucket(16), 3)] = [0.045] * 8  # the chain of 2 as fast as the plain step: 2x
    real = {0: 1.0, 1: 0.5, 2: 0.5, 3: 0.045, 4: 0.031}
    assert set(_steps(policy, 16, 40, real)) == {3}
    policy.finish()
    again = BatchPolicy(policy.shapes, clock=clock, memory=(owner, "key"))
    picks = _steps(again, 16, 80, real)
    first = picks.index(4)
    assert 98 <= first + 40 <= 102  # in the next call, 100 steps after the first call's start
    assert picks[first:first + 3] == [4, 4, 3]  # two plain steps (31 ms: the chain of 2 still wins), then the chain
    assert 4 not in picks[first + 3:]  # the count starts again: the next refresh is dozens of steps away


def test_a_large_batch_measures_a_narrower_chain_before_a_wider_hopeful_one_whose_floor_it_would_raise():
    """When the chain of 4 is not hopeful on the chain of 2's time alone but the chain of 8 is (more tokens over the
    same floor), the chain of 4 is measured first: with two chains timed, the chain of 8's floor grows by their time
    per node, and a chain of 8 that cannot win is never measured (the 8.4M base model at 64 rows took three steps of
    a chain of 8 there, each several plain steps, in a call at 0.84x stock)."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), tuning=FIRST)
    b = BatchPolicy.bucket(64)
    policy.tokens = [100.0, 80.0, 33.0, 30.0, 15.0]
    policy.own[0] = [100.0, 20.0]
    policy.times[(b, 0)] = [3.5] * 2
    policy.times[(b, 4)] = [0.5] * 2
    policy.times[(b, 3)] = [1.0] * 2  # the chain of 2 lost: 0.30 / 1.0 against the plain step's 0.15 / 0.5
    assert not policy.hopeful(b, 64, 2, {4: 0.3}) and policy.hopeful(b, 64, 1, {4: 0.3})
    assert policy.choose(64) == 2  # the chain of 4 first: its time floors the chain of 8
    policy.times[(b, 2)] = [1.5] * 2
    assert policy.choose(64) == 4  # the chain of 8 (0.8 over at least 2.5) cannot beat the plain step


def test_at_a_large_batch_one_clean_step_that_lost_by_more_than_a_warm_up_is_not_taken_again():
    """From ``margin_rows`` rows on a shape's own fastest step in the bucket, over ``stale``, floors its time: the 1B
    base twin at 16 rows took 0.95 s for a tree step whose tokens, 5.3 plain steps' worth, a plain step commits in
    0.125 s; the tree was taken three times more to be sure (4 s of a 14 s call). A step that also read the prompt
    into the drafter does not count in its floor (the tree's hope there reads it: every visit pays one), and at fewer
    rows (where a warm-up can be most of a step) nothing changes."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    b = BatchPolicy.bucket(16)
    policy.tokens, policy.own[0] = [100.0, 62.9, 50.4, 39.4, 18.7], [100.0, 20.0]
    _bucket_times(policy, 16, [None, None, 0.323, 0.233, 0.125])
    rates = {i: policy.relative_tokens(i) / policy.seconds(b, i) for i in (2, 3, 4)}
    policy.steps.record(b, 0, 2.4, setup=True)  # the call's first drafting step: the drafter read the prompt too
    assert policy.floor(b, 0) == pytest.approx(0.323)  # (the chain of 4's time: the read is not its time in step)
    assert not policy.hopeful(b, 16, 0, rates)  # but every visit there pays a read: 2.4 / 1.5 s bounds its hope
    known = BatchPolicy(shapes_from(4, 16, 20, True))
    known.steps = type(policy.steps)(known.shapes, known.tuning, policy.steps.state())
    known.steps.record(b, 3, 0.233 + 1.4, setup="first")  # a chain of 2's first step says what reading it costs
    assert known.floor(b, 0) == pytest.approx((2.4 - 1.4) / 1.5)  # the tree's setup step less that, over stale
    policy.steps.record(b, 0, 0.955)
    assert policy.floor(b, 0) == pytest.approx(0.955 / 1.5) and not policy.hopeful(b, 16, 0, rates)
    policy.since_tree = 100  # the gap has passed, the tree has fewer than three steps: no revisit, it cannot win
    assert policy.choose(16) != 0
    again = BatchPolicy(shapes_from(4, 16, 20, True), memory=None)
    again.steps = type(policy.steps)(again.shapes, again.tuning, policy.steps.state())
    assert again.floor(b, 0) == pytest.approx(0.955 / 1.5)  # kept for the next call
    small = BatchPolicy(shapes_from(4, 16, 20, True))
    small.steps.record(BatchPolicy.bucket(4), 0, 0.955)
    assert small.floor(BatchPolicy.bucket(4), 0) == 0.0


def test_the_tail_reads_a_shapes_unmeasured_smaller_steps_off_the_curve_by_tokens_fed():
    """A batch drains through buckets where a chain never ran (it shrank under plain steps): there its time is read
    off the step-time curve by tokens fed, between the plain steps' times and its own at full size, not taken as the
    full step's. 1B base twin, bf16, 16 rows: plain 0.14 s, chain of 2 0.26 s; at 8 rows the chain feeds 24 tokens."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    chain2, plain = 3, 4
    _bucket_times(policy, 16, [None, None, None, 0.26, 0.14])
    for rows, t in ((1, 0.085), (2, 0.09), (4, 0.11), (8, 0.13)):
        policy.times[(BatchPolicy.bucket(rows), plain)] = [t] * 2
    b = BatchPolicy.bucket(16)
    drain = policy.steps.drain(b, chain2, 0.26)
    assert drain[3] == pytest.approx(0.14 + 0.12 * (24 - 16) / (48 - 16))  # 8 rows: 24 tokens, on the line
    assert drain[2] == pytest.approx(0.13)  # 4 rows: 12 tokens, about what the 8-row plain step feeds
    assert drain[0] == pytest.approx(0.09)  # 1 row: 3 tokens, the 2-row plain step's time
    policy.times[(BatchPolicy.bucket(8), chain2)] = [0.20] * 2  # measured: its own time
    assert policy.steps.drain(b, chain2, 0.26)[3] == pytest.approx(0.20)
    assert policy.steps.drain(b, plain, 0.14) == [policy.seconds(k, plain) for k in range(b)]
    # a host-bound curve (plain steps cost the same at every batch) keeps the drain near the full step's cost
    flat = BatchPolicy(shapes_from(4, 16, 20, True))
    _bucket_times(flat, 16, [None, None, None, 0.015, 0.010])
    for rows in (1, 2, 4, 8):
        flat.times[(BatchPolicy.bucket(rows), plain)] = [0.010] * 2
    assert all(t >= 0.010 for t in flat.steps.drain(b, chain2, 0.015))
    # and the tail factor follows: draining steps that cost less lose less
    policy.times.pop((BatchPolicy.bucket(8), chain2))
    policy.tokens, policy.own[0], policy.squares = [100.0, 60.0, 45.0, 30.0, 15.0], [100.0, 50.0], None
    policy.paired_rows = 50.0
    policy.squares = [t * t / 50.0 * 1.3 for t in policy.tokens]  # a spread of tokens per row-step
    policy.remaining = 60.0
    with_curve = policy.tail_factor(b, 16, chain2)
    full = tail_factor_of(policy, b, chain2)
    assert full < with_curve <= 1.0


def tail_factor_of(policy, b, shape):
    """The tail factor with every smaller bucket at the full step's time (what the policy used before)."""
    from hf_paralleldecode.decoding.policy import tail

    mu = policy.tokens[shape] / policy.paired_rows
    sigma = max(policy.squares[shape] / policy.paired_rows - mu * mu, 0.0) ** 0.5
    full = policy.steps.estimate(b, shape)
    return tail.tail_factor(16, policy.remaining, mu, sigma, full, [None] * b)


def test_at_a_large_batch_a_narrower_chain_within_the_tree_margin_is_preferred():
    """JF model's 1B twin at 16 rows: chains of 8 and 4 predicted level (1.34 vs the plain step's 1.05), the chain of
    4 won run alone (1.15x against the chain of 8's lower): the deeper chain's paired tokens flatter it more."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    b = BatchPolicy.bucket(16)
    policy.tokens, policy.own[0] = [100.0, 64.5, 44.1, 30.9, 14.1], [100.0, 20.0]
    _bucket_times(policy, 16, [1.044, 0.483, 0.340, 0.255, 0.134])
    assert policy.choose(16) == 2  # the chain of 4, not the chain of 8 (0.645 / 0.483, 3% above 0.441 / 0.340)
    policy.times[(b, 2)] = [0.40] * 4  # the chain of 4 now 20% behind: the chain of 8
    assert policy.choose(16) == 1
    small = BatchPolicy(shapes_from(4, 16, 20, True))
    small.tokens, small.own[0] = list(policy.tokens), [100.0, 20.0]
    _bucket_times(small, 4, [1.044, 0.483, 0.340, 0.255, 0.134])
    assert small.choose(4) == 1  # below margin_rows the best predicted rate stands


def test_a_warm_up_of_several_slow_steps_does_not_lock_the_shapes_out():
    """On a GPU a shape's first steps in a process can each take many times its later ones (lazy initialisation,
    then new allocations). Measured on an H200 with the 1B twin of the JF model: the policy averaged two such steps
    per shape into trusted times, the chains' inflated times floored the tree, and every call after the first ran
    plain steps (6 drafting steps of 238). A step much faster than a shape's window replaces it before the shape is
    trusted too. Costs of that run at batch 1 (forward 13 ms for one token, about 17-19 ms for 2-21; drafter ~3 ms)."""

    class Owner:
        pass

    clock, owner, seen, picks = FakeClock(1.0), Owner(), {}, []
    costs = (0.025, 0.022, 0.021, 0.020, 0.013)  # tree, chain of 8, 4, 2, plain
    warm_up = (0.4, 0.2)  # extra seconds of a drafting shape's first and second step in the process
    for call in range(6):
        policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock, memory=(owner, "key"))
        if call == 0:  # paired tokens as the tree's steps would give them: 5 per step, chains 3.8 / 3.0 / 2.2
            policy.tokens, policy.own[0] = [100.0, 76.0, 60.0, 44.0, 20.0], [100.0, 20.0]
        for _ in range(60):
            pick = policy.choose(1)
            k = seen[pick] = seen.get(pick, 0) + 1
            clock.advance(costs[pick] + (warm_up[k - 1] if pick != 4 and k <= len(warm_up) else 0.0))
            policy._done = True
            picks.append(pick)
        policy.finish()
    later = picks[60:]
    assert later.count(0) >= 0.95 * len(later)  # the tree: 1 / 0.025 against the plain step's 0.2 / 0.013
    assert max(picks.count(i) for i in (1, 2, 3)) <= 5  # each chain measured through its warm-up, then left

    steady = BatchPolicy(shapes_from(4, 16, 20, True))  # steps alike, slow or not, are the shape's time as before
    b = BatchPolicy.bucket(1)
    for seconds in (0.30, 0.29):
        steady.steps.record(b, 2, seconds)
    assert steady.steps.trusted(b, 2) and steady.seconds(b, 2) == pytest.approx(0.295)


def test_a_step_drafted_after_a_capped_catch_up_feeds_neither_the_paired_counts_nor_the_window():
    """After a run of plain steps longer than the drafter's catch-up cap, its context has a hole: the tree's revisit
    then drafts worse than the tree does in step (8.4M JF model at 32 rows: 5 tokens a row-step against 6.6), and its
    forward also catches up. Such a step leaves a trusted window alone, and the paired counts unless it committed
    more than the tree is valued at (a bound it beats in step: left out, every revisit after plain steps was lost and
    the JF model's 1B twin at batch 1 ran plain steps for good); a setup step (this or a call's first drafting step)
    only stands in for a shape's time while its window is empty."""
    clock = FakeClock()
    policy = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock)
    b = BatchPolicy.bucket(2)
    tree = tree_from_parents(torch.tensor([9, 9]), [[9, 1, 2], [9, 1, 2]], [[-1, 0, 1], [-1, 0, 1]],
                             [[0, 1, 2], [0, 1, 2]])
    verdict = SimpleNamespace(path=torch.tensor([[0, 1, 2], [0, 1, 2]]), num_accepted=torch.tensor([2, 2]))
    miss = SimpleNamespace(path=torch.tensor([[0, -1, -1], [0, -1, -1]]), num_accepted=torch.tensor([0, 0]))

    def tree_step(v, lagged=False, seconds=0.1):
        policy.choose(2)
        policy._pending = (0, b, policy._pending[2])
        if lagged:
            policy.lagged()
        policy.observe(tree, v)
        clock.advance(seconds)
        policy.close()

    tree_step(verdict, seconds=0.5)  # the call's first drafting step (it read the prompt): a stand-in only
    assert not policy.times.get((b, 0)) and policy.seconds(b, 0) == 0.5
    tree_step(verdict)
    tree_step(verdict)
    assert policy.times[(b, 0)] == pytest.approx([0.1, 0.1]) and (b, 0) not in policy.steps.setup
    counts = list(policy.tokens)
    tree_step(miss, lagged=True, seconds=0.3)  # a hole in the drafter's context: nothing learned from it
    assert policy.tokens == counts and policy.times[(b, 0)] == pytest.approx([0.1, 0.1])
    tree_step(miss)  # a miss in step counts
    d = 0.98 ** 2  # (a step of 2 rows)
    assert policy.tokens[0] == pytest.approx(d * counts[0] + 2)
    for _ in range(4):  # more misses in step: the tree is now valued below 3 tokens a row
        tree_step(miss)
    counts, paired = list(policy.tokens), policy.paired_rows
    assert counts[0] / paired < 3
    tree_step(verdict, lagged=True, seconds=0.05)  # much faster than the window: the window was stale
    assert policy.times[(b, 0)] == pytest.approx([0.05])
    # and 3 tokens a row, more than the tree is valued at: the hole did not hold it back, so it counts
    assert policy.tokens[0] == pytest.approx(d * counts[0] + 6) and policy.paired_rows == pytest.approx(d * paired + 2)
    fresh = BatchPolicy(shapes_from(4, 16, 20, True), clock=clock)
    fresh.choose(2)
    fresh.lagged()  # the tree's first step ever: its counts are all there is, they count
    fresh.observe(tree, verdict)
    assert fresh.tokens[0] == pytest.approx(d * 17 + 6)



def test_what_a_switch_costs_is_kept_apart_from_a_shapes_time_in_step():
    """A drafting step after steps that did not draft also does the drafter's setup (the prompt on a call's first one,
    the plain steps' tokens after them): at any batch size its time stays out of the shape's window, and the
    difference is what a switch of that kind costs. 8.4M JF model, 16 rows: a chain of 2 took 45 ms on a call's first
    drafting step and about 20 ms in step; charged to its window it looked like 33 ms and kept a chain of 4 that ran
    1.14x stock alone from ever being measured."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    steps, b, chain2 = policy.steps, BatchPolicy.bucket(16), 3
    assert steps.overhead(b, "first") == 0.0  # nothing known: the first switch is taken at the shape's time
    steps.record(b, chain2, 0.045, setup="first")
    assert not policy.times.get((b, chain2)) and policy.seconds(b, chain2) == 0.045  # a stand-in while alone
    steps.record(b, chain2, 0.020)
    steps.record(b, chain2, 0.021)
    steps.record(b, chain2, 0.030, setup="lag")
    assert policy.times[(b, chain2)] == [0.020, 0.021] and policy.seconds(b, chain2) == pytest.approx(0.0205)
    assert steps.overhead(b, "first") == pytest.approx(0.0245) and steps.overhead(b, "lag") == pytest.approx(0.0095)
    assert steps.overhead(BatchPolicy.bucket(32), "lag") == 0.0
    again = type(steps)(policy.shapes, policy.tuning, steps.state())  # kept for the next call
    assert again.overhead(b, "first") == pytest.approx(0.0245)
    steps.record(b, chain2, 0.012, setup="lag")  # much faster than the window: the window was stale, replaced
    assert policy.times[(b, chain2)] == [0.012]
    # the configured tree from margin_rows rows runs only on revisits, each a switch: there its setup steps are its
    # time (kept apart, it was never trusted at 16 and 32 rows, floored nothing at 64 and was measured there)
    steps.record(b, 0, 0.9, setup="first", bursts=True)
    steps.record(b, 0, 0.8, setup="lag", bursts=True)
    assert policy.times[(b, 0)] == [0.9, 0.8] and steps.trusted(b, 0)
    small = BatchPolicy.bucket(4)
    steps.record(small, 0, 0.3, setup="first", bursts=True)  # below margin_rows rows: kept apart like any shape
    assert not policy.times.get((small, 0)) and policy.seconds(small, 0) == 0.3


def test_a_switch_is_spread_over_the_steps_it_buys():
    """The rule charges a drafting shape what a switch to it costs only when the last step did not draft, spread over
    the steps it is expected to run (the rows' remaining tokens over its tokens per row-step): early in a call a
    chain that wins in step is switched to, near the end of a call the plain step keeps going."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True))
    b, rows, chain2, plain = BatchPolicy.bucket(16), 16, 3, 4
    policy.tokens, policy.paired_rows = [400.0, 300.0, 280.0, 240.0, 100.0], 100.0  # tree 4 a row-step, chain 2 2.4
    policy.squares = [t * t / 100.0 for t in policy.tokens]
    policy.own[0] = [400.0, 100.0]
    _bucket_times(policy, rows, [0.2, 0.06, 0.04, 0.020, 0.010])  # chain 2: 120 tokens a second, plain 100
    policy.steps.switches[(b, chain2, "lag")] = [0.050]  # a switch back after plain steps: 30 ms more
    policy.steps.switches[(b, chain2, "first")] = [0.080]
    policy.gap = 10 ** 6  # (no revisit of the tree)
    policy._drafted, policy._in_step = True, True  # the drafter is in step: nothing to pay
    assert policy.switch(b, chain2) == 0.0 and policy.switch(b, plain) == 0.0
    policy._in_step = False  # after a plain step
    policy.remaining = 60.0  # 25 steps of the chain: 1.2 ms each
    assert policy.switch(b, chain2) == pytest.approx(0.030 / 25)
    assert policy.start_step(rows, 0.0, None, remaining=60.0) == chain2
    policy.close()
    policy._in_step = False
    assert policy.start_step(rows, 0.0, None, remaining=4.0) == plain  # 30 ms over 1.7 steps: not worth it
    policy._drafted = False  # a call's first drafting step pays the prompt
    assert policy.switch(b, chain2) == pytest.approx(0.060 / (4.0 / 2.4))

def test_the_trees_setup_steps_count_as_steps_it_ran_for_the_revisit_rule():
    """While the configured tree has run fewer than three steps in a bucket, its gaps alone decide its revisits (its
    time may hold a warm-up). Its steps after plain runs are setup steps that do not join its window: counted there
    alone, the tree at 16 rows of the 8.4M JF model stayed 'young' for good and was revisited at every gap (6 steps
    of a call's ~120 at five plain steps' cost each). Every step it ran counts."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), explore_every=4, tuning=FIRST)
    b = BatchPolicy.bucket(16)
    policy.tokens, policy.own[0] = [100.0, 70.0, 50.0, 35.0, 20.0], [100.0, 20.0]
    for i, s in enumerate([0.080, 0.050, 0.045, 0.040, 0.020]):  # the chain of 8 best; the tree's floor (0.05) hopeful
        policy.times[(b, i)] = [s, s]
    policy.since_tree, policy.budget = 100, 0.0
    assert policy.choose(16) == 0  # two steps: revisited at its gap, whatever the budget
    policy.close()
    for _ in range(3):
        policy.steps.record(b, 0, 0.5, setup=True)  # three revisits after plain runs: setup steps, not in the window
    assert policy.times[(b, 0)] == [0.080, 0.080] and policy.steps.runs(b, 0) == 3  # (the window was set by hand)
    policy.since_tree = 100
    assert policy.choose(16) != 0  # now the budget decides, and it covers no loss


def test_at_a_large_batch_a_tree_whose_visits_cost_more_than_its_floor_is_not_measured_or_revisited_for_free():
    """From ``margin_rows`` rows the tree runs only on visits, each a switch: its drafter reads the whole prompt (a
    call's first step) or the tokens since its last forward. Its floor leaves those reads out (they are not its time
    in step), so a tree resting on one or two such steps looked hopeful at a floor a fifth of what each visit took:
    the 8.4M JF model at 16 rows measured and revisited it outside the budget, 67-100 ms a step beside 9 ms plain
    steps, and ran at 0.95x stock where plain steps alone ran at 0.99x. There its hope also reads its fastest step,
    reads included, over ``stale``; the budget still revisits it, and below ``margin_rows`` rows nothing changes."""
    policy = BatchPolicy(shapes_from(4, 16, 20, True), tuning=FIRST)
    b = BatchPolicy.bucket(16)
    policy.tokens, policy.own[0] = [100.0, 50.0, 40.0, 30.0, 20.0], [100.0, 20.0]
    _bucket_times(policy, 16, [None, 0.034, 0.026, 0.020, 0.009])
    policy.steps.record(b, 0, 0.100, setup="first", bursts=True)  # its one step, at a call's start
    assert policy.floor(b, 0) == pytest.approx(0.034)  # (the chain of 8's time: the read is not its time in step)
    assert 1 / 0.034 > 1.15 * 0.2 / 0.009 > 1 / (0.100 / 1.5)  # hopeful at that floor, not at what a visit costs
    assert policy.steps.runs(b, 0) == 1 and not policy.hopeful(b, 16, 0, {4: 0.2 / 0.009})
    policy.since_tree, policy.budget = 100, 0.0
    assert policy.choose(16) == 4
    policy.close()
    policy.since_tree, policy.budget = 100, 1.0  # the budget covers the loss: a revisit, of the shape that loses
    assert policy.choose(16) == 3  # least while the plain step wins (the chain of 2)
    small = BatchPolicy(shapes_from(4, 16, 20, True), tuning=FIRST)
    small.tokens, small.own[0] = list(policy.tokens), [100.0, 20.0]
    _bucket_times(small, 4, [None, 0.034, 0.026, 0.020, 0.009])
    small.steps.record(BatchPolicy.bucket(4), 0, 0.100)
    small.since_tree, small.budget = 100, 0.0
    assert small.choose(4) == 0  # below margin_rows: its gaps alone, as before
