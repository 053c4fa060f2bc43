"""Load a checkpoint as an enabled model that defaults to the checkpoint's decoding settings.

Only safetensors weights are read (``use_safetensors=True``); remote code runs only when the
caller passes ``trust_remote_code=True``.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import CONFIG_NAME, ParallelDecodingConfig
from .integration import BUNDLE_DRAFTER_DIR, attach_drafter, enable
from .tokenization import load_tokenizer

__all__ = ["load_model", "load_tokenizer", "default_model_path", "load_default_model", "resolve_model_path",
           "DEFAULT_MODEL_NAME", "EMBEDDED_MODELS"]

DEFAULT_MODEL_NAME = "stdlib-coder-8m"
TRAINED_MODEL_NAME = "stdlib-coder-8m-jacobi-forcing"
#: ``--model`` names of the shipped checkpoints -> their directory under ``assets/``
EMBEDDED_MODELS = {
    "default": DEFAULT_MODEL_NAME,  # the base model (recipes/demo_model/train_demo_model.py)
    "default-trained": TRAINED_MODEL_NAME,  # the base model after consistency training (recipes/benchmarks/e2e_training.sh)
}


def default_model_path(name: str = "default") -> Path:
    """Directory of an embedded model: ``"default"`` (the base demo model, trained by
    ``recipes/demo_model``) or ``"default-trained"`` (the same model after consistency training)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"Unknown embedded model {name!r}; choose one of {sorted(EMBEDDED_MODELS)}.")
    return Path(__file__).parent / "assets" / EMBEDDED_MODELS[name]


def resolve_model_path(name_or_path):
    """The directory of an embedded model for its alias (a key of :data:`EMBEDDED_MODELS`), else the argument."""
    return default_model_path(name_or_path) if name_or_path in EMBEDDED_MODELS else name_or_path


def _find_config(pretrained, hub_kwargs) -> ParallelDecodingConfig | None:
    path = Path(pretrained)
    if path.is_dir():
        return ParallelDecodingConfig.from_pretrained(path) if ParallelDecodingConfig.exists_in(path) else None
    try:
        from huggingface_hub import file_exists

        if not file_exists(str(pretrained), CONFIG_NAME, **hub_kwargs):
            return None
    except Exception:  # offline, private or missing repo: the model load reports the real problem
        return None
    return ParallelDecodingConfig.from_pretrained(pretrained, **hub_kwargs)


def load_model(
    pretrained: str | os.PathLike,
    *,
    decoding_config: ParallelDecodingConfig | None = None,
    drafter=None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    **from_pretrained_kwargs,
):
    """``AutoModelForCausalLM.from_pretrained`` + :func:`enable` + the checkpoint's decoding config.

    If ``pretrained`` holds a ``parallel_decoding_config.json`` (or ``decoding_config`` is given),
    ``model.generate(...)`` uses that decoding and its settings unless the call overrides them.

    Drafters: a bundle (target + ``drafter/`` + a config naming it) loads with its drafter, and
    ``drafter=`` (a :class:`~hf_paralleldecode.DraftHead` or :class:`~hf_paralleldecode.DiffusionDrafter`,
    a path, a Hub repo id or a shipped alias) attaches one to any target; without a config,
    ``generate()`` then defaults to ``decoding="speculative"``. A drafter built for another target
    (or vocabulary / tokenizer) is refused here. The model gets a drafter of its own, on its device and dtype
    (loaded anew, or a copy of the object given): models loaded with the same drafter never share it.
    """
    from transformers import AutoModelForCausalLM

    if from_pretrained_kwargs.get("use_safetensors") is False:
        raise ValueError("hf_paralleldecode only reads safetensors weights; drop use_safetensors=False.")
    if decoding_config is not None and not isinstance(decoding_config, ParallelDecodingConfig):
        raise ValueError(f"`decoding_config` must be a ParallelDecodingConfig (ParallelDecodingConfig(decoding, settings) "
                         f"or ParallelDecodingConfig.from_pretrained(folder)), got {type(decoding_config).__name__}.")
    from_pretrained_kwargs["use_safetensors"] = True
    hub_kwargs = {k: from_pretrained_kwargs[k] for k in ("revision", "token") if k in from_pretrained_kwargs}
    model = AutoModelForCausalLM.from_pretrained(
        pretrained, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
        **from_pretrained_kwargs,
    )
    enable(model)
    config = decoding_config if decoding_config is not None else _find_config(pretrained, hub_kwargs)
    if drafter is None and config is not None and config.drafter is not None:
        drafter = _resolve_drafter_path(pretrained, config.drafter)
    elif drafter is None and config is not None and config.decoding == "speculative" and \
            (Path(pretrained) / BUNDLE_DRAFTER_DIR).is_dir():
        drafter = Path(pretrained) / BUNDLE_DRAFTER_DIR  # a bundle whose config does not name its head
    if drafter is not None:
        from .drafters.loading import own_drafter

        attach_drafter(model, own_drafter(drafter, model, **hub_kwargs))
        if config is None:
            config = ParallelDecodingConfig("speculative")
    if config is not None:
        model.parallel_decoding_config = config
    return model.eval()


def _resolve_drafter_path(pretrained, drafter: str):
    """A bundle's relative folder, else the path or repo id as given."""
    local = Path(pretrained) / drafter
    if Path(pretrained).is_dir():
        return local if local.is_dir() else drafter
    return (str(pretrained), drafter)  # a Hub bundle: (repo id, subfolder)


def load_default_model(name: str = "default", **kwargs):
    """An embedded model and its tokenizer, ``(model, tokenizer)``; ``name`` as in :func:`default_model_path`."""
    path = default_model_path(name)
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"The embedded model {name!r} is missing at {path}; reinstall hf_paralleldecode or rebuild it with "
            "the recipe named in docs/demo-model.md."
        )
    return load_model(path, **kwargs), load_tokenizer(path)
