"""What other projects write: recognising a drafter checkpoint's format, reading its config and weights, and the
pieces every kind's exports share (the layer config other engines read, the verifier a speculators export names).

Each format is a :class:`DrafterFormat`: a name, the drafter kind that reads it, a test on the
folder's ``config.json`` (``architectures``, ``model_type``, ``speculators_model_type``, keys) and a
weight-name map. The kinds (``head.py``, ``eagle3.py``, ``diffusion.py``) turn a recognised config
into their own config and load the mapped weights strictly (:func:`load_strict`): a missing, unexpected
or misshapen tensor raises ``ValueError`` naming the format and the tensors, never a random weight.

Tap conventions (which target layers a drafter reads) differ between projects; every reader converts
to this project's: the *output of decoder layer i* (transformers' DFlash ``target_layer_ids``):
    * z-lab DFlash, JetSpec, transformers' DFlash assistant, this project: output of layer ``i`` as is;
    * ``speculators`` (``aux_hidden_state_layer_ids``, ``eagle_aux_hidden_state_layer_ids``) and vLLM:
      hidden-state index ``k`` = output of layer ``k - 1`` (index 0, the embeddings, cannot be tapped);
    * the original EAGLE-3 layout: ``eagle_config.eagle_aux_hidden_state_layer_ids`` as SpecForge and
      SGLang write them (output of layer ``i``); without ids (the EAGLE authors' checkpoints), EAGLE's
      reference taps, hidden-state indices ``2, L // 2, L - 3`` of the target the drafter is bound to
      (:func:`~.eagle3.reference_tap_layers`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["DrafterFormat", "read_config", "read_tensors", "load_strict", "resolve_folder", "layer_settings",
           "hs_to_layer_ids", "PROJECT_KEY", "layer_config", "project_facts", "resolve_verifier", "speculators_config",
           "write_checkpoint"]

#: the key under which this project's exports record what other formats have no field for (the target's
#: facts, a tree-causal head's attention): other readers ignore it, this project's reader restores it
PROJECT_KEY = "hf_paralleldecode"


@dataclass(frozen=True)
class DrafterFormat:
    """One checkpoint layout a drafter kind reads."""

    name: str
    kind: str
    matches: Callable[[dict], bool]
    #: source tensor name prefix -> this project's module name prefix (first match wins; ``""`` keeps a name)
    renames: tuple[tuple[str, str], ...] = ()
    #: source tensors that are read but not weights of the drafter module (e.g. a vocabulary map)
    extra: tuple[str, ...] = field(default=())

    def rename(self, name: str) -> str:
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name


def resolve_folder(path_or_repo, subfolder: str | None = None, **hub_kwargs) -> Path:
    """A local folder as given, or a Hub repo id downloaded (``huggingface_hub.snapshot_download``)."""
    folder = Path(path_or_repo)
    if folder.is_dir():
        return folder / subfolder if subfolder else folder
    if Path(path_or_repo).exists():
        raise ValueError(f"drafter={str(path_or_repo)!r} is a file, not a checkpoint folder.")
    try:
        from huggingface_hub import snapshot_download

        patterns = [f"{subfolder}/*"] if subfolder else None
        local = Path(snapshot_download(str(path_or_repo), allow_patterns=patterns,
                                       **{k: v for k, v in hub_kwargs.items() if k in ("revision", "token")}))
    except Exception as err:  # noqa: BLE001 - any failure means the drafter cannot be found
        raise ValueError(f"drafter={str(path_or_repo)!r} is neither a local folder nor a Hub repo that could be "
                         f"downloaded ({type(err).__name__}: {err}).") from err
    return local / subfolder if subfolder else local


def read_config(folder: Path) -> dict | None:
    """``config.json`` of a checkpoint folder, or ``None`` when there is none."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: ``model.safetensors``, a sharded safetensors index, or (EAGLE's
    original heads) ``pytorch_model.bin`` read with ``torch.load(weights_only=True)`` (tensors only, no code)."""
    from safetensors.torch import load_file

    single = folder / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out = {}
        for shard in shards:
            out.update(load_file(str(folder / shard)))
        return out
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        state = torch.load(binary, map_location="cpu", weights_only=True)
        return {k: v for k, v in state.items() if torch.is_tensor(v)}
    raise ValueError(f"{folder} holds no weights (model.safetensors, model.safetensors.index.json or "
                     "pytorch_model.bin).")


def load_strict(module: torch.nn.Module, tensors: dict[str, torch.Tensor], fmt: DrafterFormat, folder) -> None:
    """Load ``tensors`` (renamed by ``fmt``) into ``module``: every module weight must be given, with its shape,
    and every given tensor used; otherwise ``ValueError`` naming the format and what is missing or unexpected."""
    state = module.state_dict()
    renamed = {fmt.rename(k): v for k, v in tensors.items() if k not in fmt.extra}
    missing = sorted(set(state) - set(renamed))
    unexpected = sorted(set(renamed) - set(state))
    shapes = sorted(f"{k}: checkpoint {tuple(v.shape)}, expected {tuple(state[k].shape)}"
                    for k, v in renamed.items() if k in state and tuple(v.shape) != tuple(state[k].shape))
    if missing or unexpected or shapes:
        def few(items):
            return ", ".join(items[:6]) + (f" (+{len(items) - 6} more)" if len(items) > 6 else "")

        parts = ([f"missing {few(missing)}"] if missing else []) + ([f"unexpected {few(unexpected)}"] if unexpected
                                                                     else []) + ([f"wrong shape {few(shapes)}"] if shapes else [])
        raise ValueError(f"{folder} looks like a {fmt.name} checkpoint, but its weights do not fit that format: "
                         + "; ".join(parts) + ". Nothing was loaded.")
    with torch.no_grad():
        for k, v in renamed.items():
            state[k].copy_(v.to(state[k].dtype))


def layer_settings(layer: dict, fmt_name: str, folder) -> dict:
    """The decoder sizes of a Qwen3 / Llama style config dict (a drafter's own layers), checked for what this
    project's drafters run: no attention biases and no sliding-window layers narrower than the positions."""
    def need(key):
        if layer.get(key) is None:
            raise ValueError(f"{folder}: the {fmt_name} config has no {key!r}.")
        return layer[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    if layer.get("attention_bias"):
        raise ValueError(f"{folder}: this {fmt_name} drafter has attention biases, which this project's drafter "
                         "layers do not have.")
    max_pos = int(layer.get("max_position_embeddings") or 32768)
    window = layer.get("sliding_window")
    sliding = [t for t in (layer.get("layer_types") or []) if t == "sliding_attention"]
    if sliding and window is not None and int(window) < max_pos:
        raise ValueError(f"{folder}: this {fmt_name} drafter has sliding-window layers (window {window}), which this "
                         "project's drafters do not run; only full-attention drafter layers are supported.")
    rope = layer.get("rope_parameters") or {}
    if not rope:
        rope = dict(layer.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = float(layer.get("rope_theta", 10000.0))
    return dict(
        hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")), num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)), rope_parameters=rope, max_position_embeddings=max_pos,
        hidden_act=layer.get("hidden_act", "silu"),
    )


def hs_to_layer_ids(ids, fmt_name: str, folder) -> list[int]:
    """Hidden-state indices (``speculators`` / vLLM: index ``k`` = output of layer ``k - 1``) -> output-of-layer ids."""
    ids = [int(i) for i in ids]
    if any(i < 1 for i in ids):
        raise ValueError(f"{folder}: this {fmt_name} drafter taps hidden-state index 0 (the embeddings), which this "
                         "project cannot feed it.")
    return [i - 1 for i in ids]


# ---- writing: what every kind's exports share ---------------------------------------------------------------
def layer_config(c, dtype, model_type="qwen3", architectures=("DFlashDraftModel",)) -> dict:
    """The Qwen3 / Llama style layer config other engines read, from a drafter config with the usual sizes."""
    rope = c.rope_parameters or {"rope_type": "default", "rope_theta": c.rope_theta}
    return {
        "model_type": model_type, "architectures": list(architectures), "vocab_size": c.target_vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps, "rope_parameters": dict(rope), "rope_theta": rope.get("rope_theta", 10000.0),
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": ["full_attention"] * c.num_hidden_layers, "attention_bias": False,
        "tie_word_embeddings": False, "dtype": str(dtype).replace("torch.", ""),
    }


def project_facts(c, **extra) -> dict:
    """What the foreign formats have no field for, under :data:`PROJECT_KEY`."""
    keys = ("target_hidden_size", "target_vocab_size", "target_num_hidden_layers", "target_model_type",
            "target_name_or_path")
    return {PROJECT_KEY: {**{k: getattr(c, k) for k in keys}, **extra}}


def resolve_verifier(verifier, default) -> tuple[str, list[str]]:
    """``(name_or_path, architectures)`` of the verifier a speculators export names; ``ValueError`` when it does
    not load (speculators and vLLM read the verifier's embeddings and LM head from it)."""
    if verifier is None:
        verifier = default
    if verifier is None:
        raise ValueError("A speculators export names its verifier (speculators and vLLM load its embeddings and LM "
                         "head): pass verifier= (the target model, its folder or its Hub repo id).")
    if hasattr(verifier, "config"):  # the target model itself
        name = getattr(verifier.config, "name_or_path", None) or ""
        archs = list(getattr(verifier.config, "architectures", None) or [type(verifier).__name__])
        if not name:
            raise ValueError("The target model has no name_or_path: save it (model.save_pretrained(folder)) and pass "
                             "verifier=folder.")
        _, archs_on_disk = resolve_verifier(name, None)
        return name, archs_on_disk or archs
    name = str(verifier)
    folder = Path(name)
    if folder.is_dir():
        config = folder / "config.json"
        if not config.is_file():
            raise ValueError(f"verifier={name!r} is a folder without a config.json: it does not load as a model.")
        archs = json.loads(config.read_text()).get("architectures") or []
        return str(folder.resolve()), list(archs)
    try:
        from transformers import AutoConfig

        archs = AutoConfig.from_pretrained(name).architectures or []
    except Exception as err:  # noqa: BLE001 - whatever the cause, the export would not load elsewhere
        raise ValueError(f"verifier={name!r} is neither a local model folder nor a Hub repo that loads "
                         f"({type(err).__name__}); speculators would fail to load the export. Pass verifier= (the "
                         "target model, its folder or its Hub repo id).") from err
    return name, list(archs)


def speculators_config(algorithm: str, tokens: int, verifier, default_verifier) -> dict:
    """``speculators_config`` of a speculators export: the proposal method and the verifier (which must load)."""
    name, archs = resolve_verifier(verifier, default_verifier)
    if not archs:
        raise ValueError(f"The verifier {name!r} records no architectures (class names) in its config; speculators "
                         "needs them.")
    return {
        "algorithm": algorithm, "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": name, "architectures": archs},
    }


def write_checkpoint(directory: Path, config: dict, tensors: dict) -> Path:
    """``config.json`` and ``model.safetensors`` into ``directory`` (which exists); returns it."""
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    return directory
