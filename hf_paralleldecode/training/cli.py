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
Once the data is there, the dry run makes the data checks a real run makes before its model loads (the method's
``check_data``: the data's kind and tokenizer, the trajectories' block size), so it refuses what the run would.

A recipe that is not a YAML mapping of field names (missing, a folder, binary, not YAML, empty, a list) is a
``ValueError`` (``error: ...``, exit 2). ``key: null`` in a recipe, or ``--key None``, is the field's None where
that is its default (``HfArgumentParser`` itself reads no None), and is refused elsewhere.

What it deliberately does not know
    Any method: each registers itself from its own module (config, trainer, options, build, dry-run facts).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .methods import TRAINING_METHODS, count_parameters

__all__ = ["ScriptArguments", "train_main", "read_recipe", "METHODS"]

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


#: what every "this is no recipe" error ends with: what one is
_RECIPE_IS = ("A recipe is a short YAML file of `key: value` lines (`method: cllm`, `model_name_or_path: default`, "
              "`trajectories: DIR`, ...): start from one of recipes/*.yaml. Data files (prompts .jsonl, collected or "
              "regenerated folders) go in its keys, not after --config.")
#: a recipe is a few hundred bytes: a larger file is data passed by mistake (and is not read whole)
_RECIPE_MAX_BYTES = 1 << 20


def read_recipe(path) -> dict:
    """The recipe at ``path`` as a mapping of field names; a path that is missing or a folder, a file that is not
    text, not YAML, empty or not a mapping of names is a ``ValueError`` saying which, and what a recipe is."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise ValueError(f"Recipe {path} does not exist. {_RECIPE_IS}")
    if path.is_dir():
        raise ValueError(f"Recipe {path} is a directory: pass one YAML file. {_RECIPE_IS}")
    try:
        size = path.stat().st_size
        if size > _RECIPE_MAX_BYTES:
            raise ValueError(f"Recipe {path} is {size / 2**20:.1f} MiB: that is data, not a recipe. {_RECIPE_IS}")
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"Recipe {path} could not be read ({err.strerror or err}). {_RECIPE_IS}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = "\0"
    if "\0" in text:
        raise ValueError(f"Recipe {path} is not a text file (binary content). {_RECIPE_IS}")
    try:
        recipe = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"Recipe {path} is not valid YAML ({where}{problem}). {_RECIPE_IS}") from None
    if recipe is None:
        raise ValueError(f"Recipe {path} is empty. {_RECIPE_IS}")
    if not isinstance(recipe, dict):
        raise ValueError(f"Recipe {path} holds a YAML {type(recipe).__name__}, not a mapping. {_RECIPE_IS}")
    bad = [k for k in recipe if not isinstance(k, str)]
    if bad:
        raise ValueError(f"Recipe {path}: keys must be field names, got {bad}. {_RECIPE_IS}")
    return recipe


def _without_none(recipe: dict, overrides: list[str], classes) -> tuple[dict, list[str]]:
    """A recipe's ``key: null`` and a ``--key None`` flag: the field's None. ``HfArgumentParser`` reads no None, so
    they are left out where None is the field's default, and refused (naming the default) elsewhere."""
    fields = {f.name: f for cls in classes for f in dataclasses.fields(cls) if f.init}

    def is_default(key: str, written: str) -> bool:
        f = fields.get(key)
        if f is None:  # an unknown key: _check_keys names it
            return False
        if f.default is None:
            return True
        default = ("required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   else f"default {f.default if f.default is not dataclasses.MISSING else f.default_factory()!r}")
        raise ValueError(f"`{written}`: {key} has no None value ({default}); write a value, or remove the "
                         f"{'line' if ':' in written else 'flag'} for the default.")

    recipe = {k: v for k, v in recipe.items() if v is not None or not is_default(k, f"{k}: null")}
    kept, i = [], 0
    while i < len(overrides):
        arg = overrides[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if arg.startswith("--") and not eq and i + 1 < len(overrides):
            value = overrides[i + 1]
        if arg.startswith("--") and value == "None" and is_default(key, f"--{key} None"):
            i += 1 if eq else 2
            continue
        kept.append(arg)
        i += 1
    return recipe, kept


def _data_is_there(path: str) -> bool:
    """Whether ``trajectories`` names something (a file, or a folder with anything in it): a dry run checks it then;
    a folder not written yet is reported (``data_exists``), not refused."""
    data = Path(path)
    return data.is_file() or (data.is_dir() and any(data.iterdir()))


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

    from transformers import HfArgumentParser, TrainingArguments

    method = None
    if "--method" in argv and argv.index("--method") + 1 < len(argv):
        method = argv[argv.index("--method") + 1]
    elif "--config" in argv and argv.index("--config") + 1 < len(argv):
        path = Path(argv[argv.index("--config") + 1])
        method = read_recipe(path).get("method") if path.is_file() else None
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


def _dry_run(method: str, script, args, model_path, data_checked: bool) -> dict:
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
                   data=script.trajectories, data_exists=_data_is_there(script.trajectories), data_checked=data_checked,
                   output_dir=args.output_dir, precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                   effective_batch_per_process=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                   learning_rate=args.learning_rate)
    facts, trainable = TRAINING_METHODS[method].dry_run(target, script, args)
    summary.update(facts)
    summary["trainable_parameters"] = trainable
    summary["world_size_here"] = world
    return summary


def train_main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM, HfArgumentParser

    from ..loading import EMBEDDED_MODELS, load_tokenizer, resolve_model_path

    if "-h" in argv or "--help" in argv:
        print(train_help(argv))
        return 0
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if len(argv) < 2 or argv[0] != "--config":
        raise ValueError("usage: hf-paralleldecode train --config RECIPE.yaml [--dry-run] [--key value ...]")
    recipe = read_recipe(argv[1])
    method = recipe.get("method")
    if "method" not in recipe:
        raise ValueError(f"Recipe {argv[1]} has no `method` (one of {sorted(TRAINING_METHODS)}). {_RECIPE_IS}")
    if method not in TRAINING_METHODS:
        raise ValueError(f"Recipe `method` must be one of {sorted(TRAINING_METHODS)}, got {method!r}.")
    config_cls = TRAINING_METHODS[method].config
    script_cls = _script_arguments()
    parser = HfArgumentParser((script_cls, config_cls), allow_abbrev=False)
    extra = list(argv[2:])
    _check_keys(recipe, extra, config_cls)
    recipe, extra = _without_none(recipe, extra, (script_cls, config_cls))
    if dry_run:
        import torch

        if not torch.cuda.is_available():
            extra += ["--use_cpu", "true"]
    script, args = parser.parse_args_into_dataclasses(args=_to_argv(recipe) + extra)
    model_path = resolve_model_path(script.model_name_or_path)
    if args.base_model_name_or_path is None:  # provenance: the embedded model's name, not the alias
        args.base_model_name_or_path = EMBEDDED_MODELS.get(script.model_name_or_path, str(model_path))
    # the checks a real run makes before its model loads; a dry run makes them too once the data is there
    check_data = TRAINING_METHODS[method].check_data
    data_checked = check_data is not None and (not dry_run or _data_is_there(script.trajectories))
    tokenizer = None
    if data_checked or not dry_run:
        try:
            tokenizer = load_tokenizer(model_path)  # saved with the checkpoint
        except Exception as err:  # noqa: BLE001 - offline / missing: name the model
            raise ValueError(f"Could not read the tokenizer of {script.model_name_or_path!r}: {err}") from err
    if data_checked:
        check_data(script, args, tokenizer)
    if dry_run:
        print(json.dumps(_dry_run(method, script, args, model_path, data_checked), indent=2))
        return 0
    from transformers import set_seed

    set_seed(args.seed)  # a new head's initialisation follows the recipe's seed, like the rest of the run
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=script.attn_implementation,
                                                 use_safetensors=True)
    trainer = TRAINING_METHODS[method].build(model, tokenizer, script, args)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # None: from the start
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        info = dict(method=method, world_size=args.world_size, steps=trainer.state.global_step,
                    train_loss=trainer.state.log_history[-1].get("train_loss"))
        Path(args.output_dir, "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0
