"""Cost twins: a model made bigger without changing what it computes.

``cost_twin(model, "1b")`` returns a model with the projection sizes of a 1B model whose function, in exact
arithmetic, is ``model``'s: its greedy text, its logits and every token-level drafter's acceptance are the source's,
while each forward costs what a forward of a real model of that shape costs. It makes the cost regime of real models
(a forward of 16 tokens costs about what one costs) measurable with a small model's real acceptance.

How (a pre-norm decoder of the Llama family; source hidden size ``d`` -> ``D``)
    * embeddings and the LM head are padded with zero columns: the twin's hidden state is the source's followed by
      ``D - d`` zeros, in every layer;
    * RMSNorm over ``D`` dims of such a vector sees ``mean(x^2)`` shrunk by ``d / D``: the norm weights are scaled
      by ``sqrt(d / D)`` and the epsilon by ``d / D``, which gives the source's normalised output exactly;
    * attention keeps the source's head size (RoPE depends on it); each source query head takes a slot of the
      twin whose key/value head holds a copy of its source key/value head; the output projection reads only those
      slots (its other columns are zero), so the other heads add nothing;
    * MLP channels beyond the source's are read by zero columns of the down projection;
    * layers beyond the source's are identity residual blocks (zero output and down projections), after the
      source's layers (so the source's hidden states keep their layer indices).
    Weights that meet only zeros or are read by zeros ("dead" weights: the extra heads' and channels' inputs, the
    identity layers' attention and MLP inputs) are random by default, so a forward does the arithmetic of a real
    model on non-zero data; ``dead_weights="zeros"`` makes them zero.

What stays the source's
    The vocabulary (a real model's embedding and LM head are larger: a twin's forward costs a little less than the
    real model's, most at small sizes), the head size, RoPE, the tokenizer and the generation config. In floating
    point the twin's sums run over more (zero) terms in other orders: logits agree to rounding (fp32: ~1e-5), so
    greedy text can differ at near-ties, more often in bf16. Stock ``generate`` on the twin is the reference for
    exactness, as for any model.

Drafters
    A drafter attached to the source that reads only tokens (DEER diffusion drafters) is attached to the twin
    unchanged. Drafters that read the target's hidden states (draft heads, EAGLE-3) are refused with a message:
    their inputs would be the twin's widened states.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from .engine.settings import check_int_setting

__all__ = ["TwinShape", "TWIN_SHAPES", "cost_twin", "twin_shape", "TWIN_ARCHITECTURES", "twin_of", "embedded_twin"]

#: model types whose decoder layers are the pre-norm Llama layout this module widens
TWIN_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class TwinShape:
    """The projection sizes of a twin. ``q_width`` / ``kv_width``: the query and key/value projections' output
    sizes (heads x head size of the real model); the twin keeps the source's head size and takes
    ``q_width / head_dim`` query and ``kv_width / head_dim`` key/value heads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    q_width: int
    kv_width: int
    like: str = "custom"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.name != "like":  # a bool is not a size: True would be a width of 1
                check_int_setting(f"TwinShape.{field.name}", getattr(self, field.name), 1)
        if not isinstance(self.like, str):
            raise ValueError(f"`TwinShape.like` must be a string (the real model of that shape, for records), got "
                             f"{self.like!r} ({type(self.like).__name__}).")


#: named shapes: the projection sizes of real models (the vocabulary stays the source's)
TWIN_SHAPES = {
    "135m": TwinShape(576, 1536, 30, 576, 192, like="SmolLM2-135M"),
    "0.5b": TwinShape(896, 4864, 24, 896, 128, like="Qwen2.5-0.5B"),
    "1b": TwinShape(2048, 8192, 16, 2048, 512, like="Llama-3.2-1B"),
    "3b": TwinShape(3072, 8192, 28, 3072, 1024, like="Llama-3.2-3B"),
    "8b": TwinShape(4096, 14336, 32, 4096, 1024, like="Llama-3.1-8B"),
}


def twin_shape(shape) -> TwinShape:
    """A :class:`TwinShape` from a name of :data:`TWIN_SHAPES`, a ``TwinShape`` or a dict of its fields."""
    if isinstance(shape, TwinShape):
        return shape
    if isinstance(shape, str):
        key = shape.lower()
        if key not in TWIN_SHAPES:
            raise ValueError(f"Unknown twin shape {shape!r}; choose one of {sorted(TWIN_SHAPES)} or pass a TwinShape.")
        return TWIN_SHAPES[key]
    if isinstance(shape, dict):
        known = {f.name for f in dataclasses.fields(TwinShape)}
        unknown = sorted(set(shape) - known)
        if unknown:
            raise TypeError(f"Unknown TwinShape field(s) {unknown}; known: {sorted(known)}.")
        return TwinShape(**shape)
    raise TypeError(f"shape must be a name, a TwinShape or a dict, not {type(shape).__name__}.")


def _head_slots(q_heads: int, kv_heads: int, twin_q: int, twin_kv: int) -> tuple[list[int], list[int]]:
    """``(q_slot, kv_source)``: the twin's query slot of each source query head, and for each twin key/value head
    the source key/value head it copies (-1: none). A source key/value head is copied to as many twin key/value
    heads as its query heads need."""
    group, twin_group = q_heads // kv_heads, twin_q // twin_kv
    copies = math.ceil(group / twin_group)
    if kv_heads * copies > twin_kv:
        raise ValueError(
            f"A twin with {twin_q} query / {twin_kv} key-value heads cannot hold the source's {q_heads} / {kv_heads} "
            "(each source key-value head needs a twin key-value head whose query group holds its query heads): "
            "widen q_width or kv_width."
        )
    kv_source = [-1] * twin_kv
    q_slot = []
    for h in range(q_heads):
        k, i = divmod(h, group)
        twin_k = k * copies + i // twin_group
        kv_source[twin_k] = k
        q_slot.append(twin_k * twin_group + i % twin_group)
    return q_slot, kv_source


def _rows(weight: torch.Tensor, slots: list[int], head_dim: int) -> torch.Tensor:
    """Row indices of the twin for each source head's rows, in source order."""
    return torch.cat([torch.arange(s * head_dim, (s + 1) * head_dim) for s in slots]).to(weight.device)


def cost_twin(model, shape="1b", *, dtype: torch.dtype | None = None, device=None, dead_weights: str = "random",
              seed: int = 0):
    """A model of ``shape``'s size computing ``model``'s function (see the module docstring).

    ``shape``: a name of :data:`TWIN_SHAPES` (``"135m"``, ``"0.5b"``, ``"1b"``, ``"3b"``, ``"8b"``), a :class:`TwinShape` or a
    dict of its fields. ``dtype`` / ``device``: the twin's (default: the source's); the twin is built there directly
    (an 8B twin in bf16 needs 16 GB there, nothing on the host). The twin is enabled
    (``generate(decoding=...)``) and carries the source's decoding config and its token-level drafter.
    """
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from .integration import attach_drafter, attached_drafter, enable

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"cost_twin takes a transformers causal LM of the pre-norm Llama layout ({', '.join(TWIN_ARCHITECTURES)}: "
            "AutoModelForCausalLM.from_pretrained(...) or hf_paralleldecode.load_model(...)), got "
            f"{type(model).__name__}. For an embedded model by name, use embedded_twin(name, shape).")
    if dead_weights not in ("random", "zeros"):
        raise ValueError(f"dead_weights must be 'random' or 'zeros', not {dead_weights!r}.")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"`dtype` must be a torch.dtype (torch.float32, torch.bfloat16, ...) or None (the source's), "
                         f"got {dtype!r} ({type(dtype).__name__}).")
    check_int_setting("seed", seed, 0)
    shape = twin_shape(shape)
    src = model.config
    model_type = getattr(src, "model_type", None)
    if model_type not in TWIN_ARCHITECTURES:
        raise ValueError(
            f"cost_twin widens the pre-norm Llama layout ({', '.join(TWIN_ARCHITECTURES)}); this model is "
            f"{model_type!r}. Build the twin of a model of one of those architectures."
        )
    d, m, layers = src.hidden_size, src.intermediate_size, src.num_hidden_layers
    q_heads, kv_heads = src.num_attention_heads, src.num_key_value_heads or src.num_attention_heads
    head_dim = getattr(src, "head_dim", None) or d // q_heads
    if shape.q_width % head_dim or shape.kv_width % head_dim:
        raise ValueError(f"The shape's q_width {shape.q_width} and kv_width {shape.kv_width} must be multiples of the "
                         f"source's head size {head_dim} (the twin keeps it: RoPE depends on it).")
    twin_q, twin_kv = shape.q_width // head_dim, shape.kv_width // head_dim
    if twin_q % twin_kv:
        raise ValueError(f"q_width / kv_width must give whole query groups: {twin_q} query, {twin_kv} key-value heads.")
    smaller = [name for name, have, want in (("hidden_size", d, shape.hidden_size),
                                               ("intermediate_size", m, shape.intermediate_size),
                                               ("num_hidden_layers", layers, shape.num_hidden_layers),
                                               ("query heads", q_heads, twin_q), ("key-value heads", kv_heads, twin_kv))
               if want < have]
    if smaller:
        raise ValueError(f"A twin can only be as large as its source or larger; {', '.join(smaller)} would shrink.")
    q_slot, kv_source = _head_slots(q_heads, kv_heads, twin_q, twin_kv)
    drafter = attached_drafter(model)
    if drafter is not None and _reads_hidden_states(drafter):  # before anything is built
        raise ValueError(
            f"The model's attached drafter ({type(drafter).__name__}) reads the target's hidden states, which a "
            "cost twin widens: it cannot draft for the twin. Detach it (build the twin from a model without a "
            "drafter) or use a token-level drafter (a DEER diffusion drafter)."
        )

    config_dict = src.to_dict()
    eps_key = "rms_norm_eps"
    if eps_key not in config_dict:
        raise ValueError(f"cost_twin needs an RMSNorm model ({eps_key!r} in its config); {model_type!r} has none.")
    eps = config_dict[eps_key]
    config_dict.update(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                       num_hidden_layers=shape.num_hidden_layers, num_attention_heads=twin_q,
                       num_key_value_heads=twin_kv, head_dim=head_dim, **{eps_key: eps * d / shape.hidden_size})
    if config_dict.get("layer_types"):
        types = list(config_dict["layer_types"])
        config_dict["layer_types"] = types + [types[-1]] * (shape.num_hidden_layers - layers)
    if "max_window_layers" in config_dict and config_dict["max_window_layers"] == layers:
        config_dict["max_window_layers"] = shape.num_hidden_layers
    config_dict["cost_twin"] = {"like": shape.like, "source_hidden_size": d, "source_intermediate_size": m,
                                "source_num_hidden_layers": layers, "source_num_attention_heads": q_heads,
                                "source_num_key_value_heads": kv_heads, "dead_weights": dead_weights}
    config = type(src).from_dict(config_dict)
    config._attn_implementation = src._attn_implementation

    source = model
    dtype = dtype or next(source.parameters()).dtype
    device = torch.device(device) if device is not None else next(source.parameters()).device
    if device.type == "cpu":
        from . import hardware

        slow = hardware.slow_matmul_message(dtype, f"A {shape.like} cost twin in {str(dtype).replace('torch.', '')}")
        if slow:
            warnings.warn(slow, hardware.SlowMatmulWarning, stacklevel=2)
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=src._attn_implementation)
    twin.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = float(getattr(src, "initializer_range", 0.02) or 0.02)
    src_params = dict(source.named_parameters())
    with torch.no_grad():
        for name, buf in twin.named_buffers():  # RoPE tables: functions of the head size, the source's
            buf.copy_(source.get_buffer(name).to(buf.device, buf.dtype))
        norm_scale = math.sqrt(d / shape.hidden_size)
        for name, p in twin.named_parameters():
            _fill(name, p, src_params, d=d, layers=layers, head_dim=head_dim, q_slot=q_slot, kv_source=kv_source,
                  norm_scale=norm_scale, random=dead_weights == "random", gen=gen, std=std)
    if getattr(src, "tie_word_embeddings", False):
        twin.tie_weights()
    for module in twin.modules():  # per-head norms (Qwen3's q_norm / k_norm) keep the source's epsilon
        if module.__class__.__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None \
                and module.weight.shape[-1] == head_dim and head_dim != shape.hidden_size:
            for attr in ("variance_epsilon", "eps"):
                if hasattr(module, attr):
                    setattr(module, attr, eps)
    twin.generation_config = type(source.generation_config).from_dict(source.generation_config.to_dict())
    twin = enable(twin.eval())
    decoding_config = getattr(source, "parallel_decoding_config", None)
    if decoding_config is not None:
        twin.parallel_decoding_config = decoding_config
    if drafter is not None:
        attach_drafter(twin, drafter if drafter.dtype == dtype and drafter.device == device else
                       drafter.copy_to(device=device, dtype=dtype))
    return twin


def _reads_hidden_states(drafter) -> bool:
    """Whether the drafter's kind taps target layers (draft heads, EAGLE-3): it declares ``tap_layers``. Read off the
    class, not the instance: an unbound EAGLE-3 drafter computes its taps from the target it does not have yet."""
    from .drafters.base import Drafter

    return getattr(type(drafter), "tap_layers", Drafter.tap_layers) is not Drafter.tap_layers


_ZERO_OUTSIDE = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")


def _fill(name, p, src_params, *, d, layers, head_dim, q_slot, kv_source, norm_scale, random, gen, std):
    """Write the twin's parameter ``name``: the source's block where it has one, zeros where the function needs
    them, random (or zero) dead weights elsewhere."""
    parts = name.split(".")
    layer = next((int(x) for x in parts if x.isdigit()), None)
    identity = layer is not None and layer >= layers
    suffix = ".".join(parts[-2:])
    if suffix.endswith("norm.weight") and p.dim() == 1:
        base = 1.0 if identity else 0.0
        p.fill_(base)
        if not identity:
            s = src_params[name]
            if s.shape[0] == d and p.shape[0] != d:  # a hidden-size norm: scaled, padded with zeros
                p[:d] = (s.double() * norm_scale).to(p.dtype)
            else:  # a per-head norm (Qwen3's q_norm / k_norm): unchanged
                p.copy_(s)
        return
    zero_outside = suffix in _ZERO_OUTSIDE or "embed_tokens" in name or name.startswith("lm_head")
    if random and not zero_outside:
        p.normal_(0.0, std, generator=gen)
    else:
        p.zero_()
    if identity:
        return
    if name not in src_params and name.startswith("lm_head") and "model.embed_tokens.weight" in src_params:
        return  # tied to the embeddings (tie_weights after the fill)
    if name not in src_params:
        raise ValueError(f"cost_twin does not know the parameter {name!r} of this model; it widens the Llama "
                         "layout (embed_tokens, q/k/v/o_proj, gate/up/down_proj, RMSNorms, lm_head).")
    s = src_params[name].to(p.device, p.dtype)
    proj = parts[-2]
    if proj == "q_proj":
        rows = _rows(p, q_slot, head_dim)
        p.index_copy_(0, rows, _pad_cols(s, p.shape[-1]) if p.dim() == 2 else s)
    elif proj in ("k_proj", "v_proj"):
        for twin_k, k in enumerate(kv_source):
            if k >= 0:
                block = s[k * head_dim:(k + 1) * head_dim]
                p[twin_k * head_dim:(twin_k + 1) * head_dim] = _pad_cols(block, p.shape[-1]) if p.dim() == 2 else block
    elif proj == "o_proj" and p.dim() == 2:
        cols = _rows(p, q_slot, head_dim)
        p[:d].index_copy_(1, cols, s)
    elif p.dim() == 2 and proj in ("embed_tokens", "lm_head"):
        p[:, :d] = s
    elif p.dim() == 2:  # gate / up ([m, d] -> [M, D]) and down ([d, m] -> [D, M]): the top-left block
        p[:s.shape[0], :s.shape[1]] = s
    else:  # biases: the leading entries (o_proj / down_proj biases, MLP biases)
        p[:s.shape[0]] = s


def _pad_cols(block: torch.Tensor, width: int) -> torch.Tensor:
    if block.shape[-1] == width:
        return block
    out = torch.zeros(*block.shape[:-1], width, dtype=block.dtype, device=block.device)
    out[..., :block.shape[-1]] = block
    return out


def twin_of(name) -> tuple[str, str] | None:
    """``(embedded model, shape)`` for a ``--model`` name ``<embedded>-<shape>`` (``default-1b``,
    ``default-trained-8b``), else ``None``."""
    from .loading import EMBEDDED_MODELS

    if not isinstance(name, str):
        return None
    for source in sorted(EMBEDDED_MODELS, key=len, reverse=True):
        if name.startswith(source + "-") and name[len(source) + 1:].lower() in TWIN_SHAPES:
            return source, name[len(source) + 1:].lower()
    return None


_TWINS: dict = {}


def embedded_twin(source: str, shape: str, *, dtype: torch.dtype = torch.float32, device=None):
    """The cost twin of an embedded model (``"default"`` / ``"default-trained"``) with its decoding config and
    drafter, built on first use and kept for the process (building from the embedded weights takes seconds, less
    than reading a multi-GB copy back from disk; nothing large is written)."""
    from .loading import load_default_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    key = (source, shape, dtype, str(device))
    if key not in _TWINS:
        _TWINS.clear()  # one twin at a time: an 8B twin holds 16 GB
        model, _ = load_default_model(source)
        _TWINS[key] = cost_twin(model, shape, dtype=dtype, device=device)
    return _TWINS[key]
