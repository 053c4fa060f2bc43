"""Issue class: stopping. Every strategy stops exactly where stock does, with and without EOS.

Table: {EOS, no EOS} x {a criterion stopping one row early, one stopping every row, max_length,
max_time that never fires} x strategies, on a left-padded batch. Without EOS, stock keeps producing
real tokens for a finished row until every row has finished (there is nothing to pad with).
"""

from __future__ import annotations

import functools

import pytest
import torch
from models import enabled, prompts
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


class StopRows(StoppingCriteria):
    """Stops the rows in ``rows`` once the sequence is ``length`` long."""

    def __init__(self, length: int, rows):
        self.length, self.rows = length, list(rows)

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[1] >= self.length:
            done[self.rows] = True
        return done


@functools.cache
def _head(kind):
    torch.manual_seed(0)
    return hfpd.DraftHead.for_target(enabled("llama"), attention=kind, num_hidden_layers=1, block_size=4)


STRATEGIES = {
    "jacobi": lambda: dict(block_size=6),
    "jacobi_forcing": lambda: dict(block_size=4, activation_ratio=0.5),
    "lookahead": lambda: dict(),
    "speculative_tree": lambda: dict(drafter=_head("tree_causal"), tree_budget=6, tree_width=2),
    "speculative_block": lambda: dict(drafter=_head("block_bidirectional"), tree_budget=4, tree_width=1),
}
PROMPT_LEN = 7
STOPS = {
    "one_row_early": lambda: dict(max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopRows(PROMPT_LEN + 5, [1])])),
    "all_rows": lambda: dict(max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopRows(PROMPT_LEN + 9, [0, 1, 2])])),
    "max_length": lambda: dict(max_length=PROMPT_LEN + 13),
    "max_time_never": lambda: dict(max_new_tokens=20, max_time=1e6),
}


@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("eos", ["eos", "no_eos"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_stopping_matches_stock(strategy, eos, stop):
    model = enabled("llama")
    ids, mask = prompts(3, length=PROMPT_LEN)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, **STOPS[stop]())
    if eos == "no_eos":
        kwargs["eos_token_id"] = None
    else:  # an EOS the greedy continuation of row 0 actually produces, so padding happens
        free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              eos_token_id=None, decoding="stock")
        kwargs["eos_token_id"] = int(free[0, PROMPT_LEN + 3])
    ref = model.generate(**kwargs, decoding="stock")
    decoding = strategy.split("_tree")[0].split("_block")[0]
    out = model.generate(**kwargs, decoding=decoding, **STRATEGIES[strategy]())
    assert torch.equal(out, ref), f"\n{out}\n{ref}"


def test_score_buffers_grow_with_the_output_not_with_max_new_tokens(monkeypatch):
    from hf_paralleldecode.engine.commit import CommitLog

    model = enabled("llama")
    ids, mask = prompts(2, length=PROMPT_LEN)
    seen = []
    orig = CommitLog.emit

    def spy(self):
        orig(self)
        seen.append(self._score_buf.shape[1])

    monkeypatch.setattr(CommitLog, "emit", spy)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, output_scores=True, output_logits=True,
                  return_dict_in_generate=True, stopping_criteria=StoppingCriteriaList([StopRows(PROMPT_LEN + 20, [0, 1])]))
    out = model.generate(**kwargs, max_new_tokens=100_000, decoding="jacobi", block_size=8)
    ref = model.generate(**kwargs, max_new_tokens=100_000, decoding="stock")
    assert torch.equal(out.sequences, ref.sequences) and len(out.scores) == len(ref.scores) == 20
    for a, b in zip(out.scores, ref.scores):  # same values up to float reassociation in the wider forward
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert max(seen) <= 64  # about twice what was committed, not 100k x vocab per row


@pytest.mark.parametrize("decoding,settings", [("jacobi", dict(block_size=8)), ("lookahead", {}),
                                               ("prompt_lookup", {})])
def test_logits_alone_are_returned_like_stock(decoding, settings):
    """output_logits without output_scores: one logits tensor per emitted step, as stock returns them (emission
    that decides on the host for the default length / EOS criteria must still keep them)."""
    model = enabled("llama")
    ids, mask = prompts(3, length=PROMPT_LEN)
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  max_new_tokens=12)
    out = model.generate(**kwargs, decoding=decoding, **settings)
    ref = model.generate(**kwargs, decoding="stock")
    assert torch.equal(out.sequences, ref.sequences) and out.scores is None
    assert out.logits is not None and len(out.logits) == len(ref.logits) == out.sequences.shape[1] - PROMPT_LEN
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
