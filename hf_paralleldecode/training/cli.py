"""``hf-paralleldecode train --config RECIPE.yaml [--key value ...]``: one entry point for every recipe.

A recipe is a YAML mapping: ``method`` (``cllm``, ``jacobi_forcing``, ``draft_head`` or ``deer``),
``model_name_or_path``, ``trajectories`` (a directory written by ``hf-paralleldecode collect``, or by
``regenerate`` for ``draft_head`` and ``deer``, whose drafters are described by the ``head_*`` /
``drafter_*`` keys) and any field of the method's config class (``ConsistencyConfig`` /
``ProgressiveConsistencyConfig`` / ``DraftHeadDistillationConfig`` / ``DiffusionAlignmentConfig``, i.e. every
``TrainingArguments`` field plus the method's own). Command-line ``--key value`` pairs override
the file (``HfArgumentParser`` rules). Runs under ``accelerate launch`` as is.

``--dry-run`` checks a recipe without its weights or data: every field is parsed and validated,
the target is built from its config alone on the meta device (no download of weights, no memory),
a draft head is built for it (sizes, tapped layers, block) and a summary is printed (parameter
counts, what is trained and saved, the effective batch, whether the data directory exists). On a
machine without a GPU the training arguments are validated with ``use_cpu`` (bf16 stays as written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ScriptArguments", "train_main"]

METHODS = {"cllm": ("ConsistencyConfig", "ConsistencyTrainer"),
           "jacobi_forcing": ("ProgressiveConsistencyConfig", "ProgressiveConsistencyTrainer"),
           "draft_head": ("DraftHeadDistillationConfig", "DraftHeadDistillationTrainer"),
           "deer": ("DiffusionAlignmentConfig", "DiffusionAlignmentTrainer"),
           "eagle3": ("Eagle3DistillationConfig", "Eagle3DistillationTrainer")}


@dataclass
class ScriptArguments:
    method: str = field(metadata={"help": f"Training method, one of {sorted(METHODS)}."})
    model_name_or_path: str = field(metadata={"help": "Base model: 'default' (embedded demo model), a path or Hub id."})
    trajectories: str = field(metadata={"help": (
        "Training data: trajectories written by `hf-paralleldecode collect` (cllm, jacobi_forcing) or "
        "continuations written by `hf-paralleldecode regenerate` (draft_head, deer, eagle3).")})
    head_attention: str = field(default="tree_causal", metadata={"help": "draft_head: 'tree_causal' or 'block_bidirectional'."})
    head_num_hidden_layers: int = field(default=1, metadata={"help": "draft_head: layers of the new head."})
    head_block_size: int = field(default=16, metadata={"help": "draft_head: drafted positions per block."})
    head_target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "draft_head: target layers to tap (default: spread through the depth).")})
    head_mask_token_id: int | None = field(default=None, metadata={"help": (
        "draft_head: the MASK token id of a new head (default: the last row of the target's embedding).")})
    init_head: str | None = field(default=None, metadata={"help": "draft_head: start from this saved head instead."})
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
    eagle3_num_hidden_layers: int = field(default=1, metadata={"help": "eagle3: decoder layers of a new drafter."})
    eagle3_target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "eagle3: target layers to fuse (default: EAGLE's low / middle / high layers).")})
    draft_vocab_size: int | None = field(default=None, metadata={"help": (
        "eagle3: a reduced draft vocabulary of the most frequent tokens in the data (default: the full vocabulary).")})
    init_eagle3: str | None = field(default=None, metadata={"help": "eagle3: start from this saved drafter instead."})
    drop_degenerate: bool = field(default=True, metadata={"help": "Skip responses flagged as repetitive."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "Attention implementation (4D masks: sdpa or eager)."})


def _to_argv(mapping: dict) -> list[str]:
    argv = []
    for key, value in mapping.items():
        if isinstance(value, (list, tuple)):
            argv += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            argv += [f"--{key}", json.dumps(value)]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def _field_names(*classes) -> set[str]:
    import dataclasses

    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.init}


def _check_keys(recipe: dict, overrides: list[str], config_cls) -> None:
    """Unknown recipe keys or ``--flags`` name the closest valid key (no prefix matching, no silent drop)."""
    from ..registry import unknown_settings_hint

    valid = _field_names(ScriptArguments, config_cls)
    given = [(k, "recipe key") for k in recipe]
    given += [(a[2:].split("=", 1)[0].replace("-", "_"), "flag") for a in overrides if a.startswith("--")]
    for key, what in given:
        if key not in valid:
            hint = unknown_settings_hint([key], sorted(valid))
            raise ValueError(f"Unknown {what} {key!r} for {config_cls.__name__}{hint}. "
                             "(`hf-paralleldecode train --config RECIPE --help` lists every field.)")


def train_help(argv: list[str]) -> str:
    """``train --help``: the recipe fields. With ``--config RECIPE`` (or ``--method M``): every field of
    that method's config as ``HfArgumentParser`` gives them; alone: the script fields and each
    method's own fields."""
    import dataclasses

    import yaml
    from transformers import HfArgumentParser, TrainingArguments

    from .. import training

    method = None
    if "--method" in argv and argv.index("--method") + 1 < len(argv):
        method = argv[argv.index("--method") + 1]
    elif "--config" in argv and argv.index("--config") + 1 < len(argv):
        path = Path(argv[argv.index("--config") + 1])
        method = (yaml.safe_load(path.read_text()) or {}).get("method") if path.is_file() else None
    usage = ("usage: hf-paralleldecode train --config RECIPE.yaml [--dry-run] [--key value ...]\n\n"
             "A recipe is a YAML mapping of the fields below; --key value overrides a field.\n")
    if method in METHODS:
        parser = HfArgumentParser((ScriptArguments, getattr(training, METHODS[method][0])),
                                  prog=f"hf-paralleldecode train  (method: {method})")
        return usage + parser.format_help()
    lines = [usage, "Script fields (every method):"]
    for f in dataclasses.fields(ScriptArguments):
        lines.append(f"  {f.name:<26} {f.metadata.get('help', '')}")
    base = _field_names(TrainingArguments)
    for name, (config_name, _) in METHODS.items():
        cls = getattr(training, config_name)
        lines.append(f"\nmethod: {name} ({config_name}: every transformers TrainingArguments field, plus)")
        for f in dataclasses.fields(cls):
            if f.init and f.name not in base:
                lines.append(f"  {f.name:<26} {f.metadata.get('help', '')}")
    lines.append("\nAll fields of one method: hf-paralleldecode train --method NAME --help "
                 "(or --config RECIPE.yaml --help)")
    return "\n".join(lines)


def _new_head(model, script, args):
    from ..drafters.head import DraftHead

    mask = {} if script.head_mask_token_id is None else {"mask_token_id": script.head_mask_token_id}
    return DraftHead.for_target(model, attention=script.head_attention, num_hidden_layers=script.head_num_hidden_layers,
                                block_size=script.head_block_size, target_layer_ids=script.head_target_layer_ids,
                                target_name_or_path=args.base_model_name_or_path, **mask)


def _new_drafter(model, script, tokenizer=None):
    from ..drafters.diffusion import DiffusionDrafter

    return DiffusionDrafter.for_target(
        model, num_hidden_layers=script.drafter_num_hidden_layers, block_size=script.drafter_block_size,
        attention=script.drafter_attention, shifted=script.drafter_shifted,
        boundary_token=script.drafter_boundary_token, init_from_target=script.drafter_init_from_target,
        tokenizer=tokenizer)


def _new_eagle3(model, script, args, dataset=None):
    import torch

    from ..drafters.eagle3 import Eagle3Drafter

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


def _dry_run(method: str, script, args, model_path) -> dict:
    """Build what the recipe trains from configs alone (meta device) and summarise it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except Exception as err:  # noqa: BLE001 - offline / missing: name the model
        raise ValueError(f"Could not read the config of {script.model_name_or_path!r}: {err}") from err
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    world = max(args.world_size, 1)
    summary = dict(method=method, target=script.model_name_or_path, target_parameters=count(target),
                   data=script.trajectories, data_exists=Path(script.trajectories, "collection_config.json").is_file(),
                   output_dir=args.output_dir, precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                   effective_batch_per_process=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                   learning_rate=args.learning_rate)
    if method == "draft_head":
        head = _new_head(target, script, args)
        trainable = count(head)
        c = head.config
        summary.update(trains="the draft head only (the target is frozen and never saved)",
                       head=dict(attention=c.attention, num_hidden_layers=c.num_hidden_layers,
                                 block_size=c.block_size, target_layer_ids=list(c.target_layer_ids),
                                 mask_token_id=c.mask_token_id, parameters=trainable),
                       objective=args.objective, kd_temperature=args.kd_temperature, gamma=args.gamma,
                       max_anchors=args.max_anchors)
    elif method == "deer":
        if script.init_drafter:  # a saved drafter (often the previous stage's output, not there yet)
            trainable, spec = None, dict(init_drafter=script.init_drafter,
                                         exists=Path(script.init_drafter, "diffusion_drafter.json").is_file())
        else:
            with torch.device("meta"):  # sizes only: no memory for a large vocabulary
                drafter = _new_drafter(target, script)
            trainable = count(drafter)
            spec = dict(drafter.config.to_dict(), num_hidden_layers=script.drafter_num_hidden_layers,
                        init_from_target=script.drafter_init_from_target, parameters=trainable)
        summary.update(trains="the diffusion drafter only (the target is never updated or saved)", drafter=spec,
                       stage=args.stage, objective=args.objective, max_anchors=args.max_anchors,
                       span_lengths=args.span_lengths)
    elif method == "eagle3":
        with torch.device("meta"):
            drafter = _new_eagle3(target, script, args)
        trainable = count(drafter)
        c = drafter.config
        summary.update(trains="the EAGLE-3 drafter only (the target is frozen and never saved)",
                       drafter=dict(num_hidden_layers=c.num_hidden_layers, target_layer_ids=list(c.target_layer_ids),
                                    draft_vocab_size=c.draft_vocab_size, parameters=trainable),
                       ttt_steps=args.ttt_steps, objective=args.objective)
    else:
        trainable = count(target)
        summary.update(trains="the whole model", block_size=getattr(args, "block_size", None))
    summary["trainable_parameters"] = trainable
    summary["world_size_here"] = world
    return summary


def train_main(argv: list[str]) -> int:
    import yaml
    from transformers import AutoModelForCausalLM, HfArgumentParser

    from .. import training
    from ..loading import EMBEDDED_MODELS, load_tokenizer, resolve_model_path
    from .trajectories import load_trajectories

    if "-h" in argv or "--help" in argv:
        print(train_help(argv))
        return 0
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if len(argv) < 2 or argv[0] != "--config":
        raise ValueError("usage: hf-paralleldecode train --config RECIPE.yaml [--dry-run] [--key value ...]")
    recipe_path = Path(argv[1])
    if not recipe_path.is_file():
        raise ValueError(f"Recipe {recipe_path} does not exist.")
    recipe = yaml.safe_load(recipe_path.read_text()) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"Recipe {recipe_path} must be a YAML mapping.")
    method = recipe.get("method")
    if method not in METHODS:
        raise ValueError(f"Recipe `method` must be one of {sorted(METHODS)}, got {method!r}.")
    config_cls = getattr(training, METHODS[method][0])
    trainer_cls = getattr(training, METHODS[method][1])
    parser = HfArgumentParser((ScriptArguments, config_cls), allow_abbrev=False)
    extra = list(argv[2:])
    _check_keys(recipe, extra, config_cls)
    if dry_run:
        import torch

        if not torch.cuda.is_available():
            extra += ["--use_cpu", "true"]
    script, args = parser.parse_args_into_dataclasses(args=_to_argv(recipe) + extra)
    model_path = resolve_model_path(script.model_name_or_path)
    if args.base_model_name_or_path is None:  # provenance: the embedded model's name, not the alias
        args.base_model_name_or_path = EMBEDDED_MODELS.get(script.model_name_or_path, str(model_path))
    if dry_run:
        print(json.dumps(_dry_run(method, script, args, model_path), indent=2))
        return 0
    from transformers import set_seed

    set_seed(args.seed)  # a new head's initialisation follows the recipe's seed, like the rest of the run
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=script.attn_implementation,
                                                 use_safetensors=True)
    tokenizer = load_tokenizer(model_path)  # saved with the checkpoint
    if method == "draft_head":
        from ..drafters.head import DraftHead
        from .regenerate import load_regenerated

        dataset = load_regenerated(script.trajectories, tokenizer=tokenizer)
        if script.init_head:
            head = DraftHead.from_pretrained(script.init_head, use_safetensors=True)
        else:
            head = _new_head(model, script, args)
        trainer = trainer_cls(model=head.train(), args=args, target_model=model, train_dataset=dataset)
    elif method == "eagle3":
        from ..drafters.loading import load_drafter
        from .regenerate import load_regenerated

        dataset = load_regenerated(script.trajectories, tokenizer=tokenizer)
        drafter = load_drafter(script.init_eagle3, cache=False) if script.init_eagle3 else \
            _new_eagle3(model, script, args, dataset)
        trainer = trainer_cls(model=drafter.train(), args=args, target_model=model, train_dataset=dataset)
    elif method == "deer":
        from ..drafters.diffusion import DiffusionDrafter
        from .regenerate import load_regenerated

        dataset = load_regenerated(script.trajectories, tokenizer=tokenizer)
        drafter = DiffusionDrafter.from_pretrained(script.init_drafter) if script.init_drafter else \
            _new_drafter(model, script, tokenizer)
        drafter.check_target(model, tokenizer=tokenizer)
        target = model if args.objective != "sft" else None  # cross-entropy needs no teacher forward
        trainer = trainer_cls(model=drafter.train(), args=args, target_model=target, train_dataset=dataset)
    else:
        dataset = load_trajectories(script.trajectories, drop_degenerate=script.drop_degenerate, tokenizer=tokenizer)
        if len(dataset) == 0:
            raise ValueError(f"No usable trajectories in {script.trajectories}.")
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # None: from the start
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        info = dict(method=method, world_size=args.world_size, steps=trainer.state.global_step,
                    train_loss=trainer.state.log_history[-1].get("train_loss"))
        Path(args.output_dir, "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0
