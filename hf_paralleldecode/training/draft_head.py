"""Draft-head distillation in trl style: ``DraftHeadDistillationConfig`` / ``DraftHeadDistillationTrainer``.

Per batch (JetSpec "Data Preparation", Eq. 11-14)
    * the frozen target runs once without gradients over ``prompt + regenerated response``: its
      logits are the teachers and its tapped layers (forward hooks) the head's context features;
    * the collator samples up to ``max_anchors`` anchors per sequence in the response; each anchor
      ``a`` gets a block predicting tokens ``a+1 .. a+block_size`` whose teacher is the target's
      distribution at ``a+k-1``, weighted by ``w_k`` (uniform, or ``exp(-(k-1)/gamma)``);
    * ONE head forward covers every block of the batch: the context is every position's feature,
      and a block sees only context strictly before its anchor plus its own slots (no cross-block
      visibility), laid out with the *same slot conventions the drafter uses at inference*
      (``drafters/head.py``):
        - ``block_bidirectional``: ``[anchor, MASK x block_size]``, bidirectional in the block;
        - ``tree_causal``: real tokens ``a .. a+block_size-1`` (teacher-forced: the regenerated
          tokens, i.e. what the target committed) plus a MASK query under each, the query at depth
          ``k`` seeing the real tokens above it: exactly a chain of the inference tree.
      A test checks that the training forward gives the same draft logits as the inference drafter.
    * loss: :func:`~hf_paralleldecode.training.losses.draft_distillation_loss` (forward KL with
      the ``T^2`` prefactor by default, reverse KL or SFT), divided by the total weight of the
      optimizer step over all micro-batches and processes (exact under gradient accumulation).

Only the head trains and is saved (``save_model`` / ``push_to_hub`` write the head, its config and
its card); the target is never updated or saved. Under ``accelerate launch`` the frozen target is
replicated on every process (it is not wrapped by the accelerator), like the reference model of
the consistency trainers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from ..compat import TrainerHooks
from ..drafters.head import DraftHead, block_layout
from ..engine.cache import additive_mask
from ..engine.target import HiddenStateTaps
from .losses import DISTILLATION_OBJECTIVES, draft_distillation_loss, position_weights
from .methods import TrainingMethod, count_parameters, register_training_method
from .regenerate import check_regenerated_data
from .trajectories import check_token_ids

__all__ = ["DraftHeadDistillationConfig", "DraftHeadDistillationTrainer", "DraftHeadCollator", "block_layout"]  # noqa: F822


@dataclass
class DraftHeadDistillationConfig(TrainingArguments):
    """Training arguments of draft-head distillation (:class:`DraftHeadDistillationTrainer`, recipe ``method: draft_head``).

    Every ``transformers.TrainingArguments`` field, plus the fields below (the recipe keys:
    ``docs/recipe-keys.md``). The head itself (attention kind, layers, block size, tapped layers) is
    described by the head passed to the trainer; in a recipe, by the ``head_*`` script keys.
    ``remove_unused_columns`` defaults to ``False`` and must stay so: the collator reads the data columns.

    Args:
        max_anchors: Anchors (blocks) sampled per sequence, at most (an integer >= 1); every anchor of a
            batch is trained in the same head forward.
        objective: ``"forward_kl"`` (default; JetSpec's best), ``"reverse_kl"`` or ``"sft"`` (cross-entropy on
            the regenerated tokens).
        kd_temperature: Temperature ``T`` of the KL objectives, > 0; the loss carries the ``T^2`` prefactor.
        gamma: Position-weight decay ``w_k = exp(-(k-1)/gamma)`` over the block's depths; ``None`` (default)
            weighs every depth alike (JetSpec's causal head). DFlash uses 7 for a 16-token block.
        loss_chunk_size: Drafted positions whose vocabulary-sized logits exist at once (an integer >= 1). The
            loss is computed chunk by chunk, each chunk recomputed in the backward pass, so memory stays
            bounded with a large vocabulary; the result does not depend on it.
        base_model_name_or_path: The target, written to the head's model card.

    Raises:
        ValueError: a value outside the ranges above, or ``remove_unused_columns=True``.
    """

    max_anchors: int = field(default=512, metadata={"help": "Anchors (blocks) sampled per sequence, at most."})
    objective: str = field(default="forward_kl", metadata={"help": f"Loss, one of {DISTILLATION_OBJECTIVES}."})
    kd_temperature: float = field(default=1.0, metadata={"help": "T_KD of the KL objectives (the loss carries T^2)."})
    gamma: float | None = field(default=None, metadata={"help": (
        "Position-weight decay w_k = exp(-(k-1)/gamma); None = uniform (JetSpec's causal head). DFlash uses 7.")})
    loss_chunk_size: int = field(default=4096, metadata={"help": (
        "Drafted positions whose vocabulary-sized logits are materialised at once. The loss is computed over "
        "chunks of this many positions, each recomputed in the backward pass (activation checkpointing), so "
        "memory stays bounded with a 150k vocabulary and 512 anchors x 16 positions; the result is the same.")})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "The target, for the model card."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the data columns for the collator."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.max_anchors, bool) or not isinstance(self.max_anchors, int) or self.max_anchors < 1:
            raise ValueError(f"max_anchors must be an integer >= 1, got {self.max_anchors!r}.")
        if isinstance(self.loss_chunk_size, bool) or not isinstance(self.loss_chunk_size, int) or \
                self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size must be an integer >= 1, got {self.loss_chunk_size!r}.")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0 or None, got {self.gamma}.")
        check_distillation_settings(self)


def check_distillation_settings(config) -> None:
    """The checks every drafter-distillation config shares: the objective, the KD temperature, and the data columns
    the collator needs (``remove_unused_columns`` must stay ``False``)."""
    if config.objective not in DISTILLATION_OBJECTIVES:
        raise ValueError(f"objective must be one of {DISTILLATION_OBJECTIVES}, got {config.objective!r}.")
    if config.kd_temperature <= 0:
        raise ValueError(f"kd_temperature must be > 0, got {config.kd_temperature}.")
    if config.remove_unused_columns:
        raise ValueError("remove_unused_columns must stay False: the collator needs the data columns.")


class DraftHeadCollator:
    """Pads ``input_ids`` (right), samples anchors in each response and weights their block positions.

    Rows need ``input_ids`` and ``prompt_ids`` (the response starts after the prompt), as written by
    ``hf-paralleldecode regenerate``; a row without them raises ``ValueError``. Anchors are drawn from the
    prompt's last token to the response's second-to-last, so every anchor predicts at least one token.

    Calling it on a list of rows returns a dict of tensors: ``input_ids`` / ``attention_mask`` ``[B, T]``,
    ``anchors`` ``[B, A]`` (``-1`` = none) and ``weights`` ``[B, A, block_size]`` (``w_k``; 0 past the sequence or
    for no anchor).

    Args:
        block_size: Drafted positions per anchor (the head's block size).
        max_anchors: Anchors sampled per row, at most.
        gamma: Position-weight decay (:func:`~hf_paralleldecode.training.position_weights`); ``None`` = uniform.
        pad_token_id: Id written into the padding.
        seed: Seed of the collator's own generator (anchor sampling).
    """

    def __init__(self, block_size: int, max_anchors: int = 512, gamma: float | None = None, pad_token_id: int = 0,
                 seed: int = 0):
        self.block_size, self.max_anchors, self.pad = block_size, max_anchors, pad_token_id
        self.w = position_weights(block_size, gamma)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, rows):
        ids, mask, anchors, picks = padded_rows_and_anchors(
            rows, self.pad, self.max_anchors, self.generator,
            "Draft-head training rows need `input_ids` and `prompt_ids` (from `regenerate`).")
        weights = torch.zeros(len(rows), anchors.shape[1], self.block_size)
        k = torch.arange(1, self.block_size + 1)
        for b, p in enumerate(picks):
            inside = (p[:, None] + k[None]) < int(mask[b].sum())  # the predicted token exists
            weights[b, : len(p)] = self.w[None] * inside
        return dict(input_ids=ids, attention_mask=mask, anchors=anchors, weights=weights)


def padded_rows_and_anchors(rows, pad: int, max_anchors: int, generator: torch.Generator, missing: str):
    """The drafter collators' shared part: rows right-padded (``input_ids`` / ``attention_mask`` ``[B, T]``) and up
    to ``max_anchors`` anchors drawn in each row's answer, from the prompt's last token to the one before the last
    (an anchor predicts at least one token), sorted: ``anchors`` ``[B, A]`` (``-1`` = none) and the per-row
    ``picks``. A row without ``input_ids`` or ``prompt_ids`` raises ``ValueError(missing)``."""
    for r in rows:
        if "input_ids" not in r or "prompt_ids" not in r:
            raise ValueError(missing)
    seqs = [list(r["input_ids"]) for r in rows]
    T = max(map(len, seqs))
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    picks = []
    for b, (seq, r) in enumerate(zip(seqs, rows)):
        ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[b, : len(seq)] = 1
        candidates = torch.arange(max(len(r["prompt_ids"]) - 1, 0), len(seq) - 1)
        order = torch.randperm(len(candidates), generator=generator)[:max_anchors]
        picks.append(candidates[order].sort().values)
    anchors = torch.full((len(rows), max(1, max(len(p) for p in picks))), -1, dtype=torch.long)
    for b, p in enumerate(picks):
        anchors[b, : len(p)] = p
    return ids, mask, anchors, picks


class DrafterTrainer(TrainerHooks, Trainer):
    """What the drafter trainers share: the loss is a sum of weighted positions divided by the total weight of
    the optimizer step (all micro-batches and processes, handed over as ``num_items_in_batch``), and metrics
    gathered in ``compute_loss`` are averaged into each log line."""

    loss_is_scaled_for_ga = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._metrics = defaultdict(list)

    @staticmethod
    def check_frozen_target(trainer: str, drafter: str, model, target_model, data) -> int:
        """Before ``Trainer.__init__`` of a trainer that distils ``model`` from a frozen ``target_model``: the target
        is given and is the drafter's, the data is non-empty and within its vocabulary. Returns the pad id of the
        default collator (the target's, else 0)."""
        if target_model is None:
            raise ValueError(f"{trainer} needs `target_model=` (the frozen model the {drafter} drafts for).")
        model.check_target(target_model)
        if data is not None:
            if len(data) == 0:
                raise ValueError("train_dataset is empty: regenerate the target's continuations first.")
            check_token_ids(data, target_model.get_output_embeddings().weight.shape[0], "train_dataset")
        pad = target_model.generation_config.pad_token_id
        return pad if pad is not None else 0

    def freeze_target(self, target_model) -> None:
        """After ``Trainer.__init__``: the target on the training device, frozen, lent to the drafter, with taps on
        the drafter's tapped layers (never wrapped by the accelerator: every process holds a full copy)."""
        self.target = target_model.to(self.args.device).eval().requires_grad_(False)
        drafter = self.accelerator.unwrap_model(self.model).bind(self.target)
        self._taps = HiddenStateTaps(self.target, drafter.tap_layers)

    def count_items_in_batch(self, batch_samples, device):
        if not batch_samples:
            return None
        total = sum(b["weights"].sum() for b in batch_samples).to(device)
        if self.args.world_size > 1:
            total = self.accelerator.gather(total[None]).sum()
        return total

    def _across_processes(self, loss, num_items_in_batch):
        """Under DDP the gradient all-reduce takes a mean: multiply by the processes to keep the global sum."""
        if num_items_in_batch is not None and self.args.world_size > 1:
            return loss * self.accelerator.num_processes
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update({k: round(sum(v) / len(v), 4) for k, v in self._metrics.items() if v})
        self._metrics.clear()
        super().log(logs, start_time)


class DraftHeadDistillationTrainer(DrafterTrainer):
    """Trains a :class:`~hf_paralleldecode.DraftHead` (``model``) against a frozen ``target_model``.

    JetSpec / DFlash distillation (module docstring): one no-grad forward of the target gives the teacher
    logits and the tapped hidden states; ONE head forward covers every sampled anchor's block, laid out as
    the drafter lays it out at inference; the loss is
    :func:`~hf_paralleldecode.training.draft_distillation_loss` over the counted positions, divided by the
    optimizer step's total weight (exact under gradient accumulation and data parallelism). Only the head
    trains; ``save_model`` writes the head, its config and its card, never the target.

    Dataset columns (``hf-paralleldecode regenerate`` /
    :func:`~hf_paralleldecode.training.regenerate`, loaded with
    :func:`~hf_paralleldecode.training.load_regenerated`): ``input_ids`` (prompt + the target's own
    continuation) and ``prompt_ids``. Token ids must fit the target's vocabulary; an empty dataset is
    refused.

    Logged (averaged over the logging interval): ``loss`` (the weighted distillation loss: for the KL
    objectives ``T^2`` x the mean KL per drafted position, for ``"sft"`` the mean cross-entropy) and
    ``draft_agreement`` (the weighted share of drafted positions whose top-1 token equals the target's
    top-1), besides the Trainer's ``grad_norm`` and ``learning_rate``.

    Construction: as ``transformers.Trainer``, with ``model`` the head to train, ``args`` a
    :class:`DraftHeadDistillationConfig` and ``target_model`` the frozen model the head drafts for (required;
    it is moved to the training device, never wrapped by the accelerator, so every process holds a full
    copy). ``data_collator`` defaults to a :class:`DraftHeadCollator` with the head's block size and the
    config's ``max_anchors``, ``gamma`` and ``seed``.
    """

    def __init__(self, model=None, args=None, target_model=None, data_collator=None, **kwargs):
        pad = self.check_frozen_target("DraftHeadDistillationTrainer", "head", model, target_model,
                                       kwargs.get("train_dataset"))
        if data_collator is None and args is not None:
            data_collator = DraftHeadCollator(model.config.block_size, args.max_anchors, args.gamma, pad, seed=args.seed)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self.freeze_target(target_model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        head = self.accelerator.unwrap_model(model)
        c = head.config
        ids, attn, anchors, weights = (inputs[k] for k in ("input_ids", "attention_mask", "anchors", "weights"))
        device = ids.device
        with torch.no_grad():  # teacher logits stay in the target's dtype; chunks are upcast one at a time
            teacher_all = self.target(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
            feats = self._taps.features()  # [B, T, F]
        B, T = ids.shape
        slot_ids, slot_pos, intra, query = block_layout(c.attention, c.block_size, anchors.cpu(), ids.cpu(),
                                                        c.mask_token_id)
        A, S = anchors.shape[1], intra.shape[0]
        # mask [B, A*S, T + A*S]: context strictly before the block's anchor, then its own block only
        ctx = torch.arange(T)[None, None] < anchors.cpu().clamp(min=0).repeat_interleave(S, dim=1)[..., None]
        ctx &= attn.cpu().bool()[:, None, :]
        blocks = torch.block_diag(*[intra] * A)[None].expand(B, -1, -1)
        allowed = torch.cat([ctx, blocks], dim=-1).to(device)
        positions = torch.cat([torch.arange(T)[None].expand(B, -1), slot_pos], dim=1).to(device)
        hidden = model(head.embed(slot_ids.to(device)), feats, additive_mask(allowed, head.dtype), positions)
        hidden = hidden.reshape(B, A, S, -1)[:, :, query.to(device)]  # [B, A, n, H]
        # only positions that count (weight > 0) get logits: padding anchors and positions past the end do not
        k = torch.arange(c.block_size, device=device)
        teacher_pos = (anchors.clamp(min=0)[..., None] + k).clamp(max=T - 1)  # logits at a+k-1 predict a+k
        flat_pos = (teacher_pos + T * torch.arange(B, device=device)[:, None, None]).reshape(-1)
        w = weights.to(device).reshape(-1)
        live = (w > 0).nonzero().squeeze(-1)
        hidden, flat_pos, w = hidden.reshape(-1, hidden.shape[-1])[live], flat_pos[live], w[live]
        labels = ids.reshape(-1)[(flat_pos + 1).clamp(max=B * T - 1)]
        teacher_flat = teacher_all.reshape(B * T, -1)
        denom = num_items_in_batch if num_items_in_batch is not None else w.sum().clamp(min=1e-12)
        objective, temperature = self.args.objective, self.args.kd_temperature

        def chunk_loss(h, pos, lab, cw):
            student = head.logits(h)  # [m, V] float
            teacher = teacher_flat[pos].float()
            loss = draft_distillation_loss(student, teacher, cw, objective, temperature, labels=lab,
                                           num_items_in_batch=denom)
            agree = ((student.detach().argmax(-1) == teacher.argmax(-1)).float() * cw).sum()
            return loss, agree

        size = self.args.loss_chunk_size
        if len(live) <= size:
            loss, agree = chunk_loss(hidden, flat_pos, labels, w)
        else:  # bounded memory: each chunk's logits are recomputed in the backward pass, never all stored
            from torch.utils.checkpoint import checkpoint

            loss, agree = hidden.new_zeros(()), hidden.new_zeros(())
            for i in range(0, len(live), size):
                part = slice(i, i + size)
                l_i, a_i = checkpoint(chunk_loss, hidden[part], flat_pos[part], labels[part], w[part],
                                      use_reentrant=False)
                loss, agree = loss + l_i, agree + a_i
        self._metrics["draft_agreement"].append(float(agree / w.sum().clamp(min=1e-12)))
        loss = self._across_processes(loss, num_items_in_batch)
        if not return_outputs:
            return loss
        with torch.no_grad():  # the counted positions' draft logits, in (row, anchor, depth) order
            return loss, {"student": head.logits(hidden), "draft_agreement": agree.detach()}


# ---- the recipe method ``draft_head`` (hf-paralleldecode train: training/methods.py) ---------------------------
@dataclass
class DraftHeadOptions:
    """The recipe keys of a new draft head (``method: draft_head``)."""

    head_attention: str = field(default="tree_causal", metadata={"help": "draft_head: 'tree_causal' or 'block_bidirectional'."})
    head_num_hidden_layers: int = field(default=1, metadata={"help": "draft_head: layers of the new head."})
    head_block_size: int = field(default=16, metadata={"help": "draft_head: drafted positions per block."})
    head_target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "draft_head: target layers to tap (default: spread through the depth).")})
    head_mask_token_id: int | None = field(default=None, metadata={"help": (
        "draft_head: the MASK token id of a new head (default: the last row of the target's embedding).")})
    init_head: str | None = field(default=None, metadata={"help": "draft_head: start from this saved head instead."})


def _new_head(model, script, args) -> DraftHead:
    mask = {} if script.head_mask_token_id is None else {"mask_token_id": script.head_mask_token_id}
    return DraftHead.for_target(model, attention=script.head_attention, num_hidden_layers=script.head_num_hidden_layers,
                                block_size=script.head_block_size, target_layer_ids=script.head_target_layer_ids,
                                target_name_or_path=args.base_model_name_or_path, **mask)


def _build(model, tokenizer, script, args):
    from .regenerate import load_regenerated

    dataset = load_regenerated(script.trajectories, tokenizer=tokenizer)
    if script.init_head:
        head = DraftHead.from_pretrained(script.init_head, use_safetensors=True)
    else:
        head = _new_head(model, script, args)
    return DraftHeadDistillationTrainer(model=head.train(), args=args, target_model=model, train_dataset=dataset)


def _dry_run(target, script, args):
    head = _new_head(target, script, args)
    trainable = count_parameters(head)
    c = head.config
    return dict(trains="the draft head only (the target is frozen and never saved)",
                head=dict(attention=c.attention, num_hidden_layers=c.num_hidden_layers, block_size=c.block_size,
                          target_layer_ids=list(c.target_layer_ids), mask_token_id=c.mask_token_id,
                          parameters=trainable),
                objective=args.objective, kd_temperature=args.kd_temperature, gamma=args.gamma,
                max_anchors=args.max_anchors), trainable


register_training_method(TrainingMethod("draft_head", DraftHeadDistillationConfig, DraftHeadDistillationTrainer,
                                        _build, _dry_run, DraftHeadOptions, check_regenerated_data))
