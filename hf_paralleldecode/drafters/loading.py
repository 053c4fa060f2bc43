"""One loader for every drafter: ``load_drafter(path_or_repo)``, and the dtype a drafter runs in.

:func:`load_drafter` recognises a checkpoint's format from its config (``architectures``,
``model_type``, ``speculators_model_type``, this project's own files) by asking each registered drafter
kind's formats (:data:`~.base.DRAFTER_KINDS`, each kind's ``FORMATS``; the built-in kinds register when the
package is imported) in turn, and loads it with the kind's ``read_checkpoint``, strictly:
a folder that matches no known format, or weights that do not fit the format, raise ``ValueError``
naming what was found and what is missing. Nothing is ever randomly initialised.

Formats read (see ``docs/drafters.md``):
    * this project's own: draft heads, DEER diffusion drafters, EAGLE-3 drafters, and every export
      (``export_draft_head`` / ``export_drafter``) read back;
    * z-lab DFlash (``block_size`` at the top level or in ``dflash_config``) and the JetSpec authors'
      heads (``causal_head``); transformers' DFlash assistant folders (``muse_glimmer_assistant``);
      ``speculators`` ``dflash``;
    * EAGLE-3: the original EAGLE / SpecForge layout and ``speculators`` ``eagle3``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .base import DRAFTER_KINDS, Drafter, shipped_drafter_dir
from .formats import read_config, resolve_folder

__all__ = ["load_drafter", "own_drafter", "recognise", "DRAFTER_DTYPES", "check_drafter_dtype", "drafter_run_dtype"]


DRAFTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_drafter_dtype(drafter_dtype) -> None:
    """``None`` (the preset's), ``"target"``, a name of :data:`DRAFTER_DTYPES` or one of its dtypes."""
    if drafter_dtype is None or drafter_dtype == "target" or drafter_dtype in DRAFTER_DTYPES or \
            drafter_dtype in DRAFTER_DTYPES.values():
        return
    raise ValueError(f"drafter_dtype must be 'target' (the model's dtype), one of {sorted(DRAFTER_DTYPES)} or the "
                     f"torch dtype of one, got {drafter_dtype!r}.")


def drafter_run_dtype(drafter_dtype, model) -> torch.dtype:
    """The dtype a drafter runs in for a (checked, preset-filled) ``drafter_dtype``."""
    if drafter_dtype is None or drafter_dtype == "target":
        return model.dtype
    return DRAFTER_DTYPES.get(drafter_dtype, drafter_dtype)


def recognise(folder) -> tuple[type, object, dict]:
    """``(drafter class, format, config)`` of a checkpoint folder; ``ValueError`` naming what was found when no
    registered format matches."""
    folder = Path(folder)
    config = read_config(folder) or {}
    files = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    probe = {**config, "folder files": files}
    for cls in DRAFTER_KINDS.values():
        for fmt in getattr(cls, "FORMATS", ()):
            if fmt.matches(probe):
                return cls, fmt, config
    found = {k: config[k] for k in ("architectures", "model_type", "speculators_model_type") if k in config}
    known = sorted(fmt.name for cls in DRAFTER_KINDS.values() for fmt in getattr(cls, "FORMATS", ()))
    what = f"a config with {found}" if found else ("a config.json without architectures, model_type or "
                                                    "speculators_model_type" if config else "no config.json")
    raise ValueError(f"{folder} is not a drafter checkpoint this project reads: it holds {what}. Known formats: "
                     + "; ".join(known) + ".")


def load_drafter(drafter, *, subfolder: str | None = None, cache: bool = True, device=None, dtype=None,
                 **hub_kwargs) -> Drafter:
    """A drafter object as given, or loaded from a folder, a Hub repo id, a ``(repo id, subfolder)`` pair of a
    bundle or a shipped alias (``"default-jetspec"``, ``"default-dflash"``, ``"default-deer"``,
    ``"default-eagle3"``), in any format the drafter kinds read (module docstring).

    ``device`` / ``dtype``: where a loaded drafter is put (an object is returned as given). Local folders and
    aliases are loaded once per folder content, device and dtype (``cache=False`` loads anew); a folder
    rewritten on disk loads again. The library never moves a cached drafter: a call that needs another device or
    dtype gets its own. ``hub_kwargs``: ``revision``, ``token``.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, tuple) and len(drafter) == 2:  # (repo id, subfolder) of a Hub bundle
        drafter, subfolder = drafter
    if not isinstance(drafter, (str, os.PathLike)):
        raise ValueError(
            f"`drafter` must be a drafter (hf_paralleldecode.DraftHead, Eagle3Drafter, DiffusionDrafter) or the folder / "
            f"Hub repo id / shipped alias of one, got {type(drafter).__name__}."
        )
    unknown = sorted(set(hub_kwargs) - {"revision", "token"})
    if unknown:
        raise TypeError(f"load_drafter() got unexpected keyword argument(s) {unknown}; it takes revision= and token= "
                        "for Hub downloads.")
    folder = shipped_drafter_dir(str(drafter))
    if folder is None:
        folder = resolve_folder(drafter, subfolder, **hub_kwargs)
    if not folder.is_dir():
        raise ValueError(f"drafter={str(drafter)!r}: {folder} is not a folder.")
    key = (_loaded_key(folder), str(device), str(dtype)) if cache else None
    if key is not None and key in _LOADED:
        return _LOADED[key]
    cls, fmt, config = recognise(folder)
    try:
        loaded = cls.read_checkpoint(fmt, folder, config)
    except ValueError:
        raise  # already names the format and the problem
    except Exception as err:  # noqa: BLE001 - any other failure is a bad checkpoint, reported with its cause
        raise ValueError(f"Could not load {folder} as a {fmt.name} checkpoint: {type(err).__name__}: {err}") from err
    if device is not None or dtype is not None:
        loaded.to(device=device, dtype=dtype)
    if key is not None:
        _LOADED[key] = loaded
    return loaded


def own_drafter(drafter, model, **hub_kwargs) -> Drafter:
    """A drafter of ``model``'s own, on its device and dtype: loaded anew from a path (:func:`load_drafter`'s), or a
    copy of a drafter object (the object given is left as it is). What a model attaches: no other model's drafter
    ever changes with it (a run's ``drafter_dtype`` casts the attached drafter in place)."""
    if isinstance(drafter, Drafter):
        return drafter.copy_to(device=model.device, dtype=model.dtype)
    return load_drafter(drafter, cache=False, device=model.device, dtype=model.dtype, **hub_kwargs)


#: drafters loaded from a local folder or a shipped alias, by folder, the folder's file times, device and dtype: a
#: ``generate(drafter="default-deer")`` in a loop loads it once, and a folder rewritten on disk loads again
_LOADED: dict = {}


def _loaded_key(folder: Path) -> tuple:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return str(folder.resolve()), tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)

