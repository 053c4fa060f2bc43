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
from .collators import ConsistencyCollator, ProgressiveCollator
from .losses import DISTANCES, ar_loss, consistency_loss, progressive_consistency_loss
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
    consistency: str = field(default="global", metadata={"help": "CLLM consistency: 'global' (to the fixed point) or 'local' (to the next state)."})

    def __post_init__(self):
        super().__post_init__()
        if self.consistency not in ("global", "local"):
            raise ValueError(f"consistency must be 'global' or 'local', got {self.consistency!r}.")


@dataclass
class ProgressiveConsistencyConfig(_ParallelDecodingTrainingArguments):
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
