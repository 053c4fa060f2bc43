"""DraftHeadDistillationTrainer: train/inference consistency, loss goes down, exact gradient accumulation, saving."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from models import tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode import DraftHead
from hf_paralleldecode.training.draft_head import (
    DraftHeadCollator,
    DraftHeadDistillationConfig,
    DraftHeadDistillationTrainer,
)

KINDS = ("tree_causal", "block_bidirectional")


def _data(model, n=8, prompt_len=5, new=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        prompt = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=g)
        out = model.generate(input_ids=prompt, max_new_tokens=new, do_sample=False, eos_token_id=None)
        rows.append(dict(prompt_ids=prompt[0].tolist(), input_ids=out[0].tolist()))
    return Dataset.from_list(rows)


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=3e-3,
                report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, max_anchors=6, seed=0)
    return DraftHeadDistillationConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", KINDS)
def test_training_forward_drafts_what_the_inference_drafter_drafts(kind, tmp_path, monkeypatch):
    """The block inputs and masks of training are those of inference (the SpecForge tau~1 bug class)."""
    target = hfpd.enable(tiny_model("qwen3", vocab_size=16))
    torch.manual_seed(0)
    head = DraftHead.for_target(target, attention=kind, num_hidden_layers=2, block_size=4, initializer_range=0.3)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    greedy = target.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    # inference: record the head's logits of the first step (block: one call; causal: one per wave)
    calls = []
    orig = DraftHead.logits

    def spy(self, hidden):
        out = orig(self, hidden)
        calls.append(out.detach().clone())
        return out

    monkeypatch.setattr(DraftHead, "logits", spy)
    target.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, decoding="speculative",
                    drafter=head, tree_budget=4, tree_width=1, tree_depth=4, drafter_dtype="target",  # fp32 as trained
                    adaptive=False)  # the configured chain on the first step, whatever the clock says
    monkeypatch.setattr(DraftHead, "logits", orig)
    if kind == "block_bidirectional":
        drafted = calls[0][0]  # [4, V]: depths 1..4 from the MASK slots
    else:
        drafted = torch.cat([c[:1] for c in calls[:4]])  # wave d: the query under the chain's depth-(d-1) node
    # training: one anchor at the first generated token; the block's real tokens are the drafted chain
    anchor = prompt.shape[1]
    seq = torch.cat([greedy[:, : anchor + 1], drafted.argmax(-1)[None]], dim=1)
    trainer = DraftHeadDistillationTrainer(model=head, args=_config(tmp_path), target_model=target,
                                           train_dataset=Dataset.from_list([{"input_ids": [0], "prompt_ids": [0]}]))
    batch = dict(input_ids=seq, attention_mask=torch.ones_like(seq), anchors=torch.tensor([[anchor]]),
                 weights=torch.ones(1, 1, 4))
    student = trainer.compute_loss(head, batch, return_outputs=True)[1]["student"]  # [4 counted positions, V]
    torch.testing.assert_close(student, drafted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_the_loss_and_saves_a_head_that_decodes_losslessly(kind, tmp_path):
    target = hfpd.enable(tiny_model("llama", vocab_size=32))
    head = DraftHead.for_target(target, attention=kind, num_hidden_layers=1, block_size=4)
    data = _data(target)
    trainer = DraftHeadDistillationTrainer(model=head, args=_config(tmp_path, max_steps=25), target_model=target,
                                           train_dataset=data)
    losses = [log["loss"] for log in (trainer.train() and trainer.state.log_history) if "loss" in log]
    assert losses[-1] < 0.7 * losses[0]
    assert any("draft_agreement" in log for log in trainer.state.log_history)
    trainer.save_model(str(tmp_path / "head"))
    assert not any("embed" in k or "lm_head" in k for k in DraftHead.from_pretrained(tmp_path / "head").state_dict())
    assert not (tmp_path / "head" / "model.safetensors").stat().st_size > 5 * sum(
        p.numel() * 4 for p in head.parameters())
    loaded = DraftHead.from_pretrained(tmp_path / "head")
    ids = torch.tensor([data[0]["prompt_ids"]])
    ref = target.generate(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    out = target.generate(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                          decoding="speculative", drafter=loaded, tree_budget=8, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert all(not p.requires_grad for p in target.parameters())


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    target = hfpd.enable(tiny_model("llama", vocab_size=32))
    data = _data(target, n=4)
    weights = []
    for bs, ga in ((4, 1), (2, 2)):
        torch.manual_seed(0)
        head = DraftHead.for_target(target, attention="tree_causal", num_hidden_layers=1, block_size=3)
        cfg = _config(tmp_path / f"{bs}", per_device_train_batch_size=bs, gradient_accumulation_steps=ga, max_steps=1,
                      learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                      max_anchors=100, dataloader_drop_last=False)
        trainer = DraftHeadDistillationTrainer(model=head, args=cfg, target_model=target, train_dataset=data,
                                               data_collator=DraftHeadCollator(3, max_anchors=100))
        trainer.train()
        weights.append(torch.cat([p.detach().reshape(-1) for p in head.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-4, atol=1e-5)


def test_chunked_loss_gives_the_same_step_as_one_chunk(tmp_path):
    target = hfpd.enable(tiny_model("llama", vocab_size=32))
    data = _data(target, n=4)
    weights, losses = [], []
    for chunk in (100000, 7):  # 7 positions per chunk: many checkpointed chunks
        torch.manual_seed(0)
        head = DraftHead.for_target(target, attention="block_bidirectional", num_hidden_layers=1, block_size=3)
        cfg = _config(tmp_path / f"{chunk}", per_device_train_batch_size=4, max_steps=1, learning_rate=1.0,
                      optim="sgd", lr_scheduler_type="constant", warmup_steps=0, loss_chunk_size=chunk)
        trainer = DraftHeadDistillationTrainer(model=head, args=cfg, target_model=target, train_dataset=data,
                                               data_collator=DraftHeadCollator(3, max_anchors=100))
        trainer.train()
        losses.append(trainer.state.log_history[0]["loss"])
        weights.append(torch.cat([p.detach().reshape(-1) for p in head.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-4, atol=1e-6)


def test_collator_and_config_validation():
    col = DraftHeadCollator(3, max_anchors=4, gamma=7.0)
    batch = col([dict(prompt_ids=[1, 2], input_ids=[1, 2, 3, 4, 5]), dict(prompt_ids=[1], input_ids=[1, 2])])
    assert batch["input_ids"].shape == (2, 5) and batch["anchors"].shape[1] == 3
    assert batch["anchors"][0].tolist() == [1, 2, 3] and batch["anchors"][1, 0] == 0
    # anchor 3 of row 0 only predicts token 4: weights of depths 2..3 vanish
    assert batch["weights"][0, 2].tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert batch["weights"][0, 0].tolist() == pytest.approx(torch.exp(-torch.arange(3.0) / 7).tolist())
    with pytest.raises(ValueError, match="prompt_ids"):
        col([dict(input_ids=[1, 2])])
    for bad in (dict(objective="jsd"), dict(max_anchors=0), dict(loss_chunk_size=0), dict(kd_temperature=0.0), dict(gamma=-1.0)):
        with pytest.raises(ValueError):
            DraftHeadDistillationConfig(output_dir="x", report_to=[], **bad)


def test_trainer_refuses_empty_data_and_token_ids_of_another_vocabulary(tmp_path):
    target = tiny_model("llama")
    head = DraftHead.for_target(target, num_hidden_layers=1, block_size=3)
    V = target.config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        DraftHeadDistillationTrainer(model=head, args=_config(tmp_path), target_model=target,
                                     train_dataset=Dataset.from_list([]))
    foreign = Dataset.from_list([dict(prompt_ids=[1, 2], input_ids=[1, 2, V + 5, 4])])
    with pytest.raises(ValueError, match="another tokenizer"):
        DraftHeadDistillationTrainer(model=head, args=_config(tmp_path), target_model=target, train_dataset=foreign)
