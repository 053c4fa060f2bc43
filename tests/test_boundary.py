"""What a proposer or a drafter kind hands the engine is checked at the boundary, in one place
(``engine/contract.py``): a strategy or drafter kind written from ``docs/architecture.md`` that gets the contract
slightly wrong is refused with a message naming the contract, never fed as given (silent wrong output) and never left
to fail inside torch. Plus: a finished row's scores are zeros whichever strategy committed past its EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from models import EOS, VOCAB, enabled, prompts, reference, small_prompts
from test_drafter_contract import MedusaDrafter, MedusaState, _medusa

import hf_paralleldecode as hfpd
from hf_paralleldecode.drafters.base import Drafter, DrafterState
from hf_paralleldecode.engine.commit import CommitLog
from hf_paralleldecode.engine.run import Proposer, decode_call
from hf_paralleldecode.engine.tree import chain_tree

pytestmark = pytest.mark.core

KW = dict(max_new_tokens=12, do_sample=False)


@dataclass
class NoSettings(hfpd.StrategySettings):
    """A strategy without settings."""


def _strategy(name, make):
    """A strategy whose proposer ``make(run)`` builds (no settings)."""
    return hfpd.decoding_strategy(name, NoSettings, lambda model, settings, call: decode_call(model, call, make, {}))


class Repeat(Proposer):
    """Guesses that the last committed token repeats (a correct proposer, to break in the subclasses)."""

    def __init__(self, run, width: int = 3):
        self.run, self.width = run, width

    def last(self, rows):
        log = self.run.log
        return log.tokens[rows, log.count[rows] - 1]

    def guesses(self, rows):
        return self.last(rows)[:, None].expand(-1, self.width + 1)

    def propose(self):
        rows = self.run.rows
        widths = torch.clamp(self.run.log.max_new_tokens - self.run.log.count[rows], max=self.width + 1)
        return chain_tree(self.guesses(rows), widths)

    def update(self, tree, verdict) -> None:
        """Nothing to learn."""


def _generate(strategy, batch=3, **kw):
    model = enabled("llama")
    ids, mask = prompts(batch)
    return model.generate(input_ids=ids, attention_mask=mask, custom_generate=strategy, **{**KW, **kw})


def test_the_correct_proposer_is_exact():
    assert torch.equal(_generate(_strategy("t_ok", Repeat)), reference("llama", 3, 12))


def test_a_tree_whose_root_is_not_the_last_committed_token_is_refused():
    class PromptRoot(Repeat):  # roots every tree at the prompt's last token, every step
        def guesses(self, rows):
            return self.run.prompt[rows, -1][:, None].expand(-1, self.width + 1)

    with pytest.raises(ValueError, match=r"root.*last committed token"):
        _generate(_strategy("t_root", PromptRoot))


def test_a_tree_for_every_original_row_after_one_finished_is_refused():
    class AllRows(Repeat):  # ignores run.rows: proposes for every row of the call
        def propose(self):
            rows = torch.arange(self.run.prompt.shape[0])
            return chain_tree(self.guesses(rows), torch.full((rows.numel(),), 2))

    # row 1 stops early (a length criterion per row is not stock's; an EOS that row 1 commits early is)
    ids, mask = prompts(3)
    eos = int(reference("llama", 3, 12)[1, ids.shape[1] + 2])
    with pytest.raises(ValueError, match=r"3 rows.*2 rows are active.*run\.rows"):
        _generate(_strategy("t_rows", AllRows), eos_token_id=eos)


def test_tree_tokens_outside_the_vocabulary_are_refused_before_the_forward():
    for bad in (VOCAB, VOCAB + 5, -1):
        class OutOfVocab(Repeat):
            def guesses(self, rows, bad=bad):
                g = super().guesses(rows).clone()
                g[:, 2] = bad
                return g

        with pytest.raises(ValueError, match=rf"token {bad} .*vocabulary of {VOCAB}"):
            _generate(_strategy("t_vocab", OutOfVocab))


def test_a_tree_with_mismatched_fields_is_refused():
    class Ragged(Repeat):
        def propose(self):
            tree = super().propose()
            tree.parents = tree.parents[:, :-1]
            return tree

    with pytest.raises(ValueError, match=r"parents.*tokens"):
        _generate(_strategy("t_ragged", Ragged))


def test_a_proposer_without_update_or_propose_is_refused_naming_the_method():
    class NoUpdate(Proposer):
        def __init__(self, run):
            self.run = run

        def propose(self):
            return Repeat(self.run).propose()

    with pytest.raises(ValueError, match=r"NoUpdate.*update\(tree, verdict\)"):
        _generate(_strategy("t_noupdate", NoUpdate))

    class NoPropose(Proposer):
        def __init__(self, run):
            pass

        def update(self, tree, verdict):
            pass

    with pytest.raises(ValueError, match=r"NoPropose.*propose\(\)"):
        _generate(_strategy("t_nopropose", NoPropose))
    with pytest.raises(ValueError, match=r"make_proposer.*returned 5"):
        _generate(_strategy("t_notaproposer", lambda run: 5))


# ---- drafter kinds ----------------------------------------------------------------------------------------------
class ShortState(MedusaState):
    """Marginals for fewer depths than the step asks for."""

    def marginals(self, step):
        return super().marginals(step)[:, :1]


class ShortMedusa(MedusaDrafter):
    def start(self, context, depth, denoise_steps=None):
        return ShortState(context, self)


class WideState(MedusaState):
    """Marginals over a vocabulary larger than the target's."""

    def marginals(self, step):
        logits = super().marginals(step)
        return torch.cat([logits, logits[..., :3]], dim=-1)


class WideMedusa(MedusaDrafter):
    def start(self, context, depth, denoise_steps=None):
        return WideState(context, self)


@pytest.mark.parametrize("do_sample", [False, True])
def test_marginals_shorter_than_the_step_depth_are_refused(do_sample):
    model = enabled("llama")
    ids, mask = prompts(3)
    drafter = ShortMedusa.for_target(model)
    with pytest.raises(ValueError, match=r"marginals.*\[3, 1, 97\].*\[3, >= ?4, 97\]"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=do_sample, decoding="speculative",
                       drafter=drafter, adaptive=False, tree_depth=4)


@pytest.mark.parametrize("do_sample", [False, True])
def test_drafter_logits_over_another_vocabulary_are_refused(do_sample):
    model = enabled("llama")
    ids, mask = prompts(3)
    drafter = WideMedusa.for_target(model)
    with pytest.raises(ValueError, match=r"marginals.*100\].*target's vocabulary.*97"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=do_sample, decoding="speculative",
                       drafter=drafter, adaptive=False)


def test_branch_logits_of_the_wrong_shape_are_refused():
    from hf_paralleldecode.drafters.head import DraftHead

    model = enabled("llama")
    ids, mask = prompts(3)
    torch.manual_seed(0)
    head = DraftHead.for_target(model, block_size=4).eval()
    assert head.expansion == "branches"
    start = head.start

    def broken_start(context, depth, denoise_steps=None):
        state = start(context, depth, denoise_steps)
        expand = state.expand
        state.expand = lambda step, nodes: expand(step, nodes)[:-1]  # one node short
        return state

    head.start = broken_start
    with pytest.raises(ValueError, match=r"expand.*\[\d+, 97\].*a row per node of the wave"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, decoding="speculative",
                       drafter=head, adaptive=False)


class NoWeightsState(DrafterState):
    """Proposes the root again at every depth (no weights of its own)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def marginals(self, step):
        logits = torch.full((step.rows.shape[0], step.depth, self.vocab), -1e4)
        logits.scatter_(2, step.roots[:, None, None].expand(-1, step.depth, 1), 0.0)
        return logits

    def update(self, step, tree, verdict):
        pass


class NoWeights(Drafter):
    kind = "t_no_weights"
    expansion = "marginals"

    def check_target(self, target, tokenizer=None):
        pass

    def start(self, context, depth, denoise_steps=None):
        return NoWeightsState(context.vocab)


def test_a_drafter_kind_without_parameters_runs_where_the_target_does():
    drafter = NoWeights()
    assert drafter.device is None and drafter.dtype is None  # optional: nothing of its own to place
    model = enabled("llama")
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, decoding="speculative",
                         drafter=drafter, tree_depth=3)
    assert torch.equal(out, reference("llama", 3, 12))


# ---- scores of finished rows --------------------------------------------------------------------------------------
def test_the_commit_log_emits_zeros_for_a_row_finished_in_the_same_step():
    from transformers import GenerationConfig, StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    ids = torch.tensor([[5, 6], [7, 8]])
    config = GenerationConfig(max_length=6, eos_token_id=EOS, pad_token_id=0)
    config._eos_token_tensor, config._pad_token_tensor = torch.tensor([EOS]), torch.tensor(0)  # as generate sets
    criteria = StoppingCriteriaList([MaxLengthCriteria(6), EosTokenCriteria(EOS)])
    log = CommitLog(ids, config, criteria, output_scores=True, output_logits=True)
    values = torch.arange(1, 2 * 4 * 5 + 1, dtype=torch.float).reshape(2, 4, 5)
    # row 0 commits EOS second, then two more tokens in the same step; row 1 four ordinary tokens
    log.add(torch.tensor([0, 1]), torch.tensor([[9, EOS, 9, 9], [9, 9, 9, 9]]), torch.tensor([4, 4]), values, values)
    log.emit()
    assert log.sequences[0, 2:].tolist() == [9, EOS, 0, 0]
    for t in range(4):
        for name in ("scores", "logits"):
            emitted = getattr(log, name)[t]
            assert torch.equal(emitted[1], values[1, t])
            assert torch.equal(emitted[0], values[0, t] if t < 2 else torch.zeros(5)), (name, t)


@pytest.mark.parametrize("do_sample", [False, True])
def test_speculative_scores_after_eos_are_zeros_like_every_strategy(small_vocab, do_sample):
    """An 8-token model: EOS (id 2) comes often, drafts are accepted often, so rows stop mid-step."""
    ids, mask = small_prompts(4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True, do_sample=do_sample,
              output_scores=True, output_logits=True)
    eos = EOS
    if not do_sample:  # greedy repeats itself: the EOS is a token row 0 makes early
        eos = int(small_vocab.generate(**kw, decoding="stock").sequences[0, ids.shape[1] + 3])
    kw["eos_token_id"] = eos
    finished_mid_run = 0
    for seed in range(4):
        torch.manual_seed(seed)
        out = small_vocab.generate(**kw, decoding="speculative", drafter=_medusa(small_vocab, seed), tree_budget=8,
                                   adaptive=False)
        for r in range(4):
            generated = out.sequences[r, ids.shape[1]:].tolist()
            stop = generated.index(eos) if eos in generated else None
            if stop is None or stop == len(out.scores) - 1:
                continue
            finished_mid_run += 1
            assert out.scores[stop][r].any() and out.logits[stop][r].any()
            for t in range(stop + 1, len(out.scores)):
                assert not out.scores[t][r].any() and not out.logits[t][r].any(), (seed, r, t)
        if not do_sample:
            stock = small_vocab.generate(**kw, decoding="stock")
            assert torch.equal(out.sequences, stock.sequences)
    assert finished_mid_run > 0
