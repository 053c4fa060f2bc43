"""``hf_paralleldecode.enable(model)``: ``model.generate(decoding="name", ...)`` on a stock model.

How (decision)
    The instance's class is swapped for a subclass ``(ParallelDecodingMixin, OriginalClass)`` that
    keeps the original ``__name__`` and ``__module__`` (so ``save_pretrained`` still writes the
    original architecture name and ``isinstance`` checks keep working). No transformers class or
    function is modified; other instances are untouched. The mixin's ``generate`` pops
    ``decoding`` (default: the checkpoint's ``ParallelDecodingConfig``, if the loader attached one;
    ``decoding="stock"`` always runs the stock loop), looks the
    strategy up in the registry and calls the stock ``generate`` with ``custom_generate=<strategy>``,
    so transformers still prepares inputs, cache, processors and stopping criteria.

What a call can get (``engine/support.py``; the table is ``docs/generate-arguments.md``)
    Before transformers prepares anything, the call is checked against what a parallel decoding
    can serve. An explicit ``decoding=`` raises on a conflict; a checkpoint's *default* decoding
    steps aside and stock ``generate`` runs (info log). ``stop_strings`` are turned into a
    ``StopStringCriteria`` here, from ``tokenizer=``, which transformers does not hand a callable.

Saving
    ``save_pretrained`` writes the target, and besides it the attached ``ParallelDecodingConfig`` and drafter (a
    bundle). The whole checkpoint is checked before any file is written (the config's fields and settings must be
    ones its JSON file holds, the drafter's kind must save itself), then written into a temporary folder beside
    the target folder and moved into place: a save that fails leaves the folder as it was, never a checkpoint
    without its decoding config.

Pickling
    The swapped class is made per original class at run time, so pickle cannot find it by name. An
    enabled model pickles as its original class plus "enable me again": ``pickle``, ``copy.deepcopy``
    and ``torch.save`` / ``torch.load(weights_only=False)`` give back an enabled model with its
    attached decoding config and draft head.

Streamer
    transformers does not hand ``streamer`` to ``custom_generate`` callables (it even puts the prompt
    into it and never calls ``end()``). The mixin therefore passes the streamer to the strategy as
    ``pd_streamer``; the strategy puts the prompt, each committed step and ``end()`` itself.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from .engine.settings import takes_streamer
from .engine.support import call_conflict
from .registry import get_decoding, settings_class

__all__ = ["enable", "ParallelDecodingMixin", "is_enabled", "STOCK", "attach_drafter", "attached_drafter",
           "BUNDLE_DRAFTER_DIR"]

logger = logging.getLogger(__name__)

#: ``decoding="stock"`` runs transformers' own generate, ignoring a checkpoint's decoding defaults.
STOCK = "stock"

_CLASS_CACHE: dict[type, type] = {}


class ParallelDecodingMixin:
    """Adds ``decoding=`` to ``generate``; without it, ``generate`` is the stock one."""

    _hf_paralleldecode_enabled = True

    def __reduce_ex__(self, protocol):
        # pickle the instance as its original class, then swap the class back in on load
        cls = type(self)
        object.__setattr__(self, "__class__", cls.__mro__[2])  # (swapped, mixin, original, ...)
        try:
            reduced = self.__reduce_ex__(protocol)
        finally:
            object.__setattr__(self, "__class__", cls)
        if not isinstance(reduced, tuple):  # pragma: no cover - a global name: nothing to re-enable
            return reduced
        return (_enabled_from_reduce, (reduced[0], reduced[1]), *reduced[2:])

    def generate(self, *args, decoding: str | None = None, **kwargs):
        if decoding == STOCK:
            return super().generate(*args, **kwargs)
        pd_config = getattr(self, "parallel_decoding_config", None)
        defaults = pd_config.generate_kwargs() if pd_config is not None else {}
        explicit = decoding is not None
        if decoding is None:
            decoding = defaults.pop("decoding", None)
        elif defaults.get("decoding") != decoding:
            defaults = {}
        else:
            defaults.pop("decoding", None)
        if kwargs.get("drafter") is not None and pd_config is not None and pd_config.drafter is not None:
            defaults = {}  # the checkpoint's settings were chosen for its own drafter, not for the one given here
        if decoding is None:
            return super().generate(*args, **kwargs)
        strategy = get_decoding(decoding)
        inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        attached = attached_drafter(self)
        drafter = next((d for d in (kwargs.get("drafter"), defaults.get("drafter"), attached) if d is not None), None)
        # without a prompt, generate starts every row from one BOS token
        length = inputs.shape[-1] if isinstance(inputs, torch.Tensor) else 1
        conflict = call_conflict(self, strategy, kwargs, length, drafter)
        if conflict is not None:
            if explicit:
                raise ValueError(f"decoding={decoding!r} {conflict}")
            # a checkpoint default steps aside for calls it cannot serve; an explicit decoding= raises
            logger.info("The checkpoint's default decoding=%r steps aside for this call (it %s) and stock generate "
                        "runs. Pass decoding=%r explicitly to get the error instead.", decoding, conflict, decoding)
            return super().generate(*args, **kwargs)
        _stop_strings_to_criteria(self, kwargs)
        settings = settings_class(strategy).names()
        for key, value in defaults.items():
            if key in settings:
                kwargs.setdefault(key, value)
        if attached is not None and "drafter" in settings:
            kwargs.setdefault("drafter", attached)
        streamer = kwargs.pop("streamer", None)
        if streamer is not None:
            if not takes_streamer(strategy):
                raise ValueError(f"decoding={decoding!r} does not support `streamer`.")
            kwargs["pd_streamer"] = streamer
        return super().generate(*args, custom_generate=strategy, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Stock ``save_pretrained`` plus the attached ``ParallelDecodingConfig`` and draft head, if any.

        With a draft head attached the directory becomes a *bundle*: the head goes to
        ``drafter/`` and the config names it, so :func:`hf_paralleldecode.load_model` restores both
        (``push_to_hub``, and ``push_to_hub=True`` here, push the bundle).

        The checkpoint is checked whole before any file is written (``ValueError`` naming the fix: a setting JSON
        cannot hold, a drafter kind that cannot save itself), then written into a temporary folder beside
        ``save_directory`` and moved into place: a save that fails leaves ``save_directory`` as it was.
        """
        config, drafter = self._checked_bundle()
        if not kwargs.get("is_main_process", True):  # the main process writes the files
            return super().save_pretrained(save_directory, *args, **kwargs)
        push = kwargs.pop("push_to_hub", False)
        hub = {k: kwargs.pop(k) for k in _PUSH_ARGUMENTS if k in kwargs}
        with _staged(save_directory) as stage:
            out = super().save_pretrained(stage, *args, **kwargs)
            if drafter is not None:
                drafter.save_pretrained(stage / BUNDLE_DRAFTER_DIR)
            if config is not None:
                config.save_pretrained(stage)
        if push:
            repo_id = hub.pop("repo_id", None) or Path(os.path.abspath(save_directory)).name
            self.push_to_hub(repo_id, token=kwargs.get("token"), **hub)
        return out

    def push_to_hub(self, *args, **kwargs):
        """Stock ``push_to_hub`` of what :meth:`save_pretrained` writes (the bundle), checked before the repo is
        created."""
        self._checked_bundle()
        return super().push_to_hub(*args, **kwargs)

    def _checked_bundle(self):
        """``(config, drafter)`` that a save writes beside the target (the config naming the bundle's drafter
        folder), each ``None`` when there is none; ``ValueError`` naming the fix when one cannot be saved."""
        from .config import ParallelDecodingConfig

        config = getattr(self, "parallel_decoding_config", None)
        drafter = attached_drafter(self)
        if config is not None and not isinstance(config, ParallelDecodingConfig):
            raise ValueError(f"model.parallel_decoding_config must be a hf_paralleldecode.ParallelDecodingConfig, got "
                             f"{type(config).__name__}: set ParallelDecodingConfig(decoding, settings), or delete the "
                             "attribute to save the model without one.")
        if drafter is not None:
            drafter.check_saveable()
            if config is not None:
                config = copy.copy(config)  # the model's own config is left as it is
                config.drafter = BUNDLE_DRAFTER_DIR
        if config is not None:
            config.to_dict()  # a field or setting its file cannot hold
        return config, drafter


#: folder of a bundle's draft head, next to the target's weights
BUNDLE_DRAFTER_DIR = "drafter"
#: the ``save_pretrained`` arguments that only concern ``push_to_hub=True``
_PUSH_ARGUMENTS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")


@contextlib.contextmanager
def _staged(save_directory):
    """A new folder beside ``save_directory`` to write a checkpoint into: moved into place when the block ends (its
    files and folders replace those of the same name), removed when it raises (``save_directory`` is left as it
    was, and not created)."""
    final = Path(os.path.abspath(save_directory))
    if final.is_file():
        raise ValueError(f"save_directory {save_directory} is a file; pass a directory.")
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = final.parent / f".{final.name}.{uuid.uuid4().hex}.saving"  # (mkdtemp's would keep its 0700 mode)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if not final.exists():
        stage.rename(final)
        return
    for entry in stage.iterdir():
        dest = final / entry.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)  # a folder of the checkpoint (a bundle's drafter/) is replaced whole
        elif entry.is_dir() and (dest.exists() or dest.is_symlink()):
            dest.unlink()
        os.replace(entry, dest)
    stage.rmdir()


def _stop_strings_to_criteria(model, kwargs: dict) -> None:
    """``stop_strings`` (the call's, or the generation config's) become a ``StopStringCriteria`` in
    ``stopping_criteria``: transformers needs ``tokenizer=`` to build it and does not hand a
    ``custom_generate`` callable the tokenizer."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config") or model.generation_config
    stop = kwargs["stop_strings"] if "stop_strings" in kwargs else getattr(config, "stop_strings", None)
    if not stop:
        return
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer to match text: pass tokenizer=... to generate().")
    from transformers import StoppingCriteriaList, StopStringCriteria

    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def _enabled_from_reduce(rebuild, args):
    """Unpickling helper: the original class's constructor-from-pickle, then :func:`enable`."""
    return enable(rebuild(*args))


def attach_drafter(model, drafter) -> None:
    """Make ``drafter`` the default ``drafter=`` of ``model.generate`` (kept out of the model's modules)."""
    drafter.check_target(model)
    object.__setattr__(model, "_hfpd_drafter", drafter)


def attached_drafter(model):
    return model.__dict__.get("_hfpd_drafter")


def is_enabled(model) -> bool:
    return isinstance(model, ParallelDecodingMixin)


def enable(model):
    """Return ``model`` (same object) whose ``generate`` also accepts ``decoding="<name>"``."""
    if is_enabled(model):
        return model
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # what torch.compile(model) returns
        raise ValueError(
            f"enable() got a torch.compile wrapper ({type(model).__name__}) of a {type(model._orig_mod).__name__}: its "
            "generate() is the wrapped model's, which runs the uncompiled forward, and decoding= cannot be added to the "
            "wrapper. Enable the model itself (hf_paralleldecode.enable(compiled._orig_mod), or enable before "
            "compiling); to run a compiled forward under decoding=, compile the forward of the enabled model: "
            "model.forward = torch.compile(model.forward) (docs/troubleshooting.md).")
    if not callable(getattr(type(model), "generate", None)):
        raise ValueError(f"{type(model).__name__} has no generate() of its own; pass a transformers causal LM (not a "
                         "wrapper around one).")
    cls = type(model)
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(cls.__name__, (ParallelDecodingMixin, cls), {"__module__": cls.__module__})
        new_cls.__qualname__ = cls.__qualname__
        _CLASS_CACHE[cls] = new_cls
    model.__class__ = new_cls
    return model
