"""Training methods by name: what ``hf-paralleldecode train`` runs for a recipe's ``method``.

A method registers itself from its own training module with :func:`register_training_method`: its config
class (a ``TrainingArguments`` subclass: the method's recipe keys), its trainer class, the recipe keys that
describe a new drafter (``options``: a dataclass, merged into the CLI's ``ScriptArguments``), how a real run
builds its trainer and what a dry run reports. Adding a method (a drafter kind's training) edits no other file.

What it deliberately does not know
    The CLI (``training/cli.py`` reads this registry and names no method) or any method's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TrainingMethod", "TRAINING_METHODS", "register_training_method", "count_parameters"]


@dataclass(frozen=True)
class TrainingMethod:
    """One recipe ``method``.

    ``build(model, tokenizer, script, args)`` returns the trainer of a real run: ``model`` is the target (loaded,
    ``attn_implementation`` as the recipe says), ``tokenizer`` its tokenizer, ``script`` the parsed
    ``ScriptArguments`` (every method's ``options`` fields included), ``args`` the parsed :attr:`config`.
    ``dry_run(target, script, args)`` returns ``(facts, trainable parameters or None)`` for ``--dry-run``: the target
    is built from its config on the meta device (no weights), so whatever it builds must be sized, not run.
    ``check_data(script, args, tokenizer)`` raises ``ValueError`` for data (``script.trajectories``) the real run
    would refuse, reading no rows: a real run calls it before its model loads, ``--dry-run`` when the data is there.
    """

    name: str
    config: type  # a transformers.TrainingArguments subclass
    trainer: type
    build: Callable[[Any, Any, Any, Any], Any]
    dry_run: Callable[[Any, Any, Any], tuple[dict, int | None]]
    #: a dataclass of the recipe keys that describe what the method trains when it is new (``help`` metadata starting
    #: with ``"<name>: "``), or ``None``
    options: type | None = None
    check_data: Callable[[Any, Any, Any], None] | None = None


#: method name -> :class:`TrainingMethod`, in the order they registered (the CLI's order)
TRAINING_METHODS: dict[str, TrainingMethod] = {}


def register_training_method(method: TrainingMethod) -> TrainingMethod:
    """Add ``method`` under its name (``ValueError`` when the name is taken or an option clashes with another
    method's)."""
    if not method.name or method.name in TRAINING_METHODS:
        raise ValueError(f"training method {method.name!r} is empty or registered twice")
    if method.options is not None:
        import dataclasses

        mine = {f.name for f in dataclasses.fields(method.options)}
        for other in TRAINING_METHODS.values():
            clash = mine & ({f.name for f in dataclasses.fields(other.options)} if other.options else set())
            if clash:
                raise ValueError(f"training method {method.name!r}: option(s) {sorted(clash)} are {other.name!r}'s "
                                 "too; prefix them with the method's name.")
    TRAINING_METHODS[method.name] = method
    return method


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
