"""``ParallelDecodingConfig``: the decoding a checkpoint is meant to be used with, Hub-pushable.

It is a small artefact saved beside the model (``parallel_decoding_config.json``), in the spirit
of peft's adapter configs: sorted-key JSON stamped with the library version; keys written by a
newer version that this one does not know are dropped with a warning; ``push_to_hub`` uploads the
file alone. :func:`hf_paralleldecode.load_model` attaches it to the model so that
``model.generate()`` defaults to the stored decoding and settings.

The settings are those of the strategy's settings class (``JacobiSettings``, ...), which checks them when the config
is built or loaded; the file records that class (``settings_class``) and
:attr:`ParallelDecodingConfig.strategy_settings` gives them back typed. A file without that key (written before it
was recorded) loads the same way. Loading runs the constructor's checks (a field of the wrong type is refused naming
it); only what a newer version wrote is let through with a warning.

Saving checks the whole file before writing it, and writes it atomically (a temporary file renamed into place): a
``torch.dtype`` setting (``drafter_dtype=torch.bfloat16``) is saved as its name (``"bfloat16"``) and read back as the
dtype; a value JSON cannot hold is refused with a ``ValueError`` naming the setting, and nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import typing
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine.settings import StrategySettings

logger = logging.getLogger(__name__)

__all__ = ["ParallelDecodingConfig", "CONFIG_NAME"]

CONFIG_NAME = "parallel_decoding_config.json"
#: the key of the saved file naming the settings class the settings are of (``module.QualName``)
SETTINGS_CLASS = "settings_class"


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: the fields besides ``decoding`` and ``settings``, each a str or None: what each holds, for the messages
_TEXT_FIELDS = {
    "drafter": "a folder, path or repo id",
    "base_model_name_or_path": "the base model's name or path",
    "library_version": "the version of hf_paralleldecode that wrote the file",
}


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _saved_value(name: str, value):
    """A setting as the file holds it: a ``torch.dtype`` by its name, any other value as JSON holds it; ``ValueError``
    naming the setting when JSON cannot hold it."""
    import torch

    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ValueError(f"The setting `{name}`={value!r} cannot be saved in {CONFIG_NAME}: JSON cannot hold a "
                         f"{type(value).__name__}. Save a value JSON holds (a str, a number, a bool, None, or a list / "
                         "dict of them), or leave the setting out of the config and pass it to generate().") \
            from None
    return value


def _read_settings(cls: type[StrategySettings], settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of a file as ``cls`` takes them: a dtype's name in a setting typed ``torch.dtype`` (saved by
    :func:`_saved_value`) becomes the dtype again."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: the values as saved
        return settings
    import torch

    def dtype_of(name, value):
        admits = hints.get(name) is torch.dtype or torch.dtype in typing.get_args(hints.get(name))
        dtype = getattr(torch, value, None) if admits and isinstance(value, str) else None
        return dtype if isinstance(dtype, torch.dtype) else value

    return {name: dtype_of(name, value) for name, value in settings.items()}


def _whose(cls: type) -> str:
    """`` (the settings of decoding='x')`` for a registered strategy's settings class; else ``""``."""
    from .registry import _REGISTRY, settings_class

    names = [name for name, strategy in _REGISTRY.items() if settings_class(strategy) is cls]
    return f" (the settings of decoding={names[0]!r})" if names else ""


@dataclass
class ParallelDecodingConfig:
    """Decoding name plus its settings, e.g. ``ParallelDecodingConfig("jacobi", {"block_size": 16})`` or
    ``ParallelDecodingConfig("jacobi", JacobiSettings(block_size=16))``.

    Args:
        decoding: a registered strategy name (see ``hf_paralleldecode.available_decodings()``).
        settings: settings of that strategy: an instance of its settings class (``JacobiSettings``, ...; kept as the
            settings that differ from their defaults) or a dict of them. Checked by that class at construction: an
            unknown name is refused naming the known ones, a bad value naming the fix.
            :attr:`strategy_settings` gives them back typed.
        base_model_name_or_path: optional provenance, written into model cards.
        drafter: where the draft head of ``decoding="speculative"`` lives: a folder relative to the
            checkpoint (a bundle, e.g. ``"drafter"``), a local path or a Hub repo id. The loader
            (:func:`hf_paralleldecode.load_model`) loads it and ``generate`` drafts with it by default.
        library_version: stamped on save; the version that wrote the file.
    """

    decoding: str = "jacobi"
    settings: dict[str, Any] | StrategySettings = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    drafter: str | None = None
    library_version: str | None = None

    def __post_init__(self):
        from .registry import get_decoding, settings_class

        self._check_fields()  # the types, before the registry is asked
        cls = settings_class(get_decoding(self.decoding))  # ValueError listing the available ones
        if isinstance(self.settings, StrategySettings):
            if type(self.settings) is not cls:
                raise ValueError(f"decoding {self.decoding!r} takes {cls.__name__}, got {type(self.settings).__name__}"
                                 f"{_whose(type(self.settings))}.")
            self.settings = self.settings.to_dict(changed_only=True)
        if not isinstance(self.settings, dict):
            raise ValueError(f"`settings` must be a dict or a {cls.__name__}, got {type(self.settings).__name__}.")
        cls.from_dict(self.settings, decoding=self.decoding)  # names and values, refused here rather than at generate()
        self._check_fields()  # settings given as a SpeculativeSettings may name a drafter

    def _check_fields(self) -> None:
        """What each field must be whatever the decoding (the constructor's checks, the loader's and the saver's):
        ``ValueError`` naming the field and what it takes."""
        if not isinstance(self.decoding, str):
            raise ValueError(f"`decoding` must be the name of a strategy (a str: one of hf_paralleldecode."
                             f"available_decodings()), got {self.decoding!r} ({type(self.decoding).__name__}).")
        for name, what in _TEXT_FIELDS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"`{name}` must be {what} (a str) or None, got {value!r} ({type(value).__name__}).")
        if isinstance(self.settings, dict) and "drafter" in self.settings:
            raise ValueError("Name the draft head with `drafter=` (a folder, path or repo id), not inside `settings`.")

    @property
    def strategy_settings(self) -> StrategySettings:
        """The settings as an instance of the decoding's settings class (the others at their defaults), checked."""
        from .registry import settings_class

        return settings_class(self.decoding).from_dict(self.settings, decoding=self.decoding)

    def generate_kwargs(self) -> dict[str, Any]:
        """``{"decoding": name, **settings}``: what ``generate`` uses by default."""
        return {"decoding": self.decoding, **self.settings}

    def to_dict(self) -> dict[str, Any]:
        """The fields as the file holds them (a ``torch.dtype`` setting by its name), and the settings class the
        settings are of (``settings_class``, when the decoding is registered). ``ValueError`` naming the field or
        setting that cannot be saved."""
        from .registry import _REGISTRY, settings_class

        self._check_fields()
        if not isinstance(self.settings, dict):
            raise ValueError(f"`settings` must be a dict, got {type(self.settings).__name__}.")
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["settings"] = {name: _saved_value(name, value) for name, value in self.settings.items()}
        if self.decoding in _REGISTRY:
            data[SETTINGS_CLASS] = _class_path(settings_class(self.decoding))
        return data

    def to_json_string(self) -> str:
        return _dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelDecodingConfig:
        """Build from saved data, leniently: a file written by a newer version still loads.

        Unknown top-level keys and unknown settings are dropped with a warning; an unknown decoding
        name is kept with a warning (``generate`` then raises, listing the available ones, unless
        the call passes ``decoding=``). The settings a registered decoding knows are checked by its settings class
        (a bad value is refused here), and every field as the constructor checks it. Files written before the settings
        class was recorded load the same way.
        """
        from .registry import _REGISTRY, settings_class

        if not isinstance(data, dict):
            raise ValueError(f"A parallel decoding config is a dict (a JSON object), got {type(data).__name__}.")
        version = data.get("library_version")
        known = {f.name for f in dataclasses.fields(cls)} | {SETTINGS_CLASS}
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            logger.warning("Ignoring keys %s of a parallel decoding config written by hf_paralleldecode %s.",
                           unknown, version)
        fields = {k: v for k, v in data.items() if k in known and k != SETTINGS_CLASS}
        decoding, settings = fields.get("decoding", "jacobi"), fields.get("settings") or {}
        if not isinstance(settings, dict):
            raise ValueError(f"`settings` must be a JSON object, got {type(settings).__name__}.")
        fields["settings"] = settings
        config = object.__new__(cls)  # no strict __post_init__ checks: the data came from a file
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(config, f.name, fields.get(f.name, default))
        config._check_fields()  # before the registry is asked: a decoding that is not a str cannot be looked up
        if decoding not in _REGISTRY:
            logger.warning("Decoding %r (from hf_paralleldecode %s) is not available in this version.",
                           decoding, version)
        else:
            typed = settings_class(decoding)
            recorded = data.get(SETTINGS_CLASS)
            if recorded is not None and recorded != _class_path(typed):
                logger.warning("The settings were written as %s; decoding %r reads them as %s.", recorded, decoding,
                               _class_path(typed))
            dropped = typed.unknown(sorted(settings))
            if dropped:
                logger.warning("Ignoring settings %s of decoding %r unknown to this version (its settings: %s).",
                               dropped, decoding, ", ".join(sorted(typed.names())))
            config.settings = _read_settings(typed, {k: v for k, v in settings.items() if k not in dropped})
            typed.from_dict(config.settings, decoding=decoding)  # the values, checked as the class checks them
        return config

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **push_kwargs) -> Path:
        """Write ``parallel_decoding_config.json`` into ``save_directory`` (created), stamped with this version: checked
        whole first (``ValueError`` naming what cannot be saved, before any file is written), then written to a
        temporary file renamed into place, so a failed save leaves the folder as it was."""
        from .version import __version__

        save_directory = Path(save_directory)
        if save_directory.is_file():
            raise ValueError(f"save_directory {save_directory} is a file; pass a directory.")
        text = _dumps({**self.to_dict(), "library_version": __version__})
        created = not save_directory.exists()
        save_directory.mkdir(parents=True, exist_ok=True)
        path = save_directory / CONFIG_NAME
        tmp = save_directory / f".{CONFIG_NAME}.{uuid.uuid4().hex}.tmp"  # (mkstemp's would keep its 0600 mode)
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            if created:
                save_directory.rmdir()
            raise
        self.library_version = __version__
        if push_to_hub:
            repo_id = push_kwargs.pop("repo_id", None) or save_directory.name
            self.push_to_hub(repo_id, **push_kwargs)
        return path

    @classmethod
    def from_pretrained(cls, pretrained: str | os.PathLike, **hub_kwargs) -> ParallelDecodingConfig:
        """Load from a local directory (or file), or from a Hub repo id via ``hf_hub_download``."""
        path = Path(pretrained)
        if path.is_dir():
            path = path / CONFIG_NAME
        if not path.is_file():
            if Path(pretrained).exists():
                raise ValueError(f"No {CONFIG_NAME} in {pretrained}.")
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(pretrained), CONFIG_NAME, **hub_kwargs))
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object.")
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def exists_in(cls, directory: str | os.PathLike) -> bool:
        return (Path(directory) / CONFIG_NAME).is_file()

    def push_to_hub(self, repo_id: str, commit_message: str = "Upload parallel decoding config", **kwargs) -> str:
        """Upload ``parallel_decoding_config.json`` to ``repo_id`` (created if needed)."""
        from huggingface_hub import HfApi

        api = HfApi(token=kwargs.pop("token", None))
        with tempfile.TemporaryDirectory() as tmp:
            path = self.save_pretrained(tmp)  # checked before the repo is created
            api.create_repo(repo_id, exist_ok=True, private=kwargs.pop("private", None))
            info = api.upload_file(
                path_or_fileobj=str(path), path_in_repo=CONFIG_NAME, repo_id=repo_id,
                commit_message=commit_message, **kwargs,
            )
        return str(info)
