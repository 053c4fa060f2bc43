"""The host-sync census (``hf_paralleldecode/census.py``) per steady-state step, counted on the CPU.

What a step asks of the device beyond its forwards is what makes it slow on a GPU: every read of device data by the
host (``.tolist()``, ``.item()``, ``int(t)``, ...) is a synchronisation there, every tensor built from host lists a
blocking copy, every small op a kernel launch. All three are countable here. Two calls of different lengths (the
same prompts and settings) give the steady state: their difference per target forward.

The budgets:
- a plain step (each row's last committed token alone) makes one read (the target's choices, read with everything
  the engine checks), builds nothing from host lists (beyond what a row leaving the batch, a cache compaction or a
  Jacobi block refill need now and then: :data:`AMORTISED`), and launches at most 30 small ops (2 more a row);
- a drafting step of every strategy and drafter kind stays at or below the count this suite last measured
  (:data:`DRAFTING_READS`): a ratchet toward issue 59's two reads per drafting step, lowered as reads go.
Each failure names the ``file:line`` of every read it counted.
"""

from __future__ import annotations

import pytest
import torch
from models import enabled, prompts
from test_drafter_contract import _medusa

from hf_paralleldecode.engine.census import HostCensus, per_forward

LENGTHS = (12, 36)
#: the reads and uploads a step makes now and then (a row leaving the batch, a cache compaction, a Jacobi block refilled
#: once per block: 1 step in 12 at the CPU preset), per
#: step on average
AMORTISED = 0.15


def census(model, modules=(), batch=1, **kw):
    ids, mask = prompts(batch)
    meter = HostCensus(model, *modules)
    records = []
    for n in LENGTHS:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **kw)  # warm: nothing first-call counts
        with meter.recording() as record:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, **kw)
        records.append(record)
    return per_forward(*records)


def _where(result) -> str:
    return "; ".join(f"{site}: {n:.2f}" for site, n in result["sites"].items()) or "none"


def test_stock_generate_reads_once_a_token():
    """The yardstick: stock greedy ``generate`` reads one flag per token (its stopping check)."""
    model = enabled("llama")
    result = census(model, do_sample=False, eos_token_id=None, decoding="stock")
    assert result["reads"] == 1 and result["uploads"] == 0, _where(result)


PLAIN = {
    "jacobi": dict(decoding="jacobi", max_step_tokens=1),
    "jacobi_forcing": dict(decoding="jacobi_forcing", max_step_tokens=1),
    "lookahead": dict(decoding="lookahead", max_step_tokens=1),
    "prompt_lookup": dict(decoding="prompt_lookup", max_step_tokens=1),
    "speculative": dict(decoding="speculative", max_step_tokens=1),
}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_a_plain_step_reads_the_device_once_and_builds_nothing_from_host_lists(name, batch):
    model = enabled("llama")
    kw = dict(PLAIN[name])
    modules = ()
    if name == "speculative":
        kw["drafter"] = drafter = _medusa(model)
        modules = (drafter,)
    stock = census(model, batch=batch, do_sample=False, decoding="stock")
    result = census(model, modules, batch=batch, do_sample=False, **kw)
    # one read a step; now and then (AMORTISED) one more: a row leaving the batch, the cache compacting its
    # holes, a Jacobi block refilled
    assert result["reads"] <= 1 + AMORTISED, f"{name}: {result['reads']:.2f} reads per plain step: {_where(result)}"
    assert result["uploads"] <= AMORTISED, f"{name}: {result['uploads']:.2f} uploads per plain step: {_where(result)}"
    ops = PLAIN_OPS + 2 * (batch - 1)
    assert result["ops"] <= ops, f"{name}: {result['ops']:.0f} small ops per plain step (budget {ops}; stock: " \
        f"{stock['ops']:.0f})"


#: reads per drafting step (the configured tree every step, greedy), batch 1 and 4, as last measured; the issue's
#: budget is 2 for every strategy and drafter kind: a branch drafter's waves (one read each) and a drafter's own cache
#: after its crop (DFlash, DEER) are still read apart
DRAFTING_READS = {
    "jacobi": 1.1, "jacobi_forcing": 2, "lookahead": 2.1, "prompt_lookup": 1.15,
    "speculative-medusa": 2.15, "speculative-jetspec": 6.1, "speculative-dflash": 3.1, "speculative-deer": 3.05,
}
#: small ops per drafting step at batch 1 (each row more: 2 more): 60, the issue's budget, where it is met; else as
#: last measured (a tree-causal head's waves, DEER's block bookkeeping)
DRAFTING_OPS = {name: 60 for name in DRAFTING_READS} | {"speculative-jetspec": 165, "speculative-deer": 70}
#: small ops per plain step at batch 1 (each row more: 2 more)
PLAIN_OPS = 30


def _drafter(model, kind):
    from hf_paralleldecode import DiffusionDrafter
    from hf_paralleldecode.drafters.head import DraftHead

    torch.manual_seed(0)
    if kind == "medusa":
        return _medusa(model)
    if kind == "deer":
        return DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4).eval()
    attention = {"jetspec": "tree_causal", "dflash": "block_bidirectional"}[kind]
    return DraftHead.for_target(model, attention=attention, block_size=4).eval()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", sorted(DRAFTING_READS))
def test_a_drafting_step_stays_within_its_read_budget(name, batch):
    model = enabled("llama")
    kw, modules = dict(decoding=name, adaptive=False), ()
    if name.startswith("speculative-"):
        drafter = _drafter(model, name.split("-", 1)[1])
        kw, modules = dict(decoding="speculative", drafter=drafter, adaptive=False), (drafter,)
    result = census(model, modules, batch=batch, do_sample=False, **kw)
    assert result["reads"] <= DRAFTING_READS[name], (
        f"{name} at batch {batch}: {result['reads']:.2f} reads per drafting step (budget {DRAFTING_READS[name]}): "
        f"{_where(result)}")
    ops = DRAFTING_OPS[name] + 2 * (batch - 1)
    assert result["ops"] <= ops, f"{name} at batch {batch}: {result['ops']:.0f} small ops per drafting step (budget {ops})"


def test_the_host_first_child_prefix_equals_the_device_one():
    """The batch policy's paired counts read the first-child prefix from the host lists of the tree and the verdict
    (no read); it must equal the tensor version on every tree."""
    from hf_paralleldecode.decoding.policy.shapes import first_child_prefix, first_child_prefix_host
    from hf_paralleldecode.engine.tree import pack_trees
    from hf_paralleldecode.engine.verify import verify_tree

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        batch = 1 + trial % 4
        roots = torch.randint(0, 5, (batch,), generator=g)
        candidates = [[torch.randint(0, 5, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                       for _ in range(int(torch.randint(1, 5, (1,), generator=g)))] for _ in range(batch)]
        tree = pack_trees(roots, candidates)
        choices = torch.randint(0, 5, tree.tokens.shape, generator=g)
        verdict = verify_tree(tree, None, False, choices=choices)
        expected = first_child_prefix(tree, verdict).tolist()
        assert first_child_prefix_host(tree, verdict) == expected, (candidates, choices)
        if tree.host is not None and verdict.host is not None:
            assert first_child_prefix_host(tree, verdict) == expected
