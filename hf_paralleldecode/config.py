"""``ParallelDecodingConfig``: the decoding a checkpoint is meant to be used with, Hub-pushable.

It is a small artefact saved beside the model (``parallel_decoding_config.json``), in the spirit
of peft's adapter configs: sorted-key JSON stamped with the library version; keys written by a
newer version that this one does not know are dropped with a warning; ``push_to_hub`` uploads the
file alone. :func:`hf_paralleldecode.load_model` attaches it to the model so that
``model.generate()`` defaults to the stored decoding and settings.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ParallelDecodingConfig", "CONFIG_NAME"]

CONFIG_NAME = "parallel_decoding_config.json"


@dataclass
class ParallelDecodingConfig:
    """Decoding name plus its settings, e.g. ``ParallelDecodingConfig("jacobi", {"block_size": 16})``.

    Args:
        decoding: a registered strategy name (see ``hf_paralleldecode.available_decodings()``).
        settings: keyword settings of that strategy (checked against its signature).
        base_model_name_or_path: optional provenance, written into model cards.
        drafter: where the draft head of ``decoding="speculative"`` lives: a folder relative to the
            checkpoint (a bundle, e.g. ``"drafter"``), a local path or a Hub repo id. The loader
            (:func:`hf_paralleldecode.load_model`) loads it and ``generate`` drafts with it by default.
        library_version: stamped on save; the version that wrote the file.
    """

    decoding: str = "jacobi"
    settings: dict[str, Any] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    drafter: str | None = None
    library_version: str | None = None

    def __post_init__(self):
        from .registry import decoding_settings, get_decoding, unknown_settings_hint

        strategy = get_decoding(self.decoding)  # ValueError listing the available ones
        if not isinstance(self.settings, dict):
            raise ValueError(f"`settings` must be a dict, got {type(self.settings).__name__}.")
        known = decoding_settings(self.decoding)
        unknown = sorted(k for k in self.settings if k not in known)
        if unknown:
            raise ValueError(f"Unknown settings {unknown} for decoding {self.decoding!r}"
                             f"{unknown_settings_hint(unknown, known)}; its settings: {', '.join(known)}.")
        check = getattr(strategy, "check_settings", None)
        if check is not None:  # values, not only names: refused here rather than at the first generate()
            check(self.settings)
        if "drafter" in self.settings:
            raise ValueError("Name the draft head with `drafter=` (a folder, path or repo id), not inside `settings`.")
        if self.drafter is not None and not isinstance(self.drafter, str):
            raise ValueError(f"`drafter` must be a folder, path or repo id (str), got {type(self.drafter).__name__}.")

    def generate_kwargs(self) -> dict[str, Any]:
        """``{"decoding": name, **settings}``: what ``generate`` uses by default."""
        return {"decoding": self.decoding, **self.settings}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelDecodingConfig:
        """Build from saved data, leniently: a file written by a newer version still loads.

        Unknown top-level keys and unknown settings are dropped with a warning; an unknown decoding
        name is kept with a warning (``generate`` then raises, listing the available ones, unless
        the call passes ``decoding=``).
        """
        from .registry import _REGISTRY, decoding_settings

        version = data.get("library_version")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            logger.warning("Ignoring keys %s of a parallel decoding config written by hf_paralleldecode %s.",
                           unknown, version)
        fields = {k: v for k, v in data.items() if k in known}
        decoding, settings = fields.get("decoding", "jacobi"), fields.get("settings") or {}
        if not isinstance(settings, dict):
            raise ValueError(f"`settings` must be a JSON object, got {type(settings).__name__}.")
        if decoding not in _REGISTRY:
            logger.warning("Decoding %r (from hf_paralleldecode %s) is not available in this version.",
                           decoding, version)
        else:
            params = decoding_settings(decoding)
            dropped = sorted(k for k in settings if k not in params)
            if dropped:
                logger.warning("Ignoring settings %s of decoding %r unknown to this version.", dropped, decoding)
            fields["settings"] = {k: v for k, v in settings.items() if k in params}
        config = object.__new__(cls)  # no strict __post_init__ checks: the data came from a file
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(config, f.name, fields.get(f.name, default))
        return config

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **push_kwargs) -> Path:
        from . import __version__

        save_directory = Path(save_directory)
        if save_directory.is_file():
            raise ValueError(f"save_directory {save_directory} is a file; pass a directory.")
        save_directory.mkdir(parents=True, exist_ok=True)
        self.library_version = __version__
        path = save_directory / CONFIG_NAME
        path.write_text(self.to_json_string())
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
        return cls.from_dict(data)

    @classmethod
    def exists_in(cls, directory: str | os.PathLike) -> bool:
        return (Path(directory) / CONFIG_NAME).is_file()

    def push_to_hub(self, repo_id: str, commit_message: str = "Upload parallel decoding config", **kwargs) -> str:
        """Upload ``parallel_decoding_config.json`` to ``repo_id`` (created if needed)."""
        from huggingface_hub import HfApi

        api = HfApi(token=kwargs.pop("token", None))
        api.create_repo(repo_id, exist_ok=True, private=kwargs.pop("private", None))
        with tempfile.TemporaryDirectory() as tmp:
            path = self.save_pretrained(tmp)
            info = api.upload_file(
                path_or_fileobj=str(path), path_in_repo=CONFIG_NAME, repo_id=repo_id,
                commit_message=commit_message, **kwargs,
            )
        return str(info)
