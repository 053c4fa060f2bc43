"""EAGLE-3 drafters: ``Eagle3Config`` / ``Eagle3Drafter``, an autoregressive drafter on fused target features.

Reference: Li et al., *EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test* (arXiv:2503.01840); layouts of the EAGLE / SpecForge and ``speculators`` checkpoints.

What it is
    The outputs of a few target layers (``target_layer_ids``, output of layer ``i``: usually a low, a
    middle and a high one) are concatenated and fused by ``fc`` (optionally normalised first:
    ``norm_before_fc``, ``fc_norm``). The first decoder layer reads ``[input_layernorm(e) ;
    hidden_norm(g)]`` (width ``2H``), where ``e`` is the embedding of a token and ``g`` the fused
    features of the position before it (or, deeper in a draft, the drafter's own previous output); its
    residual is ``g`` (``hidden_norm(g)`` with ``norm_before_residual``). Further layers are plain
    pre-norm decoder layers. ``lm_head`` maps the final norm to a *draft vocabulary* of ``Vd`` tokens;
    ``d2t`` maps draft ids to target ids (``target = draft + d2t[draft]``), so ``q`` is zero outside it.

Taps a checkpoint does not record (decision)
    The EAGLE authors' checkpoints (``LlamaForCausalLMEagle3``, ``midlayer.*``) name no tapped layers: their
    target code (``modeling_llama_kv``) and vLLM (``get_eagle3_aux_hidden_state_layers``) take the residual
    stream *entering* decoder layers ``2``, ``L // 2`` and ``L - 3`` of the target at hand, in layer order,
    each once (hidden-state indices, where index 0 is the embeddings). In this project's convention (output of
    layer ``i``) those are the outputs of layers ``1``, ``L // 2 - 1`` and ``L - 4``
    (:func:`reference_tap_layers`). Such a drafter keeps ``target_layer_ids = None`` and applies the rule to the
    target it is bound to (:meth:`Eagle3Drafter.bind`; ``check_target`` refuses a target too shallow for three
    distinct taps); an export writes the ids of the bound target.

Slots (one layout for training and inference: :func:`ttt_step_mask`, :meth:`Eagle3Drafter.forward`)
    A slot pairs ``g_t`` (features of committed position ``t``) with token ``x_{t+1}`` at RoPE position
    ``t`` and predicts ``x_{t+2}``. The last committed token (the root) sits in the *root slot*
    ``(g_{n-1}, x_n)``; a tree node ``v`` at depth ``d`` is the slot ``(h(parent), x_v)`` at position
    ``n + d - 1`` that sees the context, its ancestors' slots and itself, so its output gives the
    children of ``v`` (branch-conditioned: ``expansion = "branches"``). Training-time test (TTT) feeds
    the same slots: step ``j`` pairs the drafter's own output of step ``j - 1`` with the token ``j``
    further on, seeing the context up to its anchor and its own earlier steps.

What it deliberately does not know
    How the tree is grown, budgeted or verified (``decoding/speculative.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..compat import HeadPreTrainedModel, activation, apply_rotary, rotary_embedding
from .base import (
    CardSaving,
    Drafter,
    DrafterState,
    default_target_layer_ids,
    register_drafter_kind,
    target_facts,
)
from .context import DrafterContext, DraftNodes, DraftStep
from .formats import (
    PROJECT_KEY,
    DrafterFormat,
    hs_to_layer_ids,
    layer_config,
    layer_settings,
    load_strict,
    project_facts,
    read_tensors,
    speculators_config,
    write_checkpoint,
)
from .loading import load_drafter

__all__ = ["Eagle3Config", "Eagle3Drafter", "EAGLE3_FORMATS", "ttt_step_mask", "reference_tap_layers"]

LAYER_TYPES = ("llama", "qwen3")  # the drafter layer's family: qwen3 adds q_norm / k_norm
#: target layers EAGLE-3's reference rule fuses (:func:`reference_tap_layers`)
REFERENCE_TAPS = 3


def reference_tap_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default taps for a target of ``num_layers`` decoder layers, as output-of-layer ids: the residual
    stream entering layers ``2``, ``L // 2``, ``L - 3`` (each once, in layer order) is the output of the layer
    before. A shallow target can give fewer than :data:`REFERENCE_TAPS` ids, or ``-1`` (the embeddings): callers
    check."""
    inputs = sorted({2, num_layers // 2, num_layers - 3} & set(range(num_layers)))
    return [i - 1 for i in inputs]


class Eagle3Config(PretrainedConfig):
    """Configuration of an :class:`Eagle3Drafter` and of the target it drafts for.

    Args:
        target_layer_ids: target layers (output of layer ``i``) whose outputs are fused; ``None``: not recorded
            (the EAGLE authors' checkpoints), EAGLE-3's reference rule for the target the drafter is bound to
            (:func:`reference_tap_layers`: the inputs of layers ``2``, ``L // 2`` and ``L - 3``).
        target_hidden_size: the target's hidden size (``fc`` reads :attr:`num_taps` of them).
        target_vocab_size: the target's vocabulary size (``None``: unknown, checked through ``d2t``).
        target_num_hidden_layers: the target's decoder layers (``None``: unknown).
        target_model_type: the target's ``model_type``.
        target_name_or_path: the target's folder or Hub id.
        draft_vocab_size: ``Vd``, rows of ``lm_head`` (``d2t`` maps them to target ids when smaller).
        layer_type: ``"llama"`` or ``"qwen3"`` (QK-norm).
        hidden_size: the drafter's width; equals the target's (it reads target embeddings).
        intermediate_size: the MLP size.
        num_hidden_layers: decoder layers (the first reads ``2H``).
        num_attention_heads: attention heads.
        num_key_value_heads: key/value heads.
        head_dim: head dimension.
        rms_norm_eps: RMSNorm epsilon.
        rope_parameters: transformers' RoPE settings (``rope_type``, ``rope_theta``, scaling).
        max_position_embeddings: the positions the RoPE settings assume.
        hidden_act: the MLP activation.
        norm_before_residual: the first layer's residual is ``hidden_norm(g)`` instead of ``g``.
        norm_before_fc: an RMSNorm over the concatenated features before ``fc``.
        fc_norm: one RMSNorm per tapped layer before ``fc``.
        norm_output: the fed-back state is the final-normed one (EAGLE 3.1).
        own_embeddings: the drafter holds its own token embedding (else it reads the target's).
        fc_bias: ``fc`` has a bias (SGLang's ``bias``).
        default_depth: ``tree_depth`` when a call does not set it (EAGLE's ``depth``).
        initializer_range: standard deviation of the random initialisation.
    """

    model_type = "hf_paralleldecode_eagle3"

    def __init__(self, target_layer_ids: list[int] | None = None, target_hidden_size: int = 64,
                 target_vocab_size: int | None = 32000, target_num_hidden_layers: int | None = None,
                 target_model_type: str | None = None, target_name_or_path: str | None = None,
                 draft_vocab_size: int | None = None, layer_type: str = "llama", hidden_size: int | None = None,
                 intermediate_size: int | None = None, num_hidden_layers: int = 1, num_attention_heads: int = 4,
                 num_key_value_heads: int | None = None, head_dim: int | None = None, rms_norm_eps: float = 1e-6,
                 rope_parameters: dict | None = None, max_position_embeddings: int = 32768, hidden_act: str = "silu",
                 norm_before_residual: bool = False, norm_before_fc: bool = False, fc_norm: bool = False,
                 norm_output: bool = False, own_embeddings: bool = False, fc_bias: bool = False,
                 default_depth: int = 6, initializer_range: float = 0.02, **kwargs):
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"`layer_type` must be one of {LAYER_TYPES}, got {layer_type!r}.")
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else None
        self.target_hidden_size = int(target_hidden_size)
        self.target_vocab_size = target_vocab_size
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.hidden_size = int(hidden_size or target_hidden_size)
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(f"hidden_size ({self.hidden_size}) must equal target_hidden_size ({target_hidden_size}): "
                             "an EAGLE-3 drafter reads the target's token embeddings.")
        self.draft_vocab_size = int(draft_vocab_size or target_vocab_size)
        if target_vocab_size is not None and self.draft_vocab_size > target_vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target's {target_vocab_size}.")
        self.layer_type = layer_type
        self.intermediate_size = int(intermediate_size or 3 * self.hidden_size)
        self.num_hidden_layers = int(num_hidden_layers)
        self.num_attention_heads = int(num_attention_heads)
        self.num_key_value_heads = int(num_key_value_heads or num_attention_heads)
        self.head_dim = int(head_dim or self.hidden_size // num_attention_heads)
        self.rms_norm_eps = float(rms_norm_eps)
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.max_position_embeddings = int(max_position_embeddings)
        self.hidden_act = hidden_act
        self.norm_before_residual, self.norm_before_fc, self.fc_norm = norm_before_residual, norm_before_fc, fc_norm
        self.norm_output, self.own_embeddings, self.fc_bias = norm_output, own_embeddings, fc_bias
        self.default_depth = int(default_depth)
        self.initializer_range = initializer_range
        for name in ("num_hidden_layers", "default_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {getattr(self, name)}.")
        ids = self.target_layer_ids
        if ids is not None and (not ids or min(ids) < 0 or (
                target_num_hidden_layers is not None and max(ids) >= target_num_hidden_layers)):
            raise ValueError(f"target_layer_ids {ids} must be non-empty and within the target's layers.")
        super().__init__(**kwargs)

    @property
    def num_taps(self) -> int:
        """Target layers ``fc`` fuses: the recorded ones, else the three of EAGLE-3's reference rule."""
        return len(self.target_layer_ids) if self.target_layer_ids is not None else REFERENCE_TAPS

    @property
    def reduced_vocab(self) -> bool:
        return self.target_vocab_size is None or self.draft_vocab_size != self.target_vocab_size


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config, width: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        if c.layer_type == "qwen3":
            self.q_norm = _RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = _RMSNorm(self.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer_idx):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act = activation(c.hidden_act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A pre-norm decoder layer; the first one reads ``[input_layernorm(e) ; hidden_norm(g)]``."""

    def __init__(self, c: Eagle3Config, first: bool):
        super().__init__()
        self.first, self.norm_before_residual = first, c.norm_before_residual
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        if first:
            self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c, 2 * c.hidden_size if first else c.hidden_size)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, h, embeds, cos, sin, mask, cache, layer_idx):
        if self.first:
            g = self.hidden_norm(h)
            residual = g if self.norm_before_residual else h
            x = torch.cat([self.input_layernorm(embeds), g], dim=-1)
        else:
            residual, x = h, self.input_layernorm(h)
        h = residual + self.self_attn(x, cos, sin, mask, cache, layer_idx)
        return h + self.mlp(self.post_attention_layernorm(h))


def ttt_step_mask(context: torch.Tensor, steps: int) -> torch.Tensor:
    """Training-time test: the mask ``[B, T, (steps + 1) * T]`` of TTT step ``steps`` (0-based). Slot ``t`` of
    step ``j`` sees the step-0 slots ``context[:, t]`` allows (the committed prefix up to its anchor) and its own
    slots of steps ``1..j``: what a tree node sees at inference (the context, its ancestors, itself)."""
    B, T, _ = context.shape
    eye = torch.eye(T, dtype=torch.bool, device=context.device)[None].expand(B, -1, -1)
    return torch.cat([context] + [eye] * steps, dim=-1)


_SPECULATORS_EAGLE3_NAMES = (("layers.", "layers."),)
_ORIGINAL_EAGLE3_NAMES = (("midlayer.", "layers.0."),)

#: the layouts an EAGLE-3 drafter reads
EAGLE3_FORMATS = (
    DrafterFormat("hf_paralleldecode EAGLE-3 drafter", "eagle3",
                  lambda c: c.get("model_type") == Eagle3Config.model_type),
    DrafterFormat("speculators eagle3", "eagle3", lambda c: c.get("speculators_model_type") == "eagle3"),
    DrafterFormat("EAGLE-3 (original EAGLE / SpecForge layout)", "eagle3",
                  lambda c: "speculators_model_type" not in c and (
                      any("Eagle3" in a or "EAGLE3" in a.upper() for a in c.get("architectures") or [])
                      or ("draft_vocab_size" in c and c.get("num_hidden_layers") == 1 and "dflash_config" not in c)),
                  renames=_ORIGINAL_EAGLE3_NAMES),
)


def _eagle3_settings(fmt: DrafterFormat, c: dict, folder, tensors: dict) -> dict:
    """``Eagle3Config`` keyword arguments from a speculators or original EAGLE-3 config."""
    own = c.get(PROJECT_KEY) or {}
    if fmt is EAGLE3_FORMATS[1]:
        layer = dict(c.get("transformer_layer_config") or {})
        ids = c.get("eagle_aux_hidden_state_layer_ids")
        taps = hs_to_layer_ids(ids, fmt.name, folder) if ids else None
        flags = {k: bool(c.get(k, False)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
        vocab = layer.get("vocab_size")
        layer_type = layer.get("model_type", "llama")
        verifier = ((c.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        depth = (((c.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]).get("speculative_tokens")
    else:
        layer = c
        ec = c.get("eagle_config") or {}
        ids = ec.get("eagle_aux_hidden_state_layer_ids")
        taps = [int(i) for i in ids] if ids else None  # SpecForge / SGLang write output-of-layer ids
        flags = dict(norm_before_residual=bool(c.get("norm_before_residual", False)))
        vocab = c.get("vocab_size")
        layer_type = "llama"
        verifier, depth = None, None
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"{folder}: this {fmt.name} drafter's layers are {layer_type!r}; supported: {LAYER_TYPES}.")
    sizes = layer_settings(layer, fmt.name, folder)
    # taps None (the EAGLE authors' checkpoints record none): the reference rule for the bound target (module docstring)
    draft_vocab = int(c.get("draft_vocab_size") or tensors.get("lm_head.weight", torch.empty(0)).shape[0] or vocab)
    if "t2d" in tensors:
        vocab = int(tensors["t2d"].shape[0])
    target_hidden = int(c.get("target_hidden_size") or sizes["hidden_size"])
    fc = tensors.get("fc.weight")
    count = len(taps) if taps is not None else REFERENCE_TAPS
    if fc is not None and fc.shape[1] != count * target_hidden:
        named = (f"the config names {count} tapped layers" if taps is not None else
                 f"the config records no tapped layers, and EAGLE-3's reference rule taps {count}")
        raise ValueError(f"{folder}: fc reads {fc.shape[1]} features but {named} of {target_hidden}.")
    settings = dict(target_layer_ids=taps, target_hidden_size=target_hidden, target_vocab_size=vocab,
                    target_name_or_path=verifier, draft_vocab_size=draft_vocab, layer_type=layer_type,
                    own_embeddings="embed_tokens.weight" in tensors, fc_bias="fc.bias" in tensors,
                    **{k: v for k, v in sizes.items() if k != "rope_theta"}, **flags)
    if depth:
        settings["default_depth"] = int(depth)
    settings.update({k: v for k, v in own.items() if k.startswith("target_") or k == "default_depth"})
    return settings


@register_drafter_kind
class Eagle3Drafter(CardSaving, Drafter, HeadPreTrainedModel):
    """An EAGLE-3 drafter (see module docstring). Build one with :meth:`for_target`; load any EAGLE-3 layout with
    :func:`hf_paralleldecode.load_drafter`."""

    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    kind = "eagle3"
    expansion = "branches"
    upload_message = "Upload EAGLE-3 drafter"
    FORMATS = EAGLE3_FORMATS

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        c = config
        k = c.num_taps
        if c.norm_before_fc:
            self.input_norm = _RMSNorm(k * c.target_hidden_size, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList([_RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(k)])
        self.fc = nn.Linear(k * c.target_hidden_size, c.hidden_size, bias=c.fc_bias)
        self.layers = nn.ModuleList([_Layer(c, i == 0) for i in range(c.num_hidden_layers)])
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if c.own_embeddings:
            self.embed_tokens = nn.Embedding(c.target_vocab_size or c.draft_vocab_size, c.hidden_size)
        if c.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(c.target_vocab_size or c.draft_vocab_size, dtype=torch.bool))
        self.rotary = rotary_embedding(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                       head_dim=c.head_dim, rope_parameters=c.rope_parameters,
                                       max_position_embeddings=c.max_position_embeddings)
        self._target = []  # borrowed at run time (never registered, saved or moved)
        self.post_init()

    def init_module_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, self.config.initializer_range)
        elif isinstance(module, _RMSNorm):
            module.weight.data.fill_(1.0)

    # ---- building and checking -----------------------------------------------------------------
    @classmethod
    def for_target(cls, target_model, num_hidden_layers: int = 1, target_layer_ids: list[int] | None = None,
                   draft_vocab_size: int | None = None, **overrides) -> Eagle3Drafter:
        """A randomly initialised drafter for ``target_model``: EAGLE's default taps (inputs of layers ``2``,
        ``L // 2``, ``L - 3``, i.e. outputs of ``1``, ``L // 2 - 1``, ``L - 4``; small targets: spread evenly),
        the target's attention shape and RoPE, the full vocabulary unless ``draft_vocab_size`` is given (then
        the first ``draft_vocab_size`` ids until :meth:`set_draft_vocab` picks the frequent ones)."""
        facts = target_facts(target_model)
        cfg = target_model.config.get_text_config() if hasattr(target_model.config, "get_text_config") \
            else target_model.config
        L = facts["target_num_hidden_layers"]
        if target_layer_ids is None:
            target_layer_ids = reference_tap_layers(L) if L >= 8 else default_target_layer_ids(L, 3)
        heads = getattr(cfg, "num_attention_heads", 4)
        rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        kwargs = dict(target_layer_ids=target_layer_ids, num_hidden_layers=num_hidden_layers,
                      draft_vocab_size=draft_vocab_size or facts["target_vocab_size"],
                      layer_type="qwen3" if getattr(cfg, "model_type", "") == "qwen3" else "llama",
                      num_attention_heads=heads, num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                      head_dim=getattr(cfg, "head_dim", None) or facts["target_hidden_size"] // heads,
                      intermediate_size=getattr(cfg, "intermediate_size", None),
                      rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6), rope_parameters=rope,
                      max_position_embeddings=getattr(cfg, "max_position_embeddings", 32768) or 32768,
                      target_name_or_path=getattr(cfg, "name_or_path", None) or None, **facts)
        kwargs.update(overrides)
        drafter = cls(Eagle3Config(**kwargs))
        if drafter.config.reduced_vocab:
            drafter.set_draft_vocab(torch.arange(drafter.config.draft_vocab_size))
        drafter.to(dtype=target_model.dtype, device=target_model.device)
        return drafter.eval()

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``Vd`` target token ids (e.g. the most frequent in the training data); they are
        sorted and written to ``d2t`` / ``t2d`` as EAGLE and speculators do."""
        if self.d2t.is_meta:  # built on the meta device (a dry run): sizes only
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique().sort().values
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"set_draft_vocab needs {self.config.draft_vocab_size} distinct ids, got {ids.numel()}.")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    def draft_token_ids(self) -> torch.Tensor:
        """``[Vd]`` the target id of every draft id."""
        ids = torch.arange(self.config.draft_vocab_size, device=self.lm_head.weight.device)
        return ids + self.d2t if self.config.reduced_vocab else ids

    def check_target(self, target_model, tokenizer=None) -> None:
        """``ValueError`` naming the mismatch when ``target_model`` is not the drafter's target."""
        facts = target_facts(target_model)
        c = self.config
        wrong = [f"{key[len('target_'):].replace('_', ' ')}: drafter expects {getattr(c, key)}, target has {value}"
                 for key, value in facts.items()
                 if key != "target_model_type" and getattr(c, key) is not None and getattr(c, key) != value]
        layers = facts["target_num_hidden_layers"]
        if c.target_layer_ids is None:
            taps = reference_tap_layers(layers)
            if len(taps) != c.num_taps or min(taps) < 0:
                raise ValueError(
                    f"This EAGLE-3 drafter records no tapped layers, and EAGLE-3's reference rule (the inputs of layers "
                    f"2, L // 2 and L - 3) does not give {c.num_taps} distinct layers for a target with {layers} layers. "
                    "Use a drafter trained for this target, or add its taps to the drafter's config.json "
                    "(eagle_config.eagle_aux_hidden_state_layer_ids, output of layer i).")
        elif max(c.target_layer_ids) >= layers:
            wrong.append(f"tapped layers {c.target_layer_ids}: the target has {layers} layers")
        if c.reduced_vocab and int(self.draft_token_ids().max()) >= facts["target_vocab_size"]:
            wrong.append(f"draft vocabulary maps to ids past the target's {facts['target_vocab_size']}")
        if wrong:
            raise ValueError("This EAGLE-3 drafter was built for another target (" + "; ".join(wrong) + "). Load the "
                             "drafter trained for this model, or build one with Eagle3Drafter.for_target(model).")

    def bind(self, target_model) -> Eagle3Drafter:
        self.check_target(target_model)
        self._target[:] = [target_model]
        return self

    # ---- running ------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: the drafter's own, else the target's input-embedding rows."""
        if self.config.own_embeddings:
            return self.embed_tokens(ids.to(self.embed_tokens.weight.device))
        if not self._target:
            raise ValueError("This EAGLE-3 drafter reads the target's embeddings: call drafter.bind(target_model).")
        weight = self._target[0].get_input_embeddings().weight
        return F.embedding(ids.to(weight.device), weight).to(self.dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``g``: the tapped target features ``[b, s, k * H]`` fused to ``[b, s, H]``."""
        x = features.to(self.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([n(part) for n, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def forward(self, embeds, hidden, positions, mask, cache=None):
        """One pass over slots ``(hidden, embeds)`` ``[b, s, H]`` at ``positions`` ``[b, s]``; ``mask`` ``[b, s, keys]``
        (bool; keys = cached slots + these). Returns ``(state fed back [b, s, H], draft logits [b, s, Vd])``."""
        cos, sin = self.rotary(hidden, positions)
        add = torch.where(mask, torch.zeros((), dtype=hidden.dtype, device=hidden.device),
                          torch.finfo(hidden.dtype).min)
        h = hidden
        for i, layer in enumerate(self.layers):
            h = layer(h, embeds, cos, sin, add, cache, i)
        normed = self.norm(h)
        return (normed if self.config.norm_output else h), self.lm_head(normed)

    def target_logits(self, draft_logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Draft logits ``[..., Vd]`` as logits over the target's ``vocab`` (``-inf`` outside the draft vocabulary)."""
        if not self.config.reduced_vocab and draft_logits.shape[-1] == vocab:
            return draft_logits.float()
        out = draft_logits.new_full((*draft_logits.shape[:-1], vocab), float("-inf"), dtype=torch.float32)
        out[..., self.draft_token_ids().to(out.device)] = draft_logits.float()
        return out

    # ---- the Drafter interface -------------------------------------------------------------------------
    @property
    def tap_layers(self) -> list[int]:
        """The fused target layers: the recorded ones, else EAGLE-3's reference rule for the bound target (or the
        recorded target depth)."""
        c = self.config
        if c.target_layer_ids is not None:
            return list(c.target_layer_ids)
        layers = target_facts(self._target[0])["target_num_hidden_layers"] if self._target else \
            c.target_num_hidden_layers
        if layers is None:
            raise ValueError("This EAGLE-3 drafter records no tapped layers: EAGLE-3's reference rule takes them from "
                             "the target's depth. Bind it to its target first: drafter.bind(target_model).")
        return reference_tap_layers(layers)

    @property
    def default_depth(self) -> int:
        return self.config.default_depth

    def describe(self) -> str:
        return "EAGLE-3 drafter"

    def start(self, context: DrafterContext, depth: int, denoise_steps: int | None = None) -> Eagle3State:
        return Eagle3State(context, self)

    # ---- loading and saving ------------------------------------------------------------------------------
    @classmethod
    def read_checkpoint(cls, fmt: DrafterFormat, folder, config: dict) -> Eagle3Drafter:
        tensors = read_tensors(folder)
        if fmt is EAGLE3_FORMATS[0]:
            drafter_config = Eagle3Config.from_pretrained(folder)
        else:
            settings = _eagle3_settings(fmt, config, folder, tensors)
            drafter_config = Eagle3Config(**settings)
            if not drafter_config.reduced_vocab:  # a full vocabulary needs no map (EAGLE writes it anyway)
                tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
        drafter = cls(drafter_config)
        load_strict(drafter, tensors, fmt, folder)
        return drafter.eval()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """A drafter saved by :meth:`save_pretrained`, a shipped alias, or any EAGLE-3 layout (strict)."""
        drafter = load_drafter(pretrained_model_name_or_path, cache=False, **kwargs)
        if not isinstance(drafter, cls):
            raise ValueError(f"{pretrained_model_name_or_path!s} holds a {type(drafter).__name__}, not an EAGLE-3 "
                             "drafter: load it with hf_paralleldecode.load_drafter(...).")
        return drafter

    # ---- exporting (formats: hf_paralleldecode.drafters.export) ------------------------------------------
    EXPORT_FORMATS = ("speculators", "eagle3")

    def export(self, directory: Path, format: str, verifier=None) -> Path:
        """Write the drafter in ``format``: vLLM speculators' ``eagle3`` or the original EAGLE / SpecForge layout."""
        config = _eagle3_export_config(self, format, verifier)
        directory.mkdir(parents=True, exist_ok=True)
        return write_checkpoint(directory, config, _eagle3_export_weights(self, format))

    def model_card(self) -> str:
        c = self.config
        return ("---\nlibrary_name: hf_paralleldecode\ntags:\n- speculative-decoding\n- eagle3\n"
                + (f"base_model: {c.target_name_or_path}\n" if c.target_name_or_path else "") + "---\n\n"
                f"# EAGLE-3 drafter\n\nA {c.num_hidden_layers}-layer EAGLE-3 drafter for "
                f"`{c.target_name_or_path or c.target_model_type}` (fused target layers "
                f"{c.target_layer_ids or 'by the EAGLE-3 reference rule'}, draft "
                f"vocabulary {c.draft_vocab_size}).\n\n```python\nimport hf_paralleldecode as hfpd\n\n"
                "target = hfpd.load_model(TARGET)\nout = target.generate(**inputs, decoding=\"speculative\", "
                "drafter=DRAFTER)\n```\n")


def _eagle3_export_config(drafter, format: str, verifier) -> dict:
    c = drafter.config
    facts = project_facts(c, default_depth=c.default_depth)
    if format == "eagle3":
        if c.layer_type != "llama" or c.num_hidden_layers != 1 or c.norm_before_fc or c.fc_norm or c.norm_output:
            raise ValueError("The original EAGLE-3 layout holds one Llama-style layer with no extra norms; export this "
                             "drafter with format='speculators'.")
        layer = layer_config(c, drafter.dtype, "llama", ("LlamaForCausalLMEagle3",))
        layer.update(draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.target_hidden_size,
                     norm_before_residual=c.norm_before_residual,
                     eagle_config={"eagle_aux_hidden_state_layer_ids": drafter.tap_layers,
                                   "use_aux_hidden_state": True}, **facts)
        return layer
    layer = layer_config(c, drafter.dtype, c.layer_type, ("LlamaForCausalLM" if c.layer_type == "llama"
                                                           else "Qwen3ForCausalLM",))
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in drafter.tap_layers],
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm,
        "norm_output": c.norm_output, "embed_requires_grad": False, "tie_word_embeddings": False,
        "dtype": layer["dtype"],
        "speculators_config": speculators_config("eagle3", c.default_depth, verifier, c.target_name_or_path),
        **facts,
    }


def _eagle3_export_weights(drafter, format: str) -> dict[str, torch.Tensor]:
    tensors = dict(drafter.state_dict())
    if format == "eagle3":
        tensors = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v
                   for k, v in tensors.items()}
    elif "embed_tokens.weight" not in tensors:  # speculators saves the (frozen) embeddings it drafts with
        if not drafter._target:
            raise ValueError("A speculators EAGLE-3 export carries the token embeddings: bind the drafter to its "
                             "target first (drafter.bind(model)).")
        tensors["embed_tokens.weight"] = drafter._target[0].get_input_embeddings().weight
    return tensors


class Eagle3State(DrafterState):
    """An EAGLE-3 drafter's side of one call: its KV cache of context slots ``(g_t, x_{t+1})`` per row, the slots
    committed since the last step (the last of them is the root slot), and this step's tree slots."""

    def __init__(self, context: DrafterContext, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter, self.taps, self.vocab = drafter, context.taps, context.vocab
        self.open_cache(context.prompt.shape[0], context.device, drafter.dtype)
        feats = self.taps.features().to(context.device)  # [b, P, F] of the prefill
        nxt = torch.cat([context.prompt[:, 1:], context.first_tokens[:, None]], dim=1)  # x_{t+1} of every position t
        self.pending = (feats, nxt, context.prompt_positions, context.prompt_mask)
        self._buf = None  # [b, nodes, H] this step's output state of every node (see _states)

    def _forward(self, embeds, hidden, positions, visible_new) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``s`` new slots; ``visible_new`` ``[b, s, block + s]`` among this step's slots; every new slot also
        sees every valid cached context slot."""
        b, s = positions.shape
        ctx = self.slots.valid[:, None, :].expand(b, s, -1)
        t0 = time.perf_counter()
        out = self.drafter(embeds, hidden, positions, torch.cat([ctx, visible_new], dim=-1), self.slots.cache)
        self.seconds += time.perf_counter() - t0
        self.forwards += 1
        self.fed_tokens += b * s
        return out

    def _feed_pending(self) -> torch.Tensor:
        """Put the committed slots into the context (causal among themselves); return the root slots' states."""
        feats, tokens, positions, valid = self.pending
        b, m = tokens.shape
        causal = torch.ones(m, m, dtype=torch.bool, device=tokens.device).tril()
        visible = (causal[None] & valid[:, None, :]) | torch.eye(m, dtype=torch.bool, device=tokens.device)[None]
        assert self.step_slots == 0
        state, logits = self._forward(self.drafter.embed(tokens), self.drafter.fuse(feats), positions, visible)
        self.slots.valid = torch.cat([self.slots.valid, valid], dim=1)
        self.pending = None
        return state[:, -1], logits[:, -1]  # the root slot is the last column of every row

    def _states(self, b: int, nodes: int) -> torch.Tensor:
        """This step's output state of every node ``[b, nodes, H]`` (grown as the trees grow)."""
        if self._buf is None or self._buf.shape[1] < nodes or self._buf.shape[0] != b:
            grown = torch.zeros(b, max(nodes, 2 * (0 if self._buf is None else self._buf.shape[1])),
                                self.drafter.config.hidden_size, dtype=self.drafter.dtype, device=self.slots.valid.device)
            if self._buf is not None and self._buf.shape[0] == b:
                grown[:, : self._buf.shape[1]] = self._buf
            self._buf = grown
        return self._buf

    def expand(self, step: DraftStep, nodes: DraftNodes) -> torch.Tensor:
        b, device = nodes.batch, step.roots.device
        host = nodes.host
        if 0 in host.nodes:  # the first wave: the root slots (and the slots committed before them)
            assert all(v == 0 for v in host.nodes)
            state, logits = self._feed_pending()
            self._states(b, 1)[:, 0] = state
            return self.drafter.target_logits(logits[nodes.rows], self.vocab)
        s = nodes.width
        base = self.step_slots
        vr, vq, vk = [], [], []  # (row, slot, key slot) pairs that may attend: the host lists first, one write after
        for i, k, v, parent in zip(host.rows, host.index, host.nodes, host.parents):
            for a in self.place(i, v, parent, base + k):  # ancestors below the root (the root slot is context)
                vr.append(i)
                vq.append(k)
                vk.append(a)
        ri_t, ki_t = nodes.rows, nodes.index
        buf = self._states(b, max(host.nodes) + 1)
        tokens = torch.zeros(b, s, dtype=torch.long, device=device)
        tokens[ri_t, ki_t] = nodes.tokens
        hidden = torch.zeros(b, s, self.drafter.config.hidden_size, dtype=self.drafter.dtype, device=device)
        hidden[ri_t, ki_t] = buf[ri_t, nodes.parents]
        pos = step.root_pos[:, None].repeat(1, s)
        pos[ri_t, ki_t] = nodes.positions - 1
        visible = torch.zeros(b, s, base + s, dtype=torch.bool, device=device)
        visible[:, torch.arange(s), base + torch.arange(s)] = True  # every slot sees itself
        if vr:
            visible[torch.tensor(vr, device=device), torch.tensor(vq, device=device), torch.tensor(vk, device=device)] = True
        state, logits = self._forward(self.drafter.embed(tokens), hidden, pos, visible)
        self.step_slots += s
        buf[ri_t, nodes.nodes] = state[ri_t, ki_t]
        return self.drafter.target_logits(logits[ri_t, ki_t], self.vocab)

    def update(self, step: DraftStep, tree, verdict) -> None:
        """The committed slots of the next step: ``(g_{n+i}, committed token i)`` for the root and the accepted
        nodes (features from the verification forward), right-aligned so each row's new root slot is last."""
        feats = self.taps.features().to(tree.tokens.device)  # [active, nodes, F]
        n = verdict.num_accepted + 1  # [b] slots per row
        m = int(n.max())
        cols = torch.arange(m, device=n.device)
        shift = (m - n)[:, None]
        idx = (cols[None] - shift).clamp(min=0)
        path = verdict.path[:, :m].clamp(min=0).gather(1, idx)
        kept = feats.gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))
        new = (kept, verdict.tokens[:, :m].gather(1, idx), step.root_pos[:, None] + idx, cols[None] >= shift)
        # a step that drafted nothing left its slots queued: both go in, the new root slot last
        self.pending = new if self.pending is None else tuple(torch.cat(p, dim=1) for p in zip(self.pending, new))

    def select(self, kept) -> None:
        super().select(kept)
        self._buf = None
        if self.pending is not None:
            self.pending = tuple(t[kept] for t in self.pending)
