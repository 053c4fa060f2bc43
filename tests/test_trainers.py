"""Consistency (CLLM) and progressive consistency (Jacobi Forcing) trainers on a tiny model, on CPU."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from models import tiny_model, word_tokenizer

import hf_paralleldecode as hfpd
from hf_paralleldecode.training.collators import ConsistencyCollator, ProgressiveCollator
from hf_paralleldecode.training.trainers import (
    ConsistencyConfig,
    ConsistencyTrainer,
    ProgressiveConsistencyConfig,
    ProgressiveConsistencyTrainer,
)
from hf_paralleldecode.training.trajectories import collect_trajectories

PROMPTS = [f"t{5 + i} t{6 + i} t{7 + i}" for i in range(8)]


@functools.cache
def trajectories(tmp_root: str):
    return collect_trajectories(tiny_model("llama"), word_tokenizer(), PROMPTS, tmp_root, block_size=4,
                                max_new_tokens=16, batch_size=8, progress=False)


def _args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=kw.pop("max_steps", 30),
               learning_rate=kw.pop("learning_rate", 3e-3), logging_steps=kw.pop("logging_steps", 5), save_strategy="no", report_to=[],
               use_cpu=True, block_size=4, base_model_name_or_path="tiny-llama", disable_tqdm=True, **kw)


@pytest.mark.parametrize("trainer_cls, config_cls, extra, decoding", [
    (ProgressiveConsistencyTrainer, ProgressiveConsistencyConfig, {}, "jacobi_forcing"),
    (ProgressiveConsistencyTrainer, ProgressiveConsistencyConfig, {"mask": "cllm", "noise_schedule": "random"},
     "jacobi_forcing"),
    (ConsistencyTrainer, ConsistencyConfig, {}, "jacobi"),
    (ConsistencyTrainer, ConsistencyConfig, {"consistency": "local", "distance": "jsd"}, "jacobi"),
])
def test_training_lowers_the_loss_and_saves_a_decodable_checkpoint(tmp_path, trainer_cls, config_cls, extra, decoding):
    ds = trajectories(str(tmp_path.parent / "traj"))
    model = tiny_model("llama")
    args = _args(config_cls, tmp_path, **extra)
    trainer = trainer_cls(model=model, args=args, train_dataset=ds)
    batch = trainer.data_collator([ds[i] for i in range(4)])
    with torch.no_grad():
        before = float(trainer.compute_loss(model, batch))
    trainer.train()
    with torch.no_grad():
        after = float(trainer.compute_loss(model, batch))
    assert torch.isfinite(torch.tensor(before)) and after < before
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    config = json.loads((out / "parallel_decoding_config.json").read_text())
    assert config["decoding"] == decoding and config["settings"]["block_size"] == 4
    assert config["base_model_name_or_path"] == "tiny-llama"
    assert "Citation" in (out / "README.md").read_text()
    loaded = hfpd.load_model(out)
    ids = torch.tensor([[5, 6, 7]])
    res = loaded.generate(input_ids=ids, max_new_tokens=12, return_dict_in_generate=True)
    assert res.decoding == decoding
    assert torch.equal(res.sequences, loaded.generate(input_ids=ids, max_new_tokens=12, decoding="stock",
                                                      do_sample=False))


@pytest.mark.parametrize("cls, kwargs, match", [
    (ConsistencyConfig, dict(consistency="both"), "consistency"),
    (ConsistencyConfig, dict(distance="l2"), "distance"),
    (ConsistencyConfig, dict(beta=1.0), "beta"),
    (ConsistencyConfig, dict(block_size=1), "block_size"),
    (ProgressiveConsistencyConfig, dict(noise_schedule="cosine"), "noise_schedule"),
    (ProgressiveConsistencyConfig, dict(mask="full"), "mask"),
    (ProgressiveConsistencyConfig, dict(ar_weight=-1.0), "ar_weight"),
])
def test_config_validation(tmp_path, cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_collators_name_data_problems(tmp_path):
    ds = trajectories(str(tmp_path.parent / "traj"))
    row = dict(ds[0])
    with pytest.raises(ValueError, match="block size 4 but the config says block_size=8"):
        ProgressiveCollator(8)([row])
    broken = {k: v for k, v in row.items() if k != "fixed_points"}
    with pytest.raises(ValueError, match="missing \\['fixed_points'\\]"):
        ConsistencyCollator(4)([broken])
    empty = dict(row, trajectories=[], fixed_points=[])
    with pytest.raises(ValueError, match="no complete block"):
        ProgressiveCollator(4)([empty])


@pytest.mark.parametrize("trainer_cls, config_cls, extra", [
    (ProgressiveConsistencyTrainer, ProgressiveConsistencyConfig, {}),
    (ConsistencyTrainer, ConsistencyConfig, {}),
    (ConsistencyTrainer, ConsistencyConfig, {"consistency": "local"}),
])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, trainer_cls, config_cls, extra):
    """Each loss term is normalised by its counted positions over the whole optimizer step, so 2 x 2 with
    accumulation takes exactly the step of one batch of 4 (a per-micro-batch mean would not)."""
    ds = trajectories(str(tmp_path.parent / "traj"))
    params = []
    for batch, accumulation in ((4, 1), (2, 2)):
        model = tiny_model("llama")
        args = _args(config_cls, tmp_path, max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                     gradient_accumulation_steps=accumulation, **extra)
        args.per_device_train_batch_size = batch
        trainer_cls(model=model, args=args, train_dataset=ds).train()
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    initial = torch.cat([p.detach().reshape(-1) for p in tiny_model("llama").parameters()])
    assert (params[0] - initial).abs().max() > 1e-3  # the step did move the weights
    torch.testing.assert_close(params[1], params[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("trainer_cls, config_cls, terms", [
    (ProgressiveConsistencyTrainer, ProgressiveConsistencyConfig, ("pc_loss", "ar_loss")),
    (ConsistencyTrainer, ConsistencyConfig, ("consistency_loss", "ar_loss")),
])
def test_each_loss_term_is_logged(tmp_path, trainer_cls, config_cls, terms):
    ds = trajectories(str(tmp_path.parent / "traj"))
    trainer = trainer_cls(model=tiny_model("llama"), args=_args(config_cls, tmp_path, max_steps=4, logging_steps=2),
                          train_dataset=ds)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for h in logged:
        assert all(t in h and h[t] > 0 for t in terms)
        # AR weight 1: the logged total is the sum of the logged terms (micro-batch means)
        assert h["loss"] == pytest.approx(h[terms[0]] + h["ar_loss"], rel=2e-3)


def test_push_to_hub_model_card_is_the_methods_card(tmp_path):
    """Trainer.push_to_hub calls create_model_card() after saving, which would replace the card naming the
    base model, method and citation with transformers' generic one."""
    ds = trajectories(str(tmp_path.parent / "traj"))
    args = _args(ProgressiveConsistencyConfig, tmp_path, max_steps=1)
    trainer = ProgressiveConsistencyTrainer(model=tiny_model("llama"), args=args, train_dataset=ds)
    trainer.save_model(args.output_dir)
    trainer.create_model_card(model_name="my-jf-model", tags=["extra-tag"])
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Citation" in card and "tiny-llama" in card and "jacobi_forcing" in card
    assert "extra-tag" in card and "my-jf-model" in card


@pytest.mark.parametrize("trainer_cls, config_cls", [
    (ProgressiveConsistencyTrainer, ProgressiveConsistencyConfig),
    (ConsistencyTrainer, ConsistencyConfig),
])
def test_ar_term_can_distil_the_frozen_base_distribution(tmp_path, trainer_cls, config_cls):
    """ar_target='base_kl': the AR term is KL(base || model) on the response positions, against a frozen copy
    of the starting model: exactly 0 before training, > 0 after, and the base copy never moves."""
    ds = trajectories(str(tmp_path.parent / "traj"))
    model = tiny_model("llama")
    trainer = trainer_cls(model=model, args=_args(config_cls, tmp_path, max_steps=10, ar_target="base_kl"),
                          train_dataset=ds)
    batch = trainer.data_collator([ds[i] for i in range(4)])
    with torch.no_grad():
        _, terms = trainer.compute_loss(model, batch, return_outputs=True)
    assert float(terms["ar_loss"]) == pytest.approx(0.0, abs=1e-6)
    frozen = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    with torch.no_grad():
        _, terms = trainer.compute_loss(model, batch, return_outputs=True)
    assert float(terms["ar_loss"]) > 1e-6
    assert all(torch.equal(a, b) for a, b in zip(frozen, trainer.ref_model.parameters()))
    with pytest.raises(ValueError, match="ar_target"):
        config_cls(output_dir=str(tmp_path), use_cpu=True, report_to=[], ar_target="soft")
