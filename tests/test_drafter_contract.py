"""A drafter kind written from ``docs/architecture.md`` ("Writing a drafter kind") alone: Medusa-style heads.

``K`` independent heads read the target's last decoder layer at the last accepted position ``t`` (through the
context's taps) and head ``k`` predicts the token at ``t + 1 + k``: with the root (the target's own token at
``t + 1``) they give per-depth marginals for depths ``1..K`` from one forward (``expansion = "marginals"``). The
kind registers here, in this file: its checkpoint format, its export, nothing else edited.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from models import VOCAB, enabled, prompts, reference
from safetensors.torch import save_file
from torch import nn

import hf_paralleldecode as hfpd
from hf_paralleldecode.drafters.base import Drafter, DrafterState, register_drafter_kind
from hf_paralleldecode.drafters.context import DrafterContext, DraftStep
from hf_paralleldecode.drafters.formats import DrafterFormat, load_strict, read_tensors

pytestmark = pytest.mark.core


class MedusaState(DrafterState):
    """One call: the feature ``[active, H]`` of each row's last accepted position (the node before its root)."""

    def __init__(self, context: DrafterContext, drafter: MedusaDrafter):
        super().__init__()
        self.drafter, self.taps, self.vocab = drafter, context.taps, context.vocab
        self.last = self.taps.features()[:, -1]  # left padding: the last column is every row's last prompt token

    def marginals(self, step: DraftStep) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.drafter.draft(self.last)  # [active, K, V]
        self.seconds += time.perf_counter() - t0
        self.forwards += 1
        self.fed_tokens += self.last.shape[0]
        return logits

    def update(self, step: DraftStep, tree, verdict) -> None:
        feats = self.taps.features()  # [active, nodes, H] of the verified tree
        last = verdict.path.gather(1, verdict.num_accepted[:, None])  # [active, 1] the last accepted node
        self.last = feats.gather(1, last[..., None].expand(-1, -1, feats.shape[-1]))[:, 0]

    def select(self, kept: torch.Tensor) -> None:
        super().select(kept)
        self.last = self.last[kept]


MEDUSA_CONFIG = "medusa_test_config"  # the model_type this kind's checkpoints record


@register_drafter_kind
class MedusaDrafter(Drafter):
    kind = "medusa_test"
    expansion = "marginals"
    FORMATS = (DrafterFormat("medusa test heads", "medusa_test", lambda c: c.get("model_type") == MEDUSA_CONFIG),)
    EXPORT_FORMATS = ("medusa",)

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, num_heads: int = 4):
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_layers = hidden_size, vocab_size, num_layers
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        self._target = []  # borrowed at bind (never saved or moved)

    @classmethod
    def for_target(cls, target, num_heads: int = 4) -> MedusaDrafter:
        c = target.config
        return cls(c.hidden_size, target.get_output_embeddings().weight.shape[0], c.num_hidden_layers, num_heads)

    # ---- the contract ----------------------------------------------------------------------------------
    def check_target(self, target, tokenizer=None) -> None:
        c = target.config
        if (c.hidden_size, target.get_output_embeddings().weight.shape[0], c.num_hidden_layers) != (
                self.hidden_size, self.vocab_size, self.num_layers):
            raise ValueError("These Medusa heads were built for another target.")

    def bind(self, target) -> MedusaDrafter:
        self.check_target(target)
        self._target[:] = [target]
        return self

    @property
    def tap_layers(self) -> list[int]:
        return [self.num_layers - 1]

    @property
    def max_depth(self) -> int:
        return len(self.heads)

    def describe(self) -> str:
        return "Medusa heads"

    def start(self, context: DrafterContext, depth: int, denoise_steps: int | None = None) -> MedusaState:
        return MedusaState(context, self)

    def draft(self, feature: torch.Tensor) -> torch.Tensor:
        """``[b, H]`` -> ``[b, K, V]``: head ``k`` (a residual SiLU block) through the target's LM head."""
        h = feature.to(self.dtype)
        hidden = torch.stack([h + nn.functional.silu(head(h)) for head in self.heads], dim=1)
        lm_head = self._target[0].get_output_embeddings()
        return lm_head(hidden.to(lm_head.weight.dtype)).float()

    # ---- checkpoints -------------------------------------------------------------------------------------
    def export(self, directory: Path, format: str, verifier=None) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(model_type=MEDUSA_CONFIG, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                      num_layers=self.num_layers, num_heads=len(self.heads))
        (directory / "config.json").write_text(json.dumps(config))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  directory / "model.safetensors")
        return directory

    def save_pretrained(self, save_directory, **kwargs):
        self.export(Path(save_directory), "medusa")

    @classmethod
    def read_checkpoint(cls, fmt, folder, config: dict) -> MedusaDrafter:
        drafter = cls(config["hidden_size"], config["vocab_size"], config["num_layers"], config["num_heads"])
        load_strict(drafter, read_tensors(folder), fmt, folder)
        return drafter.eval()


def _medusa(model, seed: int = 0) -> MedusaDrafter:
    torch.manual_seed(seed)
    drafter = MedusaDrafter.for_target(model)
    with torch.no_grad():  # small residual blocks: each head starts near the target's own next-token head
        for head in drafter.heads:
            head.weight.mul_(0.2)
    return drafter.eval()


@pytest.mark.parametrize("settings", [dict(tree_budget=8, tree_width=2), dict(tree_budget=4, tree_width=1, tree_depth=3),
                                      dict(tree_budget=16, tree_width=4, adaptive=False)])
def test_a_kind_written_from_the_contract_is_lossless_at_batch_3_with_left_padding(settings):
    model = enabled("llama")
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=_medusa(model), return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, reference("llama", 3, 24))
    stats = out.stats
    assert stats["drafter"] == "medusa_test" and stats["tree_depth"] == settings.get("tree_depth", 4)
    assert out.draft_stats.steps > 0 and stats["drafter_forwards_per_step"] == 1 and stats["tau"] >= 1


def test_a_sampled_run_of_the_kind_completes():
    model = enabled("llama")
    ids, mask = prompts(3)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20,
                         decoding="speculative", drafter=_medusa(model), tree_budget=8, eos_token_id=None)
    assert out.shape == (3, ids.shape[1] + 20) and int(out.max()) < VOCAB
    # a seeded call is reproducible when its shapes are: with the batch policy on they follow measured step times
    # (the draws then differ, the distribution does not), so the check runs the configured tree every step
    fixed = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20,
                 decoding="speculative", tree_budget=8, eos_token_id=None, adaptive=False)
    torch.manual_seed(0)
    first = model.generate(drafter=_medusa(model), **fixed)
    torch.manual_seed(0)
    assert torch.equal(first, model.generate(drafter=_medusa(model), **fixed))


def test_the_kind_exports_and_loads_back_through_its_registered_format(tmp_path):
    model = enabled("llama")
    ids, mask = prompts(3)
    drafter = _medusa(model, seed=3)
    folder = hfpd.export_drafter(drafter, tmp_path / "medusa", format="medusa")
    loaded = hfpd.load_drafter(folder, cache=False)
    assert isinstance(loaded, MedusaDrafter) and loaded is not drafter
    for mine, theirs in zip(drafter.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(mine, theirs)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, decoding="speculative",
              tree_budget=8, adaptive=False, return_dict_in_generate=True)  # the configured tree every step
    first, second = model.generate(drafter=drafter, **kw), model.generate(drafter=loaded, **kw)
    assert torch.equal(first.sequences, second.sequences)
    assert first.draft_stats.accepted_lengths == second.draft_stats.accepted_lengths
    with pytest.raises(ValueError, match="Unknown export format 'speculators'"):
        hfpd.export_drafter(drafter, tmp_path / "other", format="speculators")


def test_a_kind_missing_a_required_member_is_refused_when_it_registers():
    class NoStart(Drafter):
        kind = "medusa_test_no_start"

        def check_target(self, target, tokenizer=None) -> None:
            pass

    with pytest.raises(ValueError, match="does not define start"):
        register_drafter_kind(NoStart)

    class NoReader(Drafter):  # lists a checkpoint format it cannot read
        kind = "medusa_test_no_reader"
        FORMATS = (DrafterFormat("nothing", "medusa_test_no_reader", lambda c: False),)

        def check_target(self, target, tokenizer=None) -> None:
            pass

        def start(self, context, depth, denoise_steps=None):
            return MedusaState(context, self)

    with pytest.raises(ValueError, match="does not define read_checkpoint"):
        register_drafter_kind(NoReader)

    class Sideways(MedusaDrafter):
        kind = "medusa_test_sideways"
        expansion = "sideways"

    with pytest.raises(ValueError, match="expansion must be one of"):
        register_drafter_kind(Sideways)
    with pytest.raises(ValueError, match="registered twice"):
        register_drafter_kind(MedusaDrafter)


def test_a_state_missing_what_its_expansion_needs_is_refused_before_the_first_step():
    class Forgetful(DrafterState):  # a marginals state with no marginals
        def update(self, step, tree, verdict):
            pass

    class ForgetfulMedusa(MedusaDrafter):
        def start(self, context, depth, denoise_steps=None):
            return Forgetful()

    model = enabled("llama")
    ids, mask = prompts(3)
    drafter = ForgetfulMedusa.for_target(model)  # an object is used as given: no registration needed
    with pytest.raises(TypeError, match="defines no marginals"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, decoding="speculative",
                       drafter=drafter)
