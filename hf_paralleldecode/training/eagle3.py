"""EAGLE-3 distillation with training-time test, in trl style: ``Eagle3DistillationConfig`` / ``Eagle3DistillationTrainer``.

Per batch (EAGLE-3, "training-time test")
    * the frozen target runs once without gradients over ``prompt + regenerated response``: its logits
      are the teachers, its tapped layers (low / middle / high) the fused features ``g``;
    * step 0 feeds every slot ``(g_t, x_{t+1})`` at position ``t`` under a causal mask: slot ``t``
      predicts ``x_{t+2}`` (teacher: the target's distribution at ``t + 1``);
    * step ``j = 1 .. ttt_steps - 1`` feeds the drafter *its own* output state of step ``j - 1`` with
      the token ``j`` further on (``x_{t+1+j}``, at position ``t + j``), seeing the step-0 slots up to
      its anchor and its own earlier steps (:func:`~hf_paralleldecode.drafters.eagle3.ttt_step_mask`):
      exactly what a depth-``j + 1`` tree node sees at inference, with the same forward;
    * loss: :func:`~hf_paralleldecode.training.losses.draft_distillation_loss` over the draft
      vocabulary (the teacher restricted to it), step ``j`` weighted by ``step_loss_decay ** j``,
      only where the predicted token is in the response; divided by the optimizer step's total weight.

Only the drafter trains and is saved; the target is never updated or saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from ..compat import DynamicCache
from ..drafters.eagle3 import Eagle3Drafter, ttt_step_mask
from .draft_head import DrafterTrainer, check_distillation_settings
from .losses import DISTILLATION_OBJECTIVES, draft_distillation_loss
from .methods import TrainingMethod, count_parameters, register_training_method
from .regenerate import check_regenerated_data

__all__ = ["Eagle3DistillationConfig", "Eagle3DistillationTrainer", "Eagle3Collator"]


@dataclass
class Eagle3DistillationConfig(TrainingArguments):
    """Training arguments of EAGLE-3 distillation (:class:`Eagle3DistillationTrainer`, recipe ``method: eagle3``).

    Every ``transformers.TrainingArguments`` field, plus the fields below (the recipe keys:
    ``docs/recipe-keys.md``). The drafter itself (layers, fused target layers, draft vocabulary) is the
    one passed to the trainer; in a recipe, the ``eagle3_*`` / ``draft_vocab_size`` / ``init_eagle3``
    script keys. ``remove_unused_columns`` defaults to ``False`` and must stay so: the collator reads the
    data columns.

    Args:
        ttt_steps: Training-time test steps (an integer >= 1): step ``j`` feeds the drafter its own output
            state of step ``j - 1``, as a depth ``j + 1`` tree node sees at inference; ``1`` = no TTT.
        step_loss_decay: Weight of step ``j``: ``step_loss_decay ** j``, in (0, 1].
        objective: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"sft"``, over the draft vocabulary.
        kd_temperature: Temperature ``T`` of the KL objectives, > 0; the loss carries ``T^2``.
        base_model_name_or_path: The target, for the model card.

    Raises:
        ValueError: a value outside the ranges above, or ``remove_unused_columns=True``.
    """

    ttt_steps: int = field(default=3, metadata={"help": (
        "Training-time test steps: step j feeds the drafter its own output of step j-1 (EAGLE-3; 1 = no TTT).")})
    step_loss_decay: float = field(default=1.0, metadata={"help": "Weight of TTT step j: step_loss_decay ** j."})
    objective: str = field(default="forward_kl", metadata={"help": f"Loss, one of {DISTILLATION_OBJECTIVES}."})
    kd_temperature: float = field(default=1.0, metadata={"help": "T_KD of the KL objectives (the loss carries T^2)."})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "The target, for the model card."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the data columns for the collator."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be an integer >= 1, got {self.ttt_steps!r}.")
        if not 0 < self.step_loss_decay <= 1:
            raise ValueError(f"step_loss_decay must be in (0, 1], got {self.step_loss_decay}.")
        check_distillation_settings(self)


class Eagle3Collator:
    """Right-pads ``input_ids`` and weights every (slot, TTT step).

    Rows need ``input_ids`` and ``prompt_ids`` (from ``hf-paralleldecode regenerate``); a row without them
    raises ``ValueError``. Only predictions of response tokens count.

    Calling it on a list of rows returns a dict of tensors: ``input_ids`` / ``attention_mask`` ``[B, T]`` and
    ``weights`` ``[B, T - 1, ttt_steps]``, ``step_loss_decay ** j`` where slot ``t`` at step ``j`` predicts a
    response token (``t + 2 + j``), else 0.

    Args:
        ttt_steps: Training-time test steps.
        step_loss_decay: Weight of step ``j``: ``step_loss_decay ** j``.
        pad_token_id: Id written into the padding.
    """

    def __init__(self, ttt_steps: int = 3, step_loss_decay: float = 1.0, pad_token_id: int = 0):
        self.steps, self.decay, self.pad = ttt_steps, step_loss_decay, pad_token_id

    def __call__(self, rows):
        for r in rows:
            if "input_ids" not in r or "prompt_ids" not in r:
                raise ValueError("EAGLE-3 training rows need `input_ids` and `prompt_ids` (from `regenerate`).")
        T = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), T), self.pad, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        weights = torch.zeros(len(rows), max(T - 1, 1), self.steps)
        t = torch.arange(max(T - 1, 1))[:, None]
        j = torch.arange(self.steps)[None]
        for b, r in enumerate(rows):
            n, p = len(r["input_ids"]), len(r["prompt_ids"])
            ids[b, :n] = torch.tensor(list(r["input_ids"]), dtype=torch.long)
            mask[b, :n] = 1
            predicted = t + 2 + j
            weights[b] = ((predicted < n) & (predicted >= p)).float() * self.decay ** j.float()
        return dict(input_ids=ids, attention_mask=mask, weights=weights)


class Eagle3DistillationTrainer(DrafterTrainer):
    """Trains an :class:`~hf_paralleldecode.Eagle3Drafter` (``model``) against a frozen ``target_model``.

    EAGLE-3 with training-time test (module docstring): one no-grad forward of the target gives the teacher
    logits and the fused low / middle / high features; ``ttt_steps`` drafter forwards follow, each fed the
    previous step's output states; the loss is :func:`~hf_paralleldecode.training.draft_distillation_loss`
    over the draft vocabulary, step ``j`` weighted ``step_loss_decay ** j``, divided by the optimizer step's
    total weight. Only the drafter trains and is saved, never the target.

    Dataset columns (``hf-paralleldecode regenerate``, loaded with
    :func:`~hf_paralleldecode.training.load_regenerated`): ``input_ids`` (prompt + the target's own
    continuation) and ``prompt_ids``. Token ids must fit the target's vocabulary; an empty dataset is
    refused.

    Logged (averaged over the logging interval): ``loss`` (the distillation loss, a weighted mean over every
    (position, step) pair) and ``draft_agreement`` (the weighted share of those predictions whose top-1
    token equals the target's top-1 within the draft vocabulary, every step together), besides the
    Trainer's ``grad_norm`` and ``learning_rate``.

    Construction: as ``transformers.Trainer``, with ``model`` the drafter to train, ``args`` an
    :class:`Eagle3DistillationConfig` and ``target_model`` the frozen model it drafts for (required; moved
    to the training device, never wrapped by the accelerator, so every process holds a full copy).
    ``data_collator`` defaults to an :class:`Eagle3Collator` with the config's ``ttt_steps`` and
    ``step_loss_decay``.
    """

    def __init__(self, model=None, args=None, target_model=None, data_collator=None, **kwargs):
        pad = self.check_frozen_target("Eagle3DistillationTrainer", "drafter", model, target_model,
                                       kwargs.get("train_dataset"))
        if data_collator is None and args is not None:
            data_collator = Eagle3Collator(args.ttt_steps, args.step_loss_decay, pad)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self.freeze_target(target_model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter = self.accelerator.unwrap_model(model)
        ids, attn, weights = inputs["input_ids"], inputs["attention_mask"], inputs["weights"]
        B, T = ids.shape
        S = T - 1  # slots t = 0 .. T - 2
        device = ids.device
        with torch.no_grad():
            teacher = self.target(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
            feats = self._taps.features()[:, :S]  # g_t
        draft_ids = drafter.draft_token_ids().to(device)
        valid = attn[:, :S].bool()
        context = torch.ones(S, S, dtype=torch.bool, device=device).tril()[None] & valid[:, None, :]
        context |= torch.eye(S, dtype=torch.bool, device=device)[None]
        cache = DynamicCache()
        hidden = drafter.fuse(feats)
        t = torch.arange(S, device=device)
        loss = hidden.new_zeros((), dtype=torch.float32)
        agree, total = hidden.new_zeros((), dtype=torch.float32), weights.sum().clamp(min=1e-12)
        denom = num_items_in_batch if num_items_in_batch is not None else total
        for j in range(self.args.ttt_steps):
            tok = ids.gather(1, (t + 1 + j).clamp(max=T - 1)[None].expand(B, -1))
            hidden, logits = model(drafter.embed(tok), hidden, (t + j)[None].expand(B, -1), ttt_step_mask(context, j),
                                   cache)
            w = weights[:, :S, j].to(device)
            teach = teacher[:, (t + 1 + j).clamp(max=T - 1)][..., draft_ids]  # [B, S, Vd]
            loss = loss + draft_distillation_loss(logits.float(), teach.float(), w, self.args.objective,
                                                  self.args.kd_temperature, num_items_in_batch=denom)
            agree = agree + ((logits.detach().argmax(-1) == teach.argmax(-1)).float() * w).sum()
        self._metrics["draft_agreement"].append(float(agree / total))
        loss = self._across_processes(loss, num_items_in_batch)
        return (loss, {"draft_agreement": agree.detach()}) if return_outputs else loss


# ---- the recipe method ``eagle3`` (hf-paralleldecode train: training/methods.py) --------------------------------
@dataclass
class Eagle3Options:
    """The recipe keys of a new EAGLE-3 drafter (``method: eagle3``)."""

    eagle3_num_hidden_layers: int = field(default=1, metadata={"help": "eagle3: decoder layers of a new drafter."})
    eagle3_target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "eagle3: target layers to fuse (default: EAGLE's low / middle / high layers).")})
    draft_vocab_size: int | None = field(default=None, metadata={"help": (
        "eagle3: a reduced draft vocabulary of the most frequent tokens in the data (default: the full vocabulary).")})
    init_eagle3: str | None = field(default=None, metadata={"help": "eagle3: start from this saved drafter instead."})


def _new_eagle3(model, script, args, dataset=None) -> Eagle3Drafter:
    drafter = Eagle3Drafter.for_target(model, num_hidden_layers=script.eagle3_num_hidden_layers,
                                       target_layer_ids=script.eagle3_target_layer_ids,
                                       draft_vocab_size=script.draft_vocab_size,
                                       target_name_or_path=args.base_model_name_or_path)
    if script.draft_vocab_size and dataset is not None:  # EAGLE's choice: the most frequent tokens of the data
        counts = torch.zeros(drafter.config.target_vocab_size, dtype=torch.long)
        for row in dataset:
            counts += torch.bincount(torch.tensor(list(row["input_ids"])), minlength=counts.numel())
        drafter.set_draft_vocab(counts.topk(script.draft_vocab_size).indices)
    return drafter


def _build(model, tokenizer, script, args):
    from ..drafters.loading import load_drafter
    from .regenerate import load_regenerated

    dataset = load_regenerated(script.trajectories, tokenizer=tokenizer)
    drafter = load_drafter(script.init_eagle3, cache=False) if script.init_eagle3 else \
        _new_eagle3(model, script, args, dataset)
    return Eagle3DistillationTrainer(model=drafter.train(), args=args, target_model=model, train_dataset=dataset)


def _dry_run(target, script, args):
    with torch.device("meta"):
        drafter = _new_eagle3(target, script, args)
    trainable = count_parameters(drafter)
    c = drafter.config
    return dict(trains="the EAGLE-3 drafter only (the target is frozen and never saved)",
                drafter=dict(num_hidden_layers=c.num_hidden_layers, target_layer_ids=list(c.target_layer_ids),
                             draft_vocab_size=c.draft_vocab_size, parameters=trainable),
                ttt_steps=args.ttt_steps, objective=args.objective), trainable


register_training_method(TrainingMethod("eagle3", Eagle3DistillationConfig, Eagle3DistillationTrainer, _build, _dry_run,
                                        Eagle3Options, check_regenerated_data))
