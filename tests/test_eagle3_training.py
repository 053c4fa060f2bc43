"""EAGLE-3 distillation with training-time test: the TTT layout is the inference tree's, the loss falls, the saved
drafter decodes losslessly; and the train CLI's eagle3 method."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from test_draft_head_training import _data as _regenerated

import hf_paralleldecode as hfpd
from hf_paralleldecode import Eagle3Drafter
from hf_paralleldecode.compat import DynamicCache
from hf_paralleldecode.drafters.eagle3 import ttt_step_mask
from hf_paralleldecode.training import Eagle3Collator, Eagle3DistillationConfig, Eagle3DistillationTrainer


def test_ttt_step_sees_what_a_tree_node_sees():
    """Step 1 of training-time test at slot t equals a depth-2 node drafted at inference after the root slot t: the
    context slots 0..t, then the node slot (root's output state, x_{t+2}) at position t + 1."""
    target = hfpd.enable(tiny_model("llama", vocab_size=32))
    torch.manual_seed(0)
    drafter = Eagle3Drafter.for_target(target, initializer_range=0.3).bind(target).eval()
    S, t = 9, 5
    g = torch.randn(1, S, drafter.config.target_hidden_size * len(drafter.config.target_layer_ids))
    x = torch.randint(0, 32, (1, S + 2))
    context = torch.ones(S, S, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        cache = DynamicCache()
        pos = torch.arange(S)[None]
        state0, _ = drafter(drafter.embed(x[:, 1:S + 1]), drafter.fuse(g), pos, ttt_step_mask(context, 0), cache)
        _, ttt = drafter(drafter.embed(x[:, 2:S + 2]), state0, pos + 1, ttt_step_mask(context, 1), cache)
        # inference: only the context up to the root slot t, then one node slot
        cache = DynamicCache()
        s0, _ = drafter(drafter.embed(x[:, 1:t + 2]), drafter.fuse(g[:, : t + 1]), pos[:, : t + 1],
                        context[:, : t + 1, : t + 1], cache)
        _, node = drafter(drafter.embed(x[:, t + 2:t + 3]), s0[:, -1:], torch.tensor([[t + 1]]),
                          torch.ones(1, 1, t + 2, dtype=torch.bool), cache)
    torch.testing.assert_close(ttt[0, t], node[0, 0], rtol=1e-5, atol=1e-5)


def test_collator_weights_response_tokens_per_step():
    batch = Eagle3Collator(ttt_steps=2, step_loss_decay=0.5)([{"input_ids": [1, 2, 3, 4, 5, 6], "prompt_ids": [1, 2, 3]}])
    w = batch["weights"][0]  # [5 slots, 2 steps]: slot t, step j predicts token t + 2 + j, a response token when >= 3
    assert w[:, 0].tolist() == [0, 1, 1, 1, 0] and w[:, 1].tolist() == [0.5, 0.5, 0.5, 0, 0]
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3DistillationConfig(output_dir="x", ttt_steps=0, use_cpu=True, report_to="none")


def test_training_lowers_the_loss_and_the_saved_drafter_decodes_losslessly(tmp_path):
    target = hfpd.enable(tiny_model("llama", vocab_size=32))
    data = _regenerated(target)
    torch.manual_seed(0)
    drafter = Eagle3Drafter.for_target(target, draft_vocab_size=24)
    args = Eagle3DistillationConfig(output_dir=str(tmp_path / "out"), max_steps=30, per_device_train_batch_size=4,
                                    learning_rate=5e-3, logging_steps=5, use_cpu=True, report_to="none",
                                    save_strategy="no", ttt_steps=2)
    trainer = Eagle3DistillationTrainer(model=drafter.train(), args=args, target_model=target, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0] and any("draft_agreement" in h for h in trainer.state.log_history)
    trainer.save_model(str(tmp_path / "saved"))
    again = hfpd.load_drafter(tmp_path / "saved")
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4]])
    ref = target.generate(input_ids=ids, max_new_tokens=20, do_sample=False, decoding="stock")
    out = target.generate(input_ids=ids, max_new_tokens=20, do_sample=False, decoding="speculative", drafter=again)
    assert torch.equal(out, ref)


def test_an_authors_checkpoint_without_tap_ids_trains_on_the_reference_taps_of_its_target(tmp_path):
    """Fine-tuning an EAGLE authors' checkpoint (no tap ids recorded): the trainer taps the reference layers of the
    target (the inputs of layers 2, L // 2, L - 3) and the saved drafter still applies the rule."""
    from test_drafter_formats import _authors_eagle3

    target = hfpd.enable(tiny_model("llama", vocab_size=32, num_hidden_layers=8))
    torch.manual_seed(0)
    _authors_eagle3(Eagle3Drafter.for_target(target, layer_type="llama"), tmp_path / "authors")
    drafter = hfpd.load_drafter(tmp_path / "authors", cache=False)
    args = Eagle3DistillationConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                                    use_cpu=True, report_to="none", save_strategy="no", ttt_steps=2)
    trainer = Eagle3DistillationTrainer(model=drafter.train(), args=args, target_model=target,
                                        train_dataset=_regenerated(target))
    assert trainer._taps.layer_ids == [1, 3, 4]
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    again = hfpd.load_drafter(tmp_path / "saved", cache=False)
    assert again.config.target_layer_ids is None and again.bind(target).tap_layers == [1, 3, 4]
