"""Diffusion-to-AR alignment of a DEER drafter in trl style: ``DiffusionAlignmentConfig`` / ``DiffusionAlignmentTrainer``.

Stages (DEER's two alignment stages and a pretraining stage; ``stage=`` in the config)
    * ``stage=1``, AR-style continuation distillation: a row is a prompt plus the AR target's own
      answer (``hf-paralleldecode regenerate``). The answer is truncated at a random point, the
      drafter's boundary token (if it has one) is appended, and the next ``suffix_length`` tokens
      are masked; the drafter learns to reconstruct the masked continuation (uniform weights).
    * ``stage=2``, prefix-conditioned refinement: only the ``refine_length`` (R) tokens after the
      truncation point are masked, weighted ``w_i = exp(-(i - 1) / gamma)`` so the tokens right
      after the prefix, where verification starts, count most.
    * ``stage=0``, masked-diffusion pretraining (not a DEER stage: how a drafter is made from text
      when no pretrained diffusion LM fits the target's tokenizer): blocks of ``block_size`` tokens
      after a random point, each token masked with probability ``t ~ U(0, 1)`` (at least one), the
      loss on the masked tokens. Text rows need no regeneration (``prompt_ids`` may be empty).

Layout (the same conventions the drafter drafts with, ``drafters/diffusion.py``)
    Each truncation point ``a`` (the *anchor*, the last visible token) gets a block
    ``[boundary?] + L slots`` at positions ``a + 1 ..``; depth ``d`` is read from the slot
    :meth:`~hf_paralleldecode.DiffusionDrafter.query_index` names (``shifted`` or not).
    * ``block_causal`` drafters: ONE forward per batch covers every anchor of every row: the clean
      sequence attends causally, and each block sees the clean tokens up to its anchor and its own
      slots, bidirectionally (block diffusion). Up to ``max_anchors`` anchors per row.
    * ``bidirectional`` drafters: every anchor is its own sequence ``x_0..x_a + block`` (its prefix
      sees the block), so each anchor costs one sequence of the forward.
    A test checks that the training forward gives the drafter's inference logits.

Loss: :func:`~hf_paralleldecode.training.losses.diffusion_alignment_loss` -- weighted cross-entropy
on the masked tokens (``objective="sft"``, the default: the answers are the AR model's own) or a KL
to the target's distributions (``"forward_kl"`` / ``"reverse_kl"``, with ``target_model=``), divided
by the total weight of the optimizer step over all micro-batches and processes (exact under
gradient accumulation). Only the drafter trains; ``save_model`` writes the drafter folder
(:meth:`~hf_paralleldecode.DiffusionDrafter.save_pretrained`) and its model card.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from ..engine.cache import additive_mask
from .draft_head import DrafterTrainer, check_distillation_settings, padded_rows_and_anchors
from .losses import DISTILLATION_OBJECTIVES, diffusion_alignment_loss, position_weights
from .methods import TrainingMethod, count_parameters, register_training_method
from .regenerate import check_regenerated_data
from .trajectories import check_token_ids

__all__ = ["DiffusionAlignmentConfig", "DiffusionAlignmentTrainer", "DiffusionAlignmentCollator", "STAGES"]

STAGES = (0, 1, 2)


@dataclass
class DiffusionAlignmentConfig(TrainingArguments):
    """Training arguments of DEER diffusion-to-AR alignment (:class:`DiffusionAlignmentTrainer`, recipe ``method: deer``).

    Every ``transformers.TrainingArguments`` field, plus the fields below (the recipe keys:
    ``docs/recipe-keys.md``). The drafter itself (layers, block size, attention, boundary token) is the
    one passed to the trainer; in a recipe, the ``drafter_*`` / ``init_drafter`` script keys.
    ``remove_unused_columns`` defaults to ``False`` and must stay so: the collator reads the data columns.

    Args:
        stage: ``1`` (default): AR-style continuation distillation, the masked continuation after a random
            truncation point, uniform weights. ``2``: prefix-conditioned refinement, only the ``R`` tokens after
            the prefix, weights ``exp(-(i-1)/gamma)``. ``0``: masked-diffusion pretraining on text.
        max_anchors: Truncation points (blocks) sampled per row, at most. A ``block_causal`` drafter trains all
            of them in one forward; a ``bidirectional`` one runs one sequence per anchor.
        suffix_length: Stage 1: masked tokens after the truncation point (default: 2 x the drafter's block
            size); stage 0: the block length (default: the block size).
        refine_length: Stage 2: ``R``, masked tokens after the prefix (default: the drafter's block size).
        span_lengths: Masked slots per block, drawn per batch from this list (overrides ``suffix_length`` /
            ``refine_length``), so one drafter serves several draft depths at inference.
        gamma: Stage 2's weight decay (default: block size / 4); stages 0 and 1 weigh uniformly.
        objective: ``"sft"`` (default): cross-entropy on the masked tokens (the target's own answers);
            ``"forward_kl"`` / ``"reverse_kl"``: distil the target's distributions (the trainer then needs
            ``target_model=``).
        kd_temperature: Temperature ``T`` of the KL objectives, > 0; the loss carries ``T^2``.
        base_model_name_or_path: The target, recorded in the saved drafter's config when it names none.

    Raises:
        ValueError: a value outside the ranges above, or ``remove_unused_columns=True``.
    """

    stage: int = field(default=1, metadata={"help": (
        "1: AR-style continuation distillation (mask the continuation); 2: prefix-conditioned refinement (mask "
        "the R tokens after the prefix, decaying weights); 0: masked-diffusion pretraining on text.")})
    max_anchors: int = field(default=16, metadata={"help": (
        "Truncation points (blocks) sampled per row. block_causal drafters train all of them in one forward; "
        "bidirectional drafters run one sequence per anchor.")})
    suffix_length: int | None = field(default=None, metadata={"help": (
        "Stage 1: masked continuation tokens after the truncation point (default: 2 x the drafter's block_size).")})
    refine_length: int | None = field(default=None, metadata={"help": (
        "Stage 2: R, masked tokens after the prefix (default: the drafter's block_size).")})
    span_lengths: list[int] | None = field(default=None, metadata={"help": (
        "Masked slots per block drawn per batch from this list (overrides suffix_length / refine_length / "
        "block_size): one drafter then serves several block sizes (tree_depth) at inference.")})
    gamma: float | None = field(default=None, metadata={"help": (
        "Stage 2: decay of w_i = exp(-(i-1)/gamma) (default: block_size / 4). Stages 0 and 1 weigh uniformly.")})
    objective: str = field(default="sft", metadata={"help": (
        f"Loss, one of {DISTILLATION_OBJECTIVES}: 'sft' = cross-entropy on the (regenerated) tokens; the KL "
        "objectives distil the target's distributions and need target_model=.")})
    kd_temperature: float = field(default=1.0, metadata={"help": "T_KD of the KL objectives (the loss carries T^2)."})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "The target, for the model card."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the data columns for the collator."})

    def __post_init__(self):
        super().__post_init__()
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES} (1 and 2 are DEER's alignment stages), got {self.stage!r}.")
        for name in ("max_anchors", "suffix_length", "refine_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.span_lengths is not None:
            if not self.span_lengths or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                            for v in self.span_lengths):
                raise ValueError(f"span_lengths must be a non-empty list of integers >= 1, got {self.span_lengths!r}.")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}.")
        check_distillation_settings(self)


def stage_span(stage: int, block_size: int, suffix_length: int | None = None, refine_length: int | None = None,
               gamma: float | None = None) -> tuple[int, torch.Tensor]:
    """``(L, w)``: masked slots per block and their weights ``[L]`` for a stage (module docstring)."""
    if stage == 1:
        length = suffix_length or 2 * block_size
        return length, torch.ones(length)
    if stage == 2:
        length = refine_length or block_size
        return length, position_weights(length, gamma if gamma is not None else block_size / 4)
    length = suffix_length or block_size  # stage 0: a block (span_lengths may set it)
    return length, torch.ones(length)


class DiffusionAlignmentCollator:
    """Pads rows (right), samples anchors in each answer and builds their blocks.

    Rows need ``input_ids`` and ``prompt_ids`` (the answer starts after the prompt; empty for text), as
    written by ``hf-paralleldecode regenerate``; a row without them raises ``ValueError``. With several
    ``span_lengths`` one span is drawn per batch.

    Calling it on a list of rows returns a dict of tensors: ``input_ids`` / ``attention_mask`` ``[B, T]``,
    ``anchors`` ``[B, A]`` (``-1`` = none), ``block`` ``[B, A, Lb]`` (the block's input ids: boundary, masks, and
    in stage 0 the unmasked tokens), ``labels`` / ``weights`` ``[B, A, L]`` for depths ``1..L`` (weight 0: past the
    end, not masked, or no anchor).

    Args:
        drafter_config (DiffusionDrafterConfig): The drafter's config (block size, mask and boundary token ids).
        stage: ``0``, ``1`` or ``2`` (:class:`DiffusionAlignmentConfig`).
        max_anchors: Truncation points sampled per row, at most.
        suffix_length: Stage 1 (and 0) span; default from the drafter's block size.
        refine_length: Stage 2 span ``R``; default: the drafter's block size.
        gamma: Stage 2 weight decay; default: block size / 4.
        pad_token_id: Id written into the padding.
        seed: Seed of the collator's own generator (anchors, spans, stage-0 masking).
        span_lengths: Spans to draw from, one per batch (overrides ``suffix_length`` / ``refine_length``).
    """

    def __init__(self, drafter_config, stage: int, max_anchors: int = 16, suffix_length: int | None = None,
                 refine_length: int | None = None, gamma: float | None = None, pad_token_id: int = 0, seed: int = 0,
                 span_lengths: list[int] | None = None):
        self.c, self.stage, self.max_anchors, self.pad = drafter_config, stage, max_anchors, pad_token_id
        self.spans = [stage_span(stage, drafter_config.block_size, n, n, gamma) for n in span_lengths] \
            if span_lengths else [stage_span(stage, drafter_config.block_size, suffix_length, refine_length, gamma)]
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, rows):
        c = self.c
        pick = int(torch.randint(len(self.spans), (1,), generator=self.generator)) if len(self.spans) > 1 else 0
        L, span_w = self.spans[pick]
        ids, mask, anchors, picks = padded_rows_and_anchors(
            rows, self.pad, self.max_anchors, self.generator,
            "Diffusion alignment rows need `input_ids` and `prompt_ids` (from `regenerate`; prompt_ids=[] for plain "
            "text).")
        T, A = ids.shape[1], anchors.shape[1]
        boundary = [c.boundary_token_id] if c.boundary_token_id is not None else []
        block = torch.full((len(rows), A, len(boundary) + L), c.mask_token_id, dtype=torch.long)
        if boundary:
            block[..., 0] = boundary[0]
        labels = torch.zeros(len(rows), A, L, dtype=torch.long)
        weights = torch.zeros(len(rows), A, L)
        d = torch.arange(1, L + 1)
        for b, p in enumerate(picks):
            n = len(p)
            target_pos = p[:, None] + d[None]  # [n, L]
            inside = target_pos < int(mask[b].sum())
            labels[b, :n] = ids[b].gather(0, target_pos.clamp(max=T - 1).reshape(-1)).reshape(n, L) * inside
            w = span_w[None].expand(n, L) * inside
            if self.stage == 0:  # masking rate t ~ U(0, 1) per block, at least one masked token
                t = torch.rand(n, 1, generator=self.generator)
                masked = torch.rand(n, L, generator=self.generator) < t
                masked[torch.arange(n), torch.randint(0, L, (n,), generator=self.generator)] = True
                block[b, :n, len(boundary):] = torch.where(masked | ~inside, c.mask_token_id, labels[b, :n])
                w = w * masked
            weights[b, :n] = w
        return dict(input_ids=ids, attention_mask=mask, anchors=anchors, block=block, labels=labels, weights=weights)


def alignment_logits(drafter, input_ids, attention_mask, anchors, block, vocab: int, call=None) -> torch.Tensor:
    """Draft logits ``[B, A, L, vocab]`` of every anchor's block, laid out as the drafter drafts.

    ``L`` = the block's mask slots. One forward for a ``block_causal`` drafter (module docstring),
    one sequence per anchor for a ``bidirectional`` one. ``call``: what runs the forward (the
    accelerator-wrapped drafter in training; default ``drafter``).
    """
    c = drafter.config
    call = call or drafter
    B, T = input_ids.shape
    A, Lb = anchors.shape[1], block.shape[-1]
    L = Lb - (c.boundary_token_id is not None)
    device = input_ids.device
    query = drafter.query_index(L).to(device)  # [L] into [anchor] + block: the drafter's own convention
    a = anchors.clamp(min=0)
    if c.attention == "block_causal":
        slot = torch.arange(Lb, device=device)
        positions = torch.cat([torch.arange(T, device=device)[None].expand(B, T),
                               (a[..., None] + 1 + slot).reshape(B, A * Lb)], dim=1)
        valid = attention_mask.bool()
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=device)
        stream = torch.cat([(causal & valid[:, None, :]) | eye, torch.zeros(B, T, A * Lb, dtype=torch.bool,
                                                                             device=device)], dim=-1)
        sees_prefix = (torch.arange(T, device=device)[None, None] <= a[..., None]) & valid[:, None, :]  # [B, A, T]
        own = torch.block_diag(*[torch.ones(Lb, Lb, dtype=torch.bool, device=device)] * A)
        blocks = torch.cat([sees_prefix.repeat_interleave(Lb, dim=1), own[None].expand(B, -1, -1)], dim=-1)
        allowed = torch.cat([stream, blocks], dim=1)  # [B, T + A*Lb, T + A*Lb]
        logits = call(input_ids=torch.cat([input_ids, block.reshape(B, A * Lb)], dim=1),
                         attention_mask=additive_mask(allowed, drafter.dtype), position_ids=positions)
        # [anchor] + block -> indices into the forward's slots
        at = torch.cat([a[..., None], (T + (torch.arange(A, device=device) * Lb)[:, None] + slot)[None].expand(B, -1, -1)],
                       dim=-1)
        picked = at[..., query]  # [B, A, L]
        out = logits.gather(1, picked.reshape(B, A * L)[..., None].expand(-1, -1, logits.shape[-1]))
        return out.reshape(B, A, L, -1)[..., :vocab]
    # bidirectional: one sequence per anchor, x_0..x_a + block, right-padded
    width = int(a.max()) + 1 + Lb
    cols = torch.arange(width, device=device)
    seq = torch.full((B, A, width), c.mask_token_id, dtype=torch.long, device=device)
    prefix = cols[None, None] <= a[..., None]
    seq = torch.where(prefix, input_ids.gather(1, cols.clamp(max=T - 1)[None].expand(B, -1))[:, None], seq)
    seq.scatter_(2, a[..., None] + 1 + torch.arange(Lb, device=device), block)
    attention = (cols[None, None] < (a + 1 + Lb)[..., None]).long()
    logits = call(input_ids=seq.reshape(B * A, width), attention_mask=attention.reshape(B * A, width))
    picked = (a[..., None] + query).reshape(B * A, L)  # [anchor] index 0 is position a
    out = logits.gather(1, picked[..., None].expand(-1, -1, logits.shape[-1]))
    return out.reshape(B, A, L, -1)[..., :vocab]


class DiffusionAlignmentTrainer(DrafterTrainer):
    """Trains a :class:`~hf_paralleldecode.DiffusionDrafter` (``model``); ``target_model`` only for KL objectives.

    DEER's diffusion-to-AR alignment (module docstring): every sampled truncation point gets a masked
    block laid out as the drafter drafts; the loss is
    :func:`~hf_paralleldecode.training.diffusion_alignment_loss` on the masked tokens, divided by the
    optimizer step's total weight (exact under gradient accumulation and data parallelism). Only the
    drafter trains; ``save_model`` writes the drafter folder
    (:meth:`~hf_paralleldecode.DiffusionDrafter.save_pretrained`), never the target.

    Dataset columns (``hf-paralleldecode regenerate``, loaded with
    :func:`~hf_paralleldecode.training.load_regenerated`): ``input_ids`` (prompt + the target's own
    answer) and ``prompt_ids`` (may be empty for stage 0 on plain text). Token ids must fit the
    vocabulary; an empty dataset is refused.

    Logged (averaged over the logging interval): ``loss`` (the weighted loss over the masked tokens),
    ``masked_accuracy`` (the weighted share of masked tokens whose top-1 prediction is the label) and
    ``first_token_accuracy`` (the share of blocks whose first masked token is predicted right: the
    position verification checks first), besides the Trainer's ``grad_norm`` and ``learning_rate``.

    Construction: as ``transformers.Trainer``, with ``model`` a ``DiffusionDrafter``, ``args`` a
    :class:`DiffusionAlignmentConfig` and ``target_model`` the frozen target (required by the KL
    objectives, optional with ``"sft"``; when given, the drafter is checked against it). ``data_collator``
    defaults to a :class:`DiffusionAlignmentCollator` built from the drafter's config and the config's
    stage, spans, ``max_anchors``, ``gamma`` and ``seed``.
    """

    def __init__(self, model=None, args=None, target_model=None, data_collator=None, **kwargs):
        from ..drafters.diffusion import DiffusionDrafter, target_vocab_size

        if not isinstance(model, DiffusionDrafter):
            raise ValueError(f"DiffusionAlignmentTrainer trains a hf_paralleldecode.DiffusionDrafter, got "
                             f"{type(model).__name__}.")
        if args is not None and args.objective != "sft" and target_model is None:
            raise ValueError(f"objective={args.objective!r} distils the target's distributions: pass target_model=, "
                             "or use objective='sft'.")
        if target_model is not None:
            model.check_target(target_model)
        self.vocab = target_vocab_size(target_model) if target_model is not None else \
            (model.config.target_vocab_size or model.vocab_size)
        data = kwargs.get("train_dataset")
        if data is not None:
            if len(data) == 0:
                raise ValueError("train_dataset is empty: regenerate the target's answers first.")
            check_token_ids(data, self.vocab, "train_dataset")
        if data_collator is None and args is not None:
            pad = target_model.generation_config.pad_token_id if target_model is not None else None
            data_collator = DiffusionAlignmentCollator(model.config, args.stage, args.max_anchors, args.suffix_length,
                                                       args.refine_length, args.gamma,
                                                       pad if pad is not None else 0, seed=args.seed,
                                                       span_lengths=args.span_lengths)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self.target = target_model.to(self.args.device).eval().requires_grad_(False) if target_model is not None \
            else None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter = self.accelerator.unwrap_model(model)
        ids, attn, anchors, block = (inputs[k] for k in ("input_ids", "attention_mask", "anchors", "block"))
        labels, weights = inputs["labels"], inputs["weights"]
        logits = alignment_logits(drafter, ids, attn, anchors, block, self.vocab, call=model)
        B, A, L = labels.shape
        teacher = None
        if self.target is not None and self.args.objective != "sft":
            with torch.no_grad():
                teacher_all = self.target(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
            pos = (anchors.clamp(min=0)[..., None] + torch.arange(L, device=ids.device)).clamp(max=ids.shape[1] - 1)
            teacher = teacher_all.gather(1, pos.reshape(B, A * L)[..., None].expand(-1, -1, teacher_all.shape[-1]))
            teacher = teacher.reshape(B, A, L, -1)[..., : self.vocab].float()
        loss = diffusion_alignment_loss(logits, labels, weights, teacher, self.args.objective, self.args.kd_temperature,
                                        num_items_in_batch)
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels).float()
            w = weights.float()
            self._metrics["masked_accuracy"].append(float((hit * w).sum() / w.sum().clamp(min=1e-12)))
            first = w[..., 0] > 0
            if bool(first.any()):
                self._metrics["first_token_accuracy"].append(float(hit[..., 0][first].mean()))
        loss = self._across_processes(loss, num_items_in_batch)
        return (loss, {"logits": logits}) if return_outputs else loss

    def save_model_files(self, output_dir: str | None = None, state_dict=None):
        output_dir = output_dir or self.args.output_dir
        drafter = self.accelerator.unwrap_model(self.model)
        if self.args.base_model_name_or_path and not drafter.config.target_name_or_path:
            drafter.config.target_name_or_path = self.args.base_model_name_or_path
        drafter.save_pretrained(output_dir)
        torch.save(self.args, f"{output_dir}/training_args.bin")

    def load_model_files(self, resume_from_checkpoint, model=None):
        from safetensors.torch import load_file

        drafter = self.accelerator.unwrap_model(model or self.model)
        drafter.model.load_state_dict(load_file(f"{resume_from_checkpoint}/model.safetensors"), strict=False)


# ---- the recipe method ``deer`` (hf-paralleldecode train: training/methods.py) ----------------------------------
@dataclass
class DiffusionDrafterOptions:
    """The recipe keys of a new diffusion drafter (``method: deer``)."""

    drafter_attention: str = field(default="block_causal", metadata={"help": (
        "deer: a new drafter's attention, 'block_causal' (prefix KV cache) or 'bidirectional'.")})
    drafter_num_hidden_layers: int = field(default=2, metadata={"help": "deer: layers of a new drafter."})
    drafter_block_size: int = field(default=16, metadata={"help": "deer: masked positions a new drafter drafts."})
    drafter_shifted: bool = field(default=False, metadata={"help": "deer: position i predicts token i+1 (Dream)."})
    drafter_boundary_token: bool = field(default=False, metadata={"help": (
        "deer: a new [SEP] row placed between the prefix and the masks (DEER stage I).")})
    drafter_init_from_target: bool = field(default=False, metadata={"help": (
        "deer: copy the target's first layers, embeddings and LM head into the new drafter (block_causal).")})
    init_drafter: str | None = field(default=None, metadata={"help": (
        "deer: start from this saved DiffusionDrafter (e.g. stage 1's output for stage 2, or a converted dLLM).")})


def _new_drafter(model, script, tokenizer=None):
    from ..drafters.diffusion import DiffusionDrafter

    return DiffusionDrafter.for_target(
        model, num_hidden_layers=script.drafter_num_hidden_layers, block_size=script.drafter_block_size,
        attention=script.drafter_attention, shifted=script.drafter_shifted,
        boundary_token=script.drafter_boundary_token, init_from_target=script.drafter_init_from_target,
        tokenizer=tokenizer)


def _build(model, tokenizer, script, args):
    from ..drafters.diffusion import DiffusionDrafter
    from .regenerate import load_regenerated

    dataset = load_regenerated(script.trajectories, tokenizer=tokenizer)
    drafter = DiffusionDrafter.from_pretrained(script.init_drafter) if script.init_drafter else \
        _new_drafter(model, script, tokenizer)
    drafter.check_target(model, tokenizer=tokenizer)
    target = model if args.objective != "sft" else None  # cross-entropy needs no teacher forward
    return DiffusionAlignmentTrainer(model=drafter.train(), args=args, target_model=target, train_dataset=dataset)


def _dry_run(target, script, args):
    from pathlib import Path

    if script.init_drafter:  # a saved drafter (often the previous stage's output, not there yet)
        trainable, spec = None, dict(init_drafter=script.init_drafter,
                                     exists=Path(script.init_drafter, "diffusion_drafter.json").is_file())
    else:
        with torch.device("meta"):  # sizes only: no memory for a large vocabulary
            drafter = _new_drafter(target, script)
        trainable = count_parameters(drafter)
        spec = dict(drafter.config.to_dict(), num_hidden_layers=script.drafter_num_hidden_layers,
                    init_from_target=script.drafter_init_from_target, parameters=trainable)
    return dict(trains="the diffusion drafter only (the target is never updated or saved)", drafter=spec,
                stage=args.stage, objective=args.objective, max_anchors=args.max_anchors,
                span_lengths=args.span_lengths), trainable


register_training_method(TrainingMethod("deer", DiffusionAlignmentConfig, DiffusionAlignmentTrainer, _build, _dry_run,
                                        DiffusionDrafterOptions, check_regenerated_data))
