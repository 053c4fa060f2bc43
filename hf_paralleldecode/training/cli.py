"""``hf-paralleldecode train --config RECIPE.yaml [--key value ...]``: one entry point for every recipe.

A recipe is a YAML mapping: ``method`` (a registered training method: ``cllm``, ``jacobi_forcing``, ``draft_head``,
``deer``, ``eagle3``; see :mod:`.methods`), ``model_name_or_path``, ``trajectories`` (a directory written by
``hf-paralleldecode collect``, or by ``regenerate`` for the drafter methods, whose new drafters are described by
their ``options`` keys: ``head_*``, ``drafter_*``, ``eagle3_*``) and any field of the method's config class (every
``TrainingArguments`` field plus the method's own). Command-line ``--key value`` pairs override the file
(``HfArgumentParser`` rules). Runs under ``accelerate launch`` as is.

``--dry-run`` checks a recipe without its weights or data: every field is parsed and validated,
the target is built from its config alone on the meta device (no download of weights, no memory),
what the method trains is built for it (its sizes) and a summary is printed (parameter
counts, what is trained and saved, the effective batch, whether the data directory exists). On a
machine without a GPU the training arguments are validated with ``use_cpu`` (bf16 stays as written).

What it deliberately does not know
    Any method: each registers itself from its own module (config, trainer, options, build, dry-run facts).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .methods import TRAINING_METHODS, count_parameters

__all__ = ["ScriptArguments", "train_main", "METHODS"]

#: method name -> (config class name, trainer class name) of the methods registered when this module loaded (the CLI
#: itself reads :data:`~.methods.TRAINING_METHODS` at each call, so a method registered later is served too)
METHODS = {name: (m.config.__name__, m.trainer.__name__) for name, m in TRAINING_METHODS.items()}


def _script_arguments() -> type:
    """``ScriptArguments``: the keys every recipe has, then each registered method's ``options`` (in registration
    order), then the common settings."""

    @dataclass
    class _Recipe:
        method: str = field(metadata={"help": f"Training method, one of {sorted(TRAINING_METHODS)}."})
        model_name_or_path: str = field(metadata={"help": (
            "Base model: 'default' (embedded demo model), a path or Hub id.")})
        trajectories: str = field(metadata={"help": (
            "Training data: trajectories written by `hf-paralleldecode collect` (cllm, jacobi_forcing) or "
            "continuations written by `hf-paralleldecode regenerate` (draft_head, deer, eagle3).")})

    @dataclass
    class _Common:
        drop_degenerate: bool = field(default=True, metadata={"help": "Skip responses flagged as repetitive."})
        attn_implementation: str = field(default="sdpa", metadata={"help": (
            "Attention implementation (4D masks: sdpa or eager).")})

    options = [m.options for m in TRAINING_METHODS.values() if m.options is not None]
    # dataclass fields follow the reversed MRO: _Recipe's, then the options in order, then _Common's
    cls = dataclasses.make_dataclass("ScriptArguments", [], bases=(_Common, *reversed(options), _Recipe))
    cls.__module__ = __name__
    cls.__doc__ = "The recipe keys beside the method's config class: the model, the data, how a new drafter is built."
    return cls


#: the script keys of the methods registered when this module loaded (see :data:`METHODS`)
ScriptArguments = _script_arguments()


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

    valid = _field_names(_script_arguments(), config_cls)
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

    method = None
    if "--method" in argv and argv.index("--method") + 1 < len(argv):
        method = argv[argv.index("--method") + 1]
    elif "--config" in argv and argv.index("--config") + 1 < len(argv):
        path = Path(argv[argv.index("--config") + 1])
        method = (yaml.safe_load(path.read_text()) or {}).get("method") if path.is_file() else None
    usage = ("usage: hf-paralleldecode train --config RECIPE.yaml [--dry-run] [--key value ...]\n\n"
             "A recipe is a YAML mapping of the fields below; --key value overrides a field.\n")
    script_arguments = _script_arguments()
    if method in TRAINING_METHODS:
        parser = HfArgumentParser((script_arguments, TRAINING_METHODS[method].config),
                                  prog=f"hf-paralleldecode train  (method: {method})")
        return usage + parser.format_help()
    lines = [usage, "Script fields (every method):"]
    for f in dataclasses.fields(script_arguments):
        lines.append(f"  {f.name:<26} {f.metadata.get('help', '')}")
    base = _field_names(TrainingArguments)
    for name, m in TRAINING_METHODS.items():
        cls = m.config
        lines.append(f"\nmethod: {name} ({cls.__name__}: every transformers TrainingArguments field, plus)")
        for f in dataclasses.fields(cls):
            if f.init and f.name not in base:
                lines.append(f"  {f.name:<26} {f.metadata.get('help', '')}")
    lines.append("\nAll fields of one method: hf-paralleldecode train --method NAME --help "
                 "(or --config RECIPE.yaml --help)")
    return "\n".join(lines)


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
    world = max(args.world_size, 1)
    summary = dict(method=method, target=script.model_name_or_path, target_parameters=count_parameters(target),
                   data=script.trajectories, data_exists=Path(script.trajectories, "collection_config.json").is_file(),
                   output_dir=args.output_dir, precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                   effective_batch_per_process=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                   learning_rate=args.learning_rate)
    facts, trainable = TRAINING_METHODS[method].dry_run(target, script, args)
    summary.update(facts)
    summary["trainable_parameters"] = trainable
    summary["world_size_here"] = world
    return summary


def train_main(argv: list[str]) -> int:
    import yaml
    from transformers import AutoModelForCausalLM, HfArgumentParser

    from ..loading import EMBEDDED_MODELS, load_tokenizer, resolve_model_path

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
    if method not in TRAINING_METHODS:
        raise ValueError(f"Recipe `method` must be one of {sorted(TRAINING_METHODS)}, got {method!r}.")
    config_cls = TRAINING_METHODS[method].config
    parser = HfArgumentParser((_script_arguments(), config_cls), allow_abbrev=False)
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
    trainer = TRAINING_METHODS[method].build(model, tokenizer, script, args)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # None: from the start
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        info = dict(method=method, world_size=args.world_size, steps=trainer.state.global_step,
                    train_loss=trainer.state.log_history[-1].get("train_loss"))
        Path(args.output_dir, "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0
