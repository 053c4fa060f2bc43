"""Trainers in trl style: a config (``TrainingArguments`` subclass, help on every field) and a trainer
that overrides ``compute_loss`` only, per method.

* :class:`ConsistencyConfig` / :class:`ConsistencyTrainer`: CLLM, global or local consistency +
  ``ar_weight`` x AR loss, data from :class:`~hf_paralleldecode.training.collators.ConsistencyCollator`.
* :class:`ProgressiveConsistencyConfig` / :class:`ProgressiveConsistencyTrainer`: Jacobi Forcing,
  ``L_pc + ar_weight * L_AR`` from ONE forward over packed noisy/clean blocks.

Saving writes the model, a ``ParallelDecodingConfig`` with the matching decoding settings (so
:func:`hf_paralleldecode.load_model` decodes the checkpoint with the right strategy out of the box)
and a model card naming the base model, the method and its citation.

Loss scaling (gradient-accumulation exact): each term (consistency, AR) is a sum over its counted
positions divided by that term's count over the whole optimizer step, i.e. every micro-batch of the
accumulation and every process. The Trainer hands those counts to ``compute_loss`` as
``num_items_in_batch`` (a ``[2]`` tensor here, from :meth:`count_items_in_batch`), so
``batch 4 x 1 step`` and ``batch 2 x 2 accumulated steps`` take the same optimizer step (tested).
Under DDP the loss is multiplied by the number of processes, which the gradient all-reduce's mean
divides back out. Without counts (direct calls) each term is the mean over its batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from ..compat import TrainerHooks
from ..config import ParallelDecodingConfig
from .collators import REQUIRED_COLUMNS, ConsistencyCollator, ProgressiveCollator, check_block_size
from .losses import DISTANCES, ar_loss, consistency_loss, progressive_consistency_loss
from .methods import TrainingMethod, count_parameters, register_training_method
from .packing import MASKS, SCHEDULES

__all__ = ["ConsistencyConfig", "ConsistencyTrainer", "ProgressiveConsistencyConfig", "ProgressiveConsistencyTrainer"]

AR_TARGETS = ("greedy", "base_kl")

CITATIONS = {
    "cllm": "Kou et al., CLLMs: Consistency Large Language Models, ICML 2024 (arXiv:2403.00835)",
    "jacobi_forcing": "Hu et al., Fast and Accurate Causal Parallel Decoding using Jacobi Forcing (hao-ai-lab, 2025)",
}


@dataclass
class _ParallelDecodingTrainingArguments(TrainingArguments):
    block_size: int = field(default=16, metadata={"help": "Jacobi block size n; must match the collected trajectories."})
    distance: str = field(default="forward_kl", metadata={"help": f"Consistency distance, one of {DISTANCES}."})
    beta: float = field(default=0.5, metadata={"help": "Mixing weight of the generalised JSD (distance='jsd'), in (0, 1)."})
    ar_weight: float = field(default=1.0, metadata={"help": "Weight (lambda / w) of the AR loss on the greedy response."})
    ar_target: str = field(default="greedy", metadata={"help": (
        "AR term: 'greedy' = cross-entropy on the base model's greedy response (CLLM, Jacobi Forcing); 'base_kl' = forward KL "
        "from a frozen copy of the starting model to the model on the same response positions, which keeps the "
        "model's distribution instead of sharpening it toward its argmax (costs a frozen copy and its forward).")})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "Provenance, written to the model card."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep trajectory columns for the collator."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2, got {self.block_size!r}.")
        if self.distance not in DISTANCES:
            raise ValueError(f"distance must be one of {DISTANCES}, got {self.distance!r}.")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {self.beta}.")
        if self.ar_weight < 0:
            raise ValueError(f"ar_weight must be >= 0, got {self.ar_weight}.")
        if self.ar_target not in AR_TARGETS:
            raise ValueError(f"ar_target must be one of {AR_TARGETS}, got {self.ar_target!r}.")
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns must stay False: the collator needs the trajectory columns.")


@dataclass
class ConsistencyConfig(_ParallelDecodingTrainingArguments):
    """Training arguments of CLLM consistency distillation (:class:`ConsistencyTrainer`, recipe ``method: cllm``).

    Every ``transformers.TrainingArguments`` field, plus the fields below (the recipe keys:
    ``docs/recipe-keys.md``). ``remove_unused_columns`` defaults to ``False`` and must stay so: the
    collator reads the trajectory columns.

    Args:
        block_size: Jacobi block size ``n`` (an integer >= 2). It must equal the block size the trajectories
            were collected with (the collator refuses other rows), and is saved as the checkpoint's
            ``jacobi`` decoding setting.
        distance: Consistency distance: ``"forward_kl"`` (teacher to student, the CLLM paper's choice),
            ``"reverse_kl"`` or ``"jsd"`` (generalised Jensen-Shannon).
        beta: Mixing weight of the generalised JSD (``distance="jsd"``), in (0, 1); 0.5 is the symmetric JSD.
        ar_weight: Weight of the AR term: the loss is ``consistency_loss + ar_weight * ar_loss``; >= 0.
        ar_target: ``"greedy"``: the AR term is cross-entropy on the base model's greedy response (the CLLM
            and Jacobi Forcing papers). ``"base_kl"``: forward KL from a frozen copy of the starting model,
            which keeps the model's distribution instead of sharpening it; costs that copy (on every
            process) and its forward.
        base_model_name_or_path: The starting model, written to the model card and the saved decoding config
            (``hf-paralleldecode train`` sets it).
        consistency: ``"global"``: the teacher is the prediction on the block's fixed point; ``"local"``: on the
            next Jacobi state of the trajectory (one more no-grad forward).

    Raises:
        ValueError: a value outside the ranges above, or ``remove_unused_columns=True``.
    """

    consistency: str = field(default="global", metadata={"help": "CLLM consistency: 'global' (to the fixed point) or 'local' (to the next state)."})

    def __post_init__(self):
        super().__post_init__()
        if self.consistency not in ("global", "local"):
            raise ValueError(f"consistency must be 'global' or 'local', got {self.consistency!r}.")


@dataclass
class ProgressiveConsistencyConfig(_ParallelDecodingTrainingArguments):
    """Training arguments of Jacobi Forcing (:class:`ProgressiveConsistencyTrainer`, recipe ``method: jacobi_forcing``).

    Every ``transformers.TrainingArguments`` field, plus the fields below (the recipe keys:
    ``docs/recipe-keys.md``). ``remove_unused_columns`` defaults to ``False`` and must stay so: the
    collator reads the trajectory columns. The last four fields do not change training: they are the
    ``jacobi_forcing`` decoding settings written with the checkpoint.

    Args:
        block_size: Jacobi block size ``n`` (an integer >= 2); must equal the block size the trajectories
            were collected with. Saved as a decoding setting.
        distance: Distance of the progressive consistency term: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: Mixing weight of the generalised JSD (``distance="jsd"``), in (0, 1).
        ar_weight: Weight ``lambda`` of the AR term: the loss is ``pc_loss + ar_weight * ar_loss``; >= 0.
        ar_target: ``"greedy"``: cross-entropy on the clean blocks (the base model's greedy response; the
            paper's choice). ``"base_kl"``: forward KL from a frozen copy of the starting model at the same
            positions (one more copy of the model and one more forward per step).
        base_model_name_or_path: The starting model, written to the model card and the saved decoding config.
        noise_schedule: How target noise ratios are assigned to a row's blocks: ``"linear"`` (progressive,
            the paper's best), ``"reverse"`` or ``"random"``.
        noise_window: Window ``w`` of the schedule: block ``i`` gets ``t_i = W[i mod w]``; >= 1.
        mask: Attention mask of the packed sequence: ``"noise_conditioned"`` (Jacobi Forcing) or ``"cllm"``
            (noisy tokens see the clean earlier blocks).
        num_blocks: Decoding setting saved with the model: ``K`` blocks in flight.
        pool_size: Decoding setting saved with the model: recycled n-gram candidates per step.
        context_matches: Decoding setting saved with the model: context n-gram continuations merged into each
            step's tree.
        context_tokens: Decoding setting saved with the model: tokens of each context continuation.

    Raises:
        ValueError: a value outside the ranges above, or ``remove_unused_columns=True``.
    """

    noise_schedule: str = field(default="linear", metadata={"help": f"Noise schedule across blocks, one of {SCHEDULES}."})
    noise_window: int = field(default=4, metadata={"help": "Window w of the schedule: t_i = W[i mod w]."})
    mask: str = field(default="noise_conditioned", metadata={"help": f"Attention mask variant, one of {MASKS}."})
    num_blocks: int = field(default=2, metadata={"help": "Decoding setting saved with the model: K blocks in flight."})
    pool_size: int = field(default=4, metadata={"help": "Decoding setting saved with the model: recycled candidates."})
    context_matches: int = field(default=0, metadata={"help": "Decoding setting saved with the model: context n-gram "
                                                              "continuations merged into each step's tree."})
    context_tokens: int = field(default=10, metadata={"help": "Decoding setting saved with the model: tokens of each "
                                                             "context continuation."})

    def __post_init__(self):
        super().__post_init__()
        if self.noise_schedule not in SCHEDULES:
            raise ValueError(f"noise_schedule must be one of {SCHEDULES}, got {self.noise_schedule!r}.")
        if self.noise_window < 1:
            raise ValueError(f"noise_window must be >= 1, got {self.noise_window}.")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}.")


class _ParallelDecodingTrainer(TrainerHooks, Trainer):
    loss_is_scaled_for_ga = True  # compute_loss divides by the step's counts (see the module docstring)
    method: str = ""

    def __init__(self, *args, data_collator=None, **kwargs):
        config = kwargs.get("args") or (args[1] if len(args) > 1 else None)
        if data_collator is None and config is not None:
            data_collator = self._default_collator(config)
        super().__init__(*args, data_collator=data_collator, **kwargs)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.ref_model = None  # ar_target='base_kl': a frozen copy of the starting model (on every process)
        if self.args.ar_target == "base_kl":
            import copy

            self.ref_model = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval().requires_grad_(False)

    def _default_collator(self, config):  # pragma: no cover - per subclass
        raise NotImplementedError

    def _ar_term(self, logits, labels, n_ar, **ref_inputs):
        """AR term on ``logits`` aligned with next-token ``labels`` (``-100`` = not counted)."""
        if self.ref_model is None:
            return ar_loss(logits, labels, num_items_in_batch=n_ar)
        with torch.no_grad():
            ref = self.ref_model(**ref_inputs).logits[:, : logits.shape[1]]
        return consistency_loss(logits, ref, labels != -100, "forward_kl", num_items_in_batch=n_ar)

    def _term_counts(self, inputs) -> torch.Tensor:  # pragma: no cover - per subclass
        """Counted positions of ``[consistency term, AR term]`` in one collated batch."""
        raise NotImplementedError

    def count_items_in_batch(self, batch_samples, device):
        if not batch_samples:
            return None
        counts = sum(self._term_counts(b).to(device) for b in batch_samples)
        if self.args.world_size > 1:
            counts = self.accelerator.gather(counts[None]).sum(0)
        return counts

    def _combine(self, inputs, terms: dict, num_items_in_batch):
        """Total loss from ``{consistency term: value, "ar_loss": value}`` (the order of :meth:`_term_counts`);
        records each term's micro-batch mean for logging (averaged over the logging interval, as trl does)."""
        mode = "train" if self.model.training else "eval"
        scale = (torch.ones(2) if num_items_in_batch is None
                 else num_items_in_batch.detach().float().cpu() / self._term_counts(inputs).clamp(min=1).float().cpu())
        for (name, value), factor in zip(terms.items(), scale.tolist()):
            self._metrics[mode][name].append(float(value.detach()) * factor)
        loss_c, loss_ar = terms.values()
        loss = loss_c + self.args.ar_weight * loss_ar
        if num_items_in_batch is not None and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes  # the DDP gradient mean divides it back out
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "" if mode == "train" else "eval_"
        logs.update({prefix + k: round(sum(v) / len(v), 4) for k, v in self._metrics[mode].items() if v})
        self._metrics[mode].clear()
        super().log(logs, start_time)

    @staticmethod
    def _split(num_items_in_batch):
        if num_items_in_batch is None:
            return None, None
        return num_items_in_batch[0].clamp(min=1), num_items_in_batch[1].clamp(min=1)

    def _decoding_config(self) -> ParallelDecodingConfig:  # pragma: no cover - per subclass
        raise NotImplementedError

    def _saved_decoding_config(self) -> ParallelDecodingConfig:
        config = self._decoding_config()
        config.base_model_name_or_path = self.args.base_model_name_or_path
        return config

    def save_model_files(self, output_dir=None, state_dict=None):
        super().save_model_files(output_dir, state_dict)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            config = self._saved_decoding_config()
            config.save_pretrained(output_dir)
            self._write_card(output_dir, config)

    def _write_card(self, output_dir, config, model_name=None, tags=()):
        from pathlib import Path

        tags = ["hf_paralleldecode", self.method] + [t for t in tags if t not in ("hf_paralleldecode", self.method)]
        tag_lines = "".join(f"- {t}\n" for t in tags)
        title = model_name or f"{self.method} model"
        card = (f"---\nlibrary_name: hf_paralleldecode\ntags:\n{tag_lines}---\n\n"
                f"# {title}\n\nBase model: `{self.args.base_model_name_or_path}`\n\n"
                f"Trained with hf_paralleldecode's `{type(self).__name__}`; decode with\n\n"
                f"```python\nimport hf_paralleldecode as hfpd\nmodel = hfpd.load_model(path)  # "
                f"decoding={config.decoding!r}, {config.settings}\n```\n\nCitation: {CITATIONS[self.method]}\n")
        Path(output_dir, "README.md").write_text(card)

    def create_model_card(self, model_name=None, tags=None, **kwargs):
        """The method's card (base model, decoding settings, citation); ``Trainer.push_to_hub`` calls this
        after saving, and the stock card would replace it."""
        if not self.is_world_process_zero():
            return
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        self._write_card(self.args.output_dir, self._saved_decoding_config(), model_name, tags)


class ConsistencyTrainer(_ParallelDecodingTrainer):
    """CLLM consistency distillation: trains the whole model to map a noisy Jacobi state to its fixed point.

    Kou et al., *CLLMs: Consistency Large Language Models*, ICML 2024. Per row,
    :class:`~hf_paralleldecode.training.ConsistencyCollator` picks one complete block and one state of its
    Jacobi trajectory. Each step runs ``model`` on the student sequence (prompt, the earlier blocks'
    fixed points, the noisy state) and on the clean ``prompt + response``; in global consistency the
    clean forward's detached logits over the block are the teacher, in local consistency a third,
    no-grad forward on the next state is. The loss is ``consistency_loss + ar_weight * ar_loss``, each
    term normalised by its count over the whole optimizer step (exact under gradient accumulation and
    data parallelism).

    Dataset columns (``hf-paralleldecode collect``, or
    :func:`~hf_paralleldecode.training.collect_trajectories`; load a collection with
    :func:`~hf_paralleldecode.training.load_trajectories`): ``prompt_ids``, ``response_ids``,
    ``trajectories`` (per block, the list of Jacobi states) and ``fixed_points`` (per block, its converged
    ``n`` tokens). A row needs at least one complete block.

    Logged (each averaged over the logging interval; ``eval_`` prefix in evaluation): ``loss`` (the total
    above), ``consistency_loss`` (mean divergence per counted block position: positions past the prefix the
    noisy state already shares with the teacher's) and ``ar_loss`` (mean cross-entropy per response token;
    with ``ar_target="base_kl"``, the mean KL to the frozen starting model), besides the Trainer's
    ``grad_norm`` and ``learning_rate``.

    Saving writes the model, ``parallel_decoding_config.json`` (``decoding="jacobi"`` with ``block_size``) and a
    model card naming the base model and the citation.

    Construction: as ``transformers.Trainer``, with ``model`` the causal LM to train (every parameter trains),
    ``args`` a :class:`ConsistencyConfig` and ``train_dataset`` the trajectories; ``data_collator`` defaults to
    ``ConsistencyCollator(args.block_size, args.consistency, seed=args.seed)``.
    """

    method = "cllm"

    def _default_collator(self, config):
        return ConsistencyCollator(config.block_size, config.consistency, seed=config.seed)

    def _decoding_config(self):
        return ParallelDecodingConfig("jacobi", {"block_size": self.args.block_size})

    def _term_counts(self, inputs):
        return torch.stack([inputs["block_mask"].sum(), (inputs["labels"][:, 1:] != -100).sum()])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        n_c, n_ar = self._split(num_items_in_batch)
        n = self.args.block_size
        idx = inputs["block_start"][:, None] + torch.arange(n, device=inputs["block_start"].device)  # [batch, n]
        student = model(input_ids=inputs["student_ids"]).logits
        student = student.gather(1, idx[..., None].expand(-1, -1, student.shape[-1]))
        clean = model(input_ids=inputs["clean_ids"], attention_mask=inputs["clean_attention_mask"]).logits
        if self.args.consistency == "global":
            # the teacher sequence prefix + y* is a prefix of the clean sequence: reuse those logits
            teacher = clean.detach().gather(1, idx[..., None].expand(-1, -1, clean.shape[-1]))
        else:
            with torch.no_grad():
                teacher_all = model(input_ids=inputs["teacher_ids"]).logits
            teacher = teacher_all.gather(1, idx[..., None].expand(-1, -1, teacher_all.shape[-1]))
        loss_c = consistency_loss(student, teacher, inputs["block_mask"], self.args.distance, self.args.beta, n_c)
        loss_ar = self._ar_term(clean[:, :-1], inputs["labels"][:, 1:], n_ar, input_ids=inputs["clean_ids"],
                                attention_mask=inputs["clean_attention_mask"])
        terms = {"consistency_loss": loss_c, "ar_loss": loss_ar}
        loss = self._combine(inputs, terms, num_items_in_batch)
        return (loss, terms) if return_outputs else loss


class ProgressiveConsistencyTrainer(_ParallelDecodingTrainer):
    """Jacobi Forcing: trains the whole model to predict each block from a progressively noisier context.

    Hu et al., *Fast and Accurate Causal Parallel Decoding using Jacobi Forcing*, 2025. Per row,
    :class:`~hf_paralleldecode.training.ProgressiveCollator` gives every complete block a target noise
    ratio from the schedule, takes the trajectory state nearest it as the block's noisy version, and packs
    ``[prompt][noisy_0][clean_0][noisy_1][clean_1]...`` with shared position ids and the configured mask.
    ONE forward gives the students (noisy blocks) and the teachers (clean blocks, detached). The loss is
    ``pc_loss + ar_weight * ar_loss``, each term normalised by its count over the whole optimizer step.

    Dataset columns: as :class:`ConsistencyTrainer` (``prompt_ids``, ``response_ids``, ``trajectories``,
    ``fixed_points``, from ``hf-paralleldecode collect``).

    Logged (each averaged over the logging interval; ``eval_`` prefix in evaluation): ``loss`` (the total),
    ``pc_loss`` (mean divergence per noisy-block token between its prediction and its clean block's) and
    ``ar_loss`` (mean next-token cross-entropy on the clean blocks; with ``ar_target="base_kl"``, the mean KL
    to the frozen starting model), besides the Trainer's ``grad_norm`` and ``learning_rate``.

    Saving writes the model, ``parallel_decoding_config.json`` (``decoding="jacobi_forcing"`` with
    ``block_size``, ``num_blocks``, ``pool_size``, ``context_matches`` and ``context_tokens`` from the config)
    and a model card.

    Construction: as ``transformers.Trainer``, with ``model`` the causal LM to train (every parameter trains),
    ``args`` a :class:`ProgressiveConsistencyConfig` and ``train_dataset`` the trajectories; ``data_collator``
    defaults to a ``ProgressiveCollator`` with the config's ``block_size``, ``noise_schedule``,
    ``noise_window``, ``mask`` and ``seed``.
    """

    method = "jacobi_forcing"

    def _default_collator(self, c):
        return ProgressiveCollator(c.block_size, c.noise_schedule, c.noise_window, c.mask, seed=c.seed)

    def _decoding_config(self):
        a = self.args
        return ParallelDecodingConfig("jacobi_forcing", {"block_size": a.block_size, "num_blocks": a.num_blocks,
                                                         "pool_size": a.pool_size, "context_matches": a.context_matches,
                                                         "context_tokens": a.context_tokens})

    def _term_counts(self, inputs):
        return torch.stack([inputs["pair_mask"].sum(), (inputs["labels"] != -100).sum()])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        n_c, n_ar = self._split(num_items_in_batch)
        mask = inputs["attention_mask"].to(dtype=next(model.parameters()).dtype)
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], attention_mask=mask).logits
        loss_pc = progressive_consistency_loss(logits, inputs["noisy_index"], inputs["clean_index"],
                                               inputs["pair_mask"], self.args.distance, self.args.beta, n_c)
        loss_ar = self._ar_term(logits, inputs["labels"], n_ar, input_ids=inputs["input_ids"],
                                position_ids=inputs["position_ids"], attention_mask=mask)
        terms = {"pc_loss": loss_pc, "ar_loss": loss_ar}
        loss = self._combine(inputs, terms, num_items_in_batch)
        return (loss, terms) if return_outputs else loss


# ---- the recipe methods (hf-paralleldecode train: training/methods.py) -------------------------------------------
def _whole_model_method(name: str, config: type, trainer: type) -> TrainingMethod:
    """A method that trains the whole model on collected trajectories (``hf-paralleldecode collect``)."""

    def build(model, tokenizer, script, args):
        from .trajectories import load_trajectories

        dataset = load_trajectories(script.trajectories, drop_degenerate=script.drop_degenerate, tokenizer=tokenizer)
        if len(dataset) == 0:
            raise ValueError(f"No usable trajectories in {script.trajectories}.")
        return trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)

    def dry_run(target, script, args):
        return dict(trains="the whole model", block_size=getattr(args, "block_size", None)), count_parameters(target)

    return TrainingMethod(name, config, trainer, build, dry_run, check_data=check_trajectory_data)


def check_trajectory_data(script, args, tokenizer) -> None:
    """The whole-model methods' data checks that read no rows (``TrainingMethod.check_data``): trajectories (what
    ``collect`` writes) with the tokenizer's fingerprint, collected with the recipe's ``block_size``."""
    from .trajectories import check_data_folder

    config = check_data_folder(script.trajectories, "trajectory", REQUIRED_COLUMNS, "collect", tokenizer)
    check_block_size(config.get("block_size"), args.block_size)


register_training_method(_whole_model_method("cllm", ConsistencyConfig, ConsistencyTrainer))
register_training_method(_whole_model_method("jacobi_forcing", ProgressiveConsistencyConfig,
                                             ProgressiveConsistencyTrainer))
