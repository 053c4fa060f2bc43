"""Draft heads: ``DraftHeadConfig`` / ``DraftHead``, a small network on the target's own hidden states.

References: JetSpec (Hu et al., *JetSpec: Breaking the Scaling Ceiling of Speculative Decoding with
Parallel Tree Drafting*, arXiv:2606.18394) and DFlash (block-diffusion draft heads, arXiv:2602.06036).

What it is
    The outputs of a few target decoder layers (``target_layer_ids``, "output of layer i") are
    concatenated, projected by a bias-free linear layer and an RMSNorm, and injected as extra
    keys/values into every layer of a small Qwen3-style decoder (QK-norm, SwiGLU, no biases).
    The head borrows the target's input embeddings and LM head at run time and never saves them.

Module layout (decision)
    The body *is* transformers' own DFlash drafter, ``MuseGlimmerAssistantModel`` (context
    projection ``encoder.fc`` + ``encoder.output_norm_enc``, ``layers.*``, ``norm``), held as
    ``self.model``. Its forward accepts a ready-made 4D mask (a ``{"full_attention": mask}``
    dict), so the same module runs both head kinds: ``"block_bidirectional"`` (DFlash) and
    ``"tree_causal"`` (JetSpec, Eq. 8: a slot sees its ancestors and itself) -- no copy of its
    modeling code here, and the transformers export is the body's state dict as is.

Slot conventions (what the head is trained for and drafts with: :func:`block_layout`)
    A block starts at the *anchor* (the last committed token, whose target features are not
    known yet) at position ``p``. A slot whose input is ``mask_token_id`` at position ``p + d``
    predicts the token at ``p + d``.
    * ``block_bidirectional`` (DFlash): ``[anchor, MASK x block_size]``, all slots see each other:
      one forward gives per-depth marginals ``q_d`` for depths ``1..block_size``.
    * ``block_causal`` (the JetSpec authors' released heads, ``causal_head``): the same slots under a
      causal mask (slot ``d`` sees the anchor and the masks before it): per-depth marginals.
    * ``tree_causal``: a tree node ``u`` (depth ``d``) is a real-token slot at ``p + d``; the
      distribution of its children comes from a MASK *query* slot at ``p + d + 1`` that sees
      ``u``, ``u``'s ancestors and itself: ``q(y | x, pi(u))``, branch-conditioned (Eq. 10).
      Training feeds one branch (the committed tokens) per anchor: a chain of the inference tree.

What it deliberately does not know
    How trees are grown or verified (``decoding/speculative.py``, ``engine/verify.py``); it hands
    the tree grower per-depth marginals (block heads) or the children of given nodes (``tree_causal``)
    through :class:`HeadState`, the :class:`~.base.DrafterState` of a call.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from ..compat import HeadPreTrainedModel, cache_kwargs, dflash_classes, set_body_attn_implementation
from ..engine.cache import additive_mask
from .base import (
    SHIPPED_DRAFTERS,
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

__all__ = ["DraftHeadConfig", "DraftHead", "HEAD_ATTENTIONS", "EMBEDDED_HEADS", "default_target_layer_ids",
           "block_layout"]

logger = logging.getLogger(__name__)

#: ``tree_causal``: branch-conditioned (this project's JetSpec Eq. 10 head: real-token slots + MASK queries);
#: ``block_bidirectional``: DFlash; ``block_causal``: the JetSpec authors' released heads (``causal_head``):
#: ``[anchor, MASK x block]`` under a causal mask, per-depth marginals from one forward
HEAD_ATTENTIONS = ("tree_causal", "block_bidirectional", "block_causal")

#: shipped heads for the embedded model (``DraftHead.from_pretrained("default-jetspec")``) -> folder under assets/
EMBEDDED_HEADS = {k: v for k, v in SHIPPED_DRAFTERS.items() if k in ("default-jetspec", "default-dflash")}


class DraftHeadConfig(PretrainedConfig):
    """Configuration of a :class:`DraftHead` and of the target it was built for.

    Args:
        attention: ``"tree_causal"`` (branch-conditioned), ``"block_bidirectional"`` (DFlash) or
            ``"block_causal"`` (the JetSpec authors' heads).
        block_size: drafted positions per block (the anchor comes on top).
        mask_token_id: a row of the target's input embedding used for MASK slots.
        target_layer_ids: target decoder layers whose outputs feed the head.
        target_hidden_size: the target's hidden size. This and the four ``target_*`` fields below
            describe the target the head belongs to (checked before any forward).
        target_vocab_size: the target's vocabulary size (``None``: unknown, as in an imported
            checkpoint that does not record it; ``mask_token_id`` is then checked against the target).
        target_num_hidden_layers: the target's number of decoder layers (``None``: unknown; the tapped
            layers are then checked against the target).
        target_model_type: the target's ``model_type``.
        target_name_or_path: the target's folder or Hub id.
        hidden_size: the body's hidden size (a Qwen3-style decoder); it equals the target's, since
            the head reads the target's embeddings and writes through its LM head. Default: the
            target's.
        intermediate_size: the body's MLP size (default: 3 x ``hidden_size``).
        num_hidden_layers: the body's decoder layers.
        num_attention_heads: the body's attention heads.
        num_key_value_heads: the body's key/value heads (default: ``num_attention_heads``).
        head_dim: the body's head dimension (default: ``hidden_size // num_attention_heads``).
        rms_norm_eps: the body's RMSNorm epsilon.
        rope_theta: the body's RoPE base.
        rope_parameters: the body's whole RoPE settings (transformers' ``rope_parameters``, e.g. an
            imported head's scaling); default: ``{"rope_type": "default", "rope_theta": rope_theta}``.
        max_position_embeddings: the body's maximum position.
        hidden_act: the body's MLP activation.
        initializer_range: standard deviation of the random initialisation.
    """

    model_type = "hf_paralleldecode_draft_head"

    def __init__(
        self,
        attention: str = "tree_causal",
        block_size: int = 16,
        mask_token_id: int = 0,
        target_layer_ids: list[int] | None = None,
        target_hidden_size: int = 64,
        target_vocab_size: int | None = 32000,
        target_num_hidden_layers: int | None = 4,
        target_model_type: str | None = None,
        target_name_or_path: str | None = None,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 32768,
        hidden_act: str = "silu",
        initializer_range: float = 0.02,
        **kwargs,
    ):
        if attention not in HEAD_ATTENTIONS:
            raise ValueError(f"`attention` must be one of {HEAD_ATTENTIONS}, got {attention!r}.")
        for name, value, low in [("block_size", block_size, 1), ("num_hidden_layers", num_hidden_layers, 1),
                                 ("target_hidden_size", target_hidden_size, 1)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}.")
        self.attention = attention
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else [0]
        self.target_hidden_size = target_hidden_size
        self.target_vocab_size = target_vocab_size
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.hidden_size = hidden_size or target_hidden_size
        if self.hidden_size != target_hidden_size:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must equal target_hidden_size ({target_hidden_size}): the head "
                "reads the target's embeddings and writes through the target's LM head."
            )
        self.intermediate_size = intermediate_size or 3 * self.hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or self.hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rope_parameters = dict(rope_parameters) if rope_parameters else None
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        top = target_num_hidden_layers if target_num_hidden_layers is not None else float("inf")
        bad = [i for i in self.target_layer_ids if not 0 <= i < top]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must be non-empty and within 0..{top - 1}."
            )
        if mask_token_id < 0 or (target_vocab_size is not None and mask_token_id >= target_vocab_size):
            raise ValueError(f"mask_token_id {mask_token_id} is not a row of the target's {target_vocab_size}-row vocabulary.")
        super().__init__(**kwargs)

    def assistant_config(self):
        """The body's config: transformers' ``MuseGlimmerAssistantConfig`` (DFlash drafter)."""
        return dflash_classes()[0](
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings, sliding_window=self.max_position_embeddings,
            layer_types=["full_attention"] * self.num_hidden_layers, hidden_act=self.hidden_act,
            block_size=self.block_size + 1, mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids), bos_token_id=None, eos_token_id=None, pad_token_id=None,
            initializer_range=self.initializer_range,
        )


def _is_dflash_family(c: dict) -> bool:
    return "speculators_model_type" not in c and ("dflash_config" in c or any(
        "DFlash" in a for a in c.get("architectures") or []))


_ENGINE_NAMES = (("model.fc.", "model.encoder.fc."), ("model.hidden_norm.", "model.encoder.output_norm_enc."),
                 ("model.layers.", "model.layers."), ("model.norm.", "model.norm."),
                 ("fc.", "model.encoder.fc."), ("hidden_norm.", "model.encoder.output_norm_enc."),
                 ("layers.", "model.layers."), ("norm.", "model.norm."))

#: the layouts a draft head reads (``load_drafter`` tries each kind's formats in turn)
HEAD_FORMATS = (
    DrafterFormat("hf_paralleldecode draft head", "head",
                  lambda c: c.get("model_type") == "hf_paralleldecode_draft_head"),
    DrafterFormat("transformers DFlash assistant (MuseGlimmerAssistantModel)", "head",
                  lambda c: c.get("model_type") == "muse_glimmer_assistant",
                  renames=(("model.", "model."), ("encoder.", "model.encoder."), ("layers.", "model.layers."),
                           ("norm.", "model.norm."))),
    DrafterFormat("speculators dflash", "head", lambda c: c.get("speculators_model_type") == "dflash",
                  renames=_ENGINE_NAMES),
    DrafterFormat("z-lab DFlash / JetSpec", "head", _is_dflash_family, renames=_ENGINE_NAMES),
)


def _head_settings(fmt: DrafterFormat, c: dict, folder) -> dict:
    """``DraftHeadConfig`` keyword arguments from a DFlash-family config (z-lab, JetSpec, transformers, speculators)."""
    name = fmt.name
    own = c.get(PROJECT_KEY) or {}
    if fmt.name.startswith("speculators"):
        layer = dict(c.get("transformer_layer_config") or {})
        if c.get("sample_from_anchor"):
            raise ValueError(f"{folder}: a speculators dflash drafter with sample_from_anchor=true drafts the anchor's "
                             "slot too; this project's heads draft after the anchor.")
        vocab = layer.get("vocab_size")
        if c.get("draft_vocab_size") not in (None, vocab):
            raise ValueError(f"{folder}: this speculators dflash drafter has a reduced draft vocabulary "
                             f"({c['draft_vocab_size']} of {vocab}); DFlash heads here draft through the target's "
                             "own LM head.")
        ids = c.get("aux_hidden_state_layer_ids")
        if not ids:
            raise ValueError(f"{folder}: the speculators dflash config has no aux_hidden_state_layer_ids.")
        taps = hs_to_layer_ids(ids, name, folder)
        block, mask = c.get("block_size"), c.get("mask_token_id")
        causal = bool(layer.get("is_causal"))
        target_hidden = c.get("target_hidden_size")
        facts = dict(target_vocab_size=vocab, target_num_hidden_layers=None)
    else:
        layer = c
        dc = c.get("dflash_config") or {}
        for key, default in (("input_embedding_scale", 1), ("output_multiplier", 1), ("final_logit_softcapping", None)):
            if dc.get(key, default) != default:
                raise ValueError(f"{folder}: this {name} drafter sets dflash_config.{key}={dc[key]!r}; only the "
                                 "defaults (scale 1, multiplier 1, no softcapping) are supported.")
        block = dc.get("block_size", c.get("block_size"))
        mask = dc.get("mask_token_id", c.get("mask_token_id"))
        taps = dc.get("target_layer_ids", c.get("target_layer_ids"))
        if taps is None and c.get("num_target_layers") and fmt.name.startswith("z-lab"):
            L, n = int(c["num_target_layers"]), int(c.get("num_hidden_layers") or 1)
            # JetSpec's default: spread evenly from 1 to L - 3 over the drafter's layers, [L // 2] for one layer
            taps = [L // 2] if n == 1 else [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]
        if taps is None and fmt.name.startswith("transformers"):
            taps = [1, 13, 25, 37, 49]  # MuseGlimmerAssistantConfig's default
        causal = bool(dc.get("causal_head") or dc.get("causal") or c.get("is_causal"))
        target_hidden = dc.get("target_hidden_size")
        facts = dict(target_vocab_size=c.get("vocab_size"), target_num_hidden_layers=c.get("num_target_layers"))
    if block is None or mask is None or not taps:
        raise ValueError(f"{folder}: the {name} config lacks " + ", ".join(
            k for k, v in (("block_size", block), ("mask_token_id", mask), ("target_layer_ids", taps)) if not v
            and v != 0) + ".")
    sizes = layer_settings(layer, name, folder)
    if target_hidden is not None and int(target_hidden) != sizes["hidden_size"]:
        raise ValueError(f"{folder}: this {name} drafter's target_hidden_size ({target_hidden}) differs from its "
                         f"hidden_size ({sizes['hidden_size']}); such adapters are not supported.")
    attention = own.get("attention") or ("block_causal" if causal else "block_bidirectional")
    settings = dict(attention=attention, block_size=int(block) - 1, mask_token_id=int(mask),
                    target_layer_ids=[int(i) for i in taps], target_hidden_size=sizes["hidden_size"], **sizes)
    settings.update({k: v for k, v in facts.items()})
    settings.update({k: v for k, v in own.items() if k.startswith("target_") and k != "target_layer_ids"})
    if int(block) < 2:
        raise ValueError(f"{folder}: block_size={block} leaves no drafted position after the anchor.")
    return settings


@register_drafter_kind
class DraftHead(CardSaving, Drafter, HeadPreTrainedModel):
    """A draft head (see module docstring). Build one with :meth:`for_target`, load with ``from_pretrained``
    (or :func:`hf_paralleldecode.load_drafter`, which also imports the DFlash / JetSpec formats)."""

    kind = "head"

    config_class = DraftHeadConfig
    base_model_prefix = "draft_head"
    main_input_name = "noise_embeds"
    upload_message = "Upload draft head"
    def __init__(self, config: DraftHeadConfig):
        super().__init__(config)
        body_config = config.assistant_config()
        set_body_attn_implementation(body_config, "sdpa")
        self.model = dflash_classes()[1](body_config)
        self._target = []  # borrowed at run time (a list, so it is never registered, saved or moved)
        self.post_init()

    def init_module_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(0.0, std)
        elif hasattr(module, "weight") and isinstance(getattr(module, "weight", None), torch.nn.Parameter) and \
                module.weight.dim() == 1:
            module.weight.data.fill_(1.0)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """A head saved by :meth:`save_pretrained`, a shipped alias (:data:`EMBEDDED_HEADS`), or any checkpoint
        format :func:`hf_paralleldecode.load_drafter` reads as a draft head (DFlash, JetSpec, this project's
        exports). Loading is strict: a folder of another kind, or a missing or unexpected weight, raises
        ``ValueError`` naming what was found (never a randomly initialised head)."""
        if args:
            raise ValueError("DraftHead.from_pretrained takes the folder / repo id and keyword options only.")
        kwargs.pop("use_safetensors", None)
        head = load_drafter(pretrained_model_name_or_path, cache=False, **kwargs)
        if not isinstance(head, cls):
            raise ValueError(f"{pretrained_model_name_or_path!s} holds a {type(head).__name__}, not a DraftHead: load it "
                             "with hf_paralleldecode.load_drafter(...).")
        return head

    FORMATS = HEAD_FORMATS

    @classmethod
    def read_checkpoint(cls, fmt: DrafterFormat, folder, config: dict) -> DraftHead:
        """A head from a recognised checkpoint folder (strict: see :func:`~.formats.load_strict`)."""
        if fmt is HEAD_FORMATS[0]:
            head_config = DraftHeadConfig.from_pretrained(folder)
        else:
            head_config = DraftHeadConfig(**_head_settings(fmt, config, folder))
        head = cls(head_config)
        load_strict(head, read_tensors(folder), fmt, folder)
        return head.eval()

    # ---- building and checking ---------------------------------------------------------------
    @classmethod
    def for_target(cls, target_model, attention: str = "tree_causal", num_hidden_layers: int = 1,
                   block_size: int = 16, target_layer_ids: list[int] | None = None, **overrides) -> DraftHead:
        """A randomly initialised head bound to ``target_model`` (sizes, vocabulary, tapped layers).

        ``target_layer_ids`` default to ``max(num_hidden_layers, 3)`` layers spread through the
        target's depth (:func:`default_target_layer_ids`); ``mask_token_id`` defaults to the last
        row of the target's input embedding.
        """
        facts = target_facts(target_model)
        cfg = target_model.config.get_text_config() if hasattr(target_model.config, "get_text_config") \
            else target_model.config
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(facts["target_num_hidden_layers"], max(num_hidden_layers, 3))
        heads = getattr(cfg, "num_attention_heads", 4)
        kwargs = dict(
            attention=attention, block_size=block_size, target_layer_ids=target_layer_ids,
            num_hidden_layers=num_hidden_layers, mask_token_id=facts["target_vocab_size"] - 1,
            num_attention_heads=heads, num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or facts["target_hidden_size"] // heads,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
            rope_theta=float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 32768) or 32768,
            target_name_or_path=getattr(cfg, "name_or_path", None) or None,
            **facts,
        )
        kwargs.update(overrides)
        head = cls(DraftHeadConfig(**kwargs))
        head.to(dtype=target_model.dtype, device=target_model.device)
        return head.eval()

    def check_target(self, target_model, tokenizer=None) -> None:
        """``ValueError`` naming the mismatch when ``target_model`` is not the head's target (facts the
        checkpoint does not record are checked against what the head needs: tapped layers, mask row)."""
        facts = target_facts(target_model)
        wrong = [
            f"{key[len('target_'):].replace('_', ' ')}: head expects {getattr(self.config, key)}, target has {value}"
            for key, value in facts.items()
            if key != "target_model_type" and getattr(self.config, key) is not None and getattr(self.config, key) != value
        ]
        layers, vocab = facts["target_num_hidden_layers"], facts["target_vocab_size"]
        if max(self.config.target_layer_ids) >= layers:
            wrong.append(f"tapped layers {self.config.target_layer_ids}: the target has {layers} layers")
        if self.config.mask_token_id >= vocab:
            wrong.append(f"mask token {self.config.mask_token_id}: the target's vocabulary has {vocab} rows")
        if wrong:
            raise ValueError(
                "This draft head was built for another target (" + "; ".join(wrong) + "). Load the head trained "
                "for this model, or build one with DraftHead.for_target(model)."
            )

    def bind(self, target_model) -> DraftHead:
        """Borrow ``target_model``'s input embeddings and LM head (checked first); returns self."""
        self.check_target(target_model)
        self._target[:] = [target_model]
        return self

    @property
    def target(self):
        if not self._target:
            raise ValueError("This draft head is not bound to a target: call head.bind(target_model) first.")
        return self._target[0]

    # ---- running --------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.get_input_embeddings()(ids.to(self.target.device)).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the target's LM head (fp32)."""
        head = self.target.get_output_embeddings()
        return head(hidden.to(head.weight.dtype)).float()

    def forward(self, noise_embeds, context_features, attention_mask, position_ids, cache=None):
        """Body forward: ``noise_embeds`` ``[b, slots, H]``, ``context_features`` ``[b, ctx, L*H]``
        (new context, appended to ``cache``), 4D additive ``attention_mask``
        ``[b, 1, slots, cached + ctx + slots]``, ``position_ids`` ``[b, ctx + slots]``."""
        out = self.model(
            noise_embeds=noise_embeds, context_hidden_states=context_features.to(self.dtype),
            attention_mask={"full_attention": attention_mask}, position_ids=position_ids,
            use_cache=cache is not None, **cache_kwargs(self.model, cache),
        )
        return out.last_hidden_state

    # ---- the Drafter interface ------------------------------------------------------------------------
    @property
    def expansion(self) -> str:
        return "branches" if self.config.attention == "tree_causal" else "marginals"

    @property
    def tap_layers(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def max_depth(self) -> int | None:
        """A block head drafts at most its block; a ``tree_causal`` head grows branches as deep as asked."""
        return None if self.config.attention == "tree_causal" else self.config.block_size

    @property
    def default_depth(self) -> int:
        return self.config.block_size

    def describe(self) -> str:
        return f"{self.config.attention} head"

    def run_settings(self, depth: int, denoise_steps: int | None = None) -> dict:
        return {"drafter": self.kind, "head": self.config.attention}

    def start(self, context: DrafterContext, depth: int, denoise_steps: int | None = None) -> HeadState:
        return HeadState(context, self)

    # ---- exporting (formats: hf_paralleldecode.drafters.export) ------------------------------------------
    EXPORT_FORMATS = ("transformers", "speculators", "dflash")

    def export(self, directory: Path, format: str, verifier=None) -> Path:
        """Write the head in ``format``: transformers' DFlash assistant (block-bidirectional heads only), vLLM
        speculators' ``dflash`` or the z-lab DFlash layout, from the body's one state dict (only names change)."""
        c = self.config
        causal = c.attention != "block_bidirectional"
        if format == "transformers" and causal:
            raise ValueError(
                f"transformers' DFlash drafter attends bidirectionally inside the block and cannot express a {c.attention} "
                "head's mask. Export it with format='speculators' or 'dflash' (a causal chain), or run it "
                "with decoding='speculative' here."
            )
        if c.attention == "tree_causal":
            logger.warning(
                "Exporting a tree_causal head to %r: other engines run it as a causal chain of MASK slots "
                "([anchor, MASK, MASK, ...]); depth 1 drafts as here, deeper positions lose the branch conditioning "
                "(expect a shorter acceptance length there). It reads back here as a tree_causal head.", format)
        directory.mkdir(parents=True, exist_ok=True)
        dtype = self.dtype
        facts = project_facts(c, attention=c.attention)
        if format == "transformers":
            body = c.assistant_config()
            body.dtype = dtype
            setattr(body, PROJECT_KEY, facts[PROJECT_KEY])
            body.save_pretrained(directory)
            save_file({k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()},
                      directory / "model.safetensors", metadata={"format": "pt"})
            return directory
        layer = layer_config(c, dtype)
        if format == "speculators":
            if causal:
                layer["is_causal"] = True  # vLLM's update_dflash overwrites dflash_config: the flag lives here
            config = {
                "architectures": ["DFlashDraftModel"],
                "speculators_model_type": "dflash",
                "speculators_version": "0.9.0",
                "transformer_layer_config": layer,
                "draft_vocab_size": c.target_vocab_size,
                "target_hidden_size": c.target_hidden_size,
                "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
                "block_size": c.block_size + 1,
                "mask_token_id": c.mask_token_id,
                "sample_from_anchor": False,
                "sliding_window_non_causal": False,
                "tie_word_embeddings": False,
                "dtype": layer["dtype"],
                "speculators_config": speculators_config("dflash", c.block_size, verifier, c.target_name_or_path),
                **facts,
            }
        else:  # dflash (z-lab native)
            config = dict(layer)
            config.update(
                block_size=c.block_size + 1,
                num_target_layers=c.target_num_hidden_layers,
                dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                               "causal": causal, "causal_head": causal, "target_hidden_size": c.target_hidden_size},
                **facts,
            )
        return write_checkpoint(directory, config, _engine_weights(self))

    # ---- saving -----------------------------------------------------------------------------------
    def model_card(self) -> str:
        c = self.config
        kind = "JetSpec tree-causal" if c.attention == "tree_causal" else "DFlash block-bidirectional"
        return (
            "---\nlibrary_name: hf_paralleldecode\ntags:\n- speculative-decoding\n- draft-head\n"
            + (f"base_model: {c.target_name_or_path}\n" if c.target_name_or_path else "")
            + "---\n\n"
            f"# {kind} draft head\n\nA {c.num_hidden_layers}-layer draft head for "
            f"`{c.target_name_or_path or c.target_model_type}` (target layers {c.target_layer_ids}, block size "
            f"{c.block_size}, mask token {c.mask_token_id}). It holds only the head: the target's embeddings and LM "
            "head are borrowed at run time.\n\n```python\nimport hf_paralleldecode as hfpd\n\n"
            "target = hfpd.load_model(TARGET)\nhead = hfpd.DraftHead.from_pretrained(HEAD)\n"
            "out = target.generate(**inputs, decoding=\"speculative\", drafter=head, tree_budget=64)\n```\n\n"
            "Config:\n\n```json\n" + json.dumps({k: v for k, v in c.to_diff_dict().items()
                                                  if k != "transformers_version"}, indent=2, sort_keys=True)
            + "\n```\n"
        )


def block_layout(kind: str, block_size: int, anchors: torch.Tensor, tokens: torch.Tensor, mask_token_id: int):
    """Slots of every anchor's block: the one layout training and inference share.

    ``anchors`` ``[B, A]`` index ``tokens`` ``[B, T]`` (the anchor is the last committed token). Returns
    ``ids`` / ``positions`` ``[B, A * S]`` (positions relative to index 0 of ``tokens``), ``intra``
    ``[S, S]`` (bool, who sees whom inside a block) and ``query`` ``[block_size]``: the slot predicting
    depth ``k`` (``1..block_size``). Inference feeds the same block per row with ``A = 1`` and
    ``tokens = [root]`` (its positions shifted by the root's); ``tree_causal`` training feeds the
    committed branch, which the inference tree's waves feed node by node.
    """
    B, A = anchors.shape
    a = anchors.clamp(min=0)
    k = torch.arange(block_size + 1, device=anchors.device)
    if kind in ("block_bidirectional", "block_causal"):
        S = block_size + 1
        pos = a[..., None] + k  # [B, A, S]
        ids = torch.full((B, A, S), mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = tokens.gather(1, a)
        intra = torch.ones(S, S, dtype=torch.bool, device=anchors.device)
        if kind == "block_causal":
            intra = intra.tril()
        query = torch.arange(1, S, device=anchors.device)
    else:  # tree_causal: real tokens r_0..r_{n-1} at slots 0..n-1, queries m_1..m_n at slots n..2n-1
        n, S = block_size, 2 * block_size
        real_pos = a[..., None] + k[:n]
        real = tokens.gather(1, real_pos.reshape(B, -1).clamp(max=tokens.shape[1] - 1)).reshape(B, A, n)
        ids = torch.cat([real, torch.full((B, A, n), mask_token_id, dtype=torch.long, device=anchors.device)], dim=-1)
        pos = torch.cat([real_pos, real_pos + 1], dim=-1)
        tril = torch.ones(n, n, dtype=torch.bool, device=anchors.device).tril()
        intra = torch.zeros(S, S, dtype=torch.bool, device=anchors.device)
        intra[:n, :n] = tril  # real slots: causal chain
        intra[n:, :n] = tril  # query m_k sees r_0..r_{k-1}
        intra[n:, n:] = torch.eye(n, dtype=torch.bool, device=anchors.device)  # and itself
        query = torch.arange(n, S, device=anchors.device)
    return ids.reshape(B, A * S), pos.reshape(B, A * S), intra, query


def _engine_weights(head) -> dict[str, torch.Tensor]:
    """The body's weights under the DFlash engine names (``fc``, ``hidden_norm``, ``layers.*``, ``norm``)."""
    out = {}
    for name, tensor in head.model.state_dict().items():
        name = name.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm.")
        out[name] = tensor.detach().contiguous().cpu()
    return out


class HeadState(DrafterState):
    """A draft head's side of one call: its KV cache of committed context features (per row, from the
    verification forwards' taps: never an extra target forward) plus this step's block slots."""

    def __init__(self, context: DrafterContext, head: DraftHead):
        super().__init__()
        self.head, self.taps = head, context.taps
        self.mask_id = head.config.mask_token_id
        self.open_cache(context.prompt.shape[0], context.device, head.dtype)
        self.new_feats = None  # context slots queued for the next head forward (see _add_context)
        self._add_context(self.taps.features().to(context.device), context.prompt_positions,
                          context.prompt_mask)  # the prefill

    def _add_context(self, feats, positions, valid):
        """Queue context slots; slots of a step that ran no head forward stay queued before them."""
        if self.new_feats is not None and self.new_feats.shape[1]:
            feats = torch.cat([self.new_feats, feats.to(self.new_feats.dtype)], dim=1)
            positions = torch.cat([self.new_pos, positions], dim=1)
            valid = torch.cat([self.new_valid, valid.bool()], dim=1)
        self.new_feats, self.new_pos, self.new_valid = feats, positions, valid.bool()

    def _run(self, ids, positions, visible) -> torch.Tensor:
        """One head forward over new block slots; ``visible`` ``[b, s, block + s]`` (bool) among block slots."""
        b, s = ids.shape
        n_ctx = self.slots.num_slots
        ctx_valid = torch.cat([self.slots.valid, self.new_valid], dim=1)  # [b, all ctx]
        allowed = torch.cat([ctx_valid[:, None, :].expand(b, s, ctx_valid.shape[1]), visible], dim=-1)
        feats = self.new_feats
        t0 = time.perf_counter()
        hidden = self.head(self.head.embed(ids), feats, additive_mask(allowed, self.head.dtype),
                           torch.cat([self.new_pos, positions], dim=1), self.slots.cache)
        self.seconds += time.perf_counter() - t0
        self.forwards += 1
        self.fed_tokens += b * (s + feats.shape[1])
        self.slots.valid = ctx_valid
        self.new_feats, self.new_pos, self.new_valid = feats[:, :0], self.new_pos[:, :0], self.new_valid[:, :0]
        assert self.slots.cache.get_seq_length() == n_ctx + feats.shape[1] + self.step_slots + s
        self.step_slots += s
        return hidden

    def marginals(self, step: DraftStep) -> torch.Tensor:
        """Block heads: one forward over :func:`block_layout`'s block -> ``[b, block, V]`` for depths ``1..block``."""
        c = self.head.config
        roots = step.roots
        b = roots.shape[0]
        ids, pos, intra, query = block_layout(c.attention, c.block_size, torch.zeros(b, 1, dtype=torch.long,
                                                                                      device=roots.device),
                                              roots[:, None], c.mask_token_id)
        hidden = self._run(ids, step.root_pos[:, None] + pos, intra[None].expand(b, -1, -1))
        return self.head.logits(hidden[:, query])

    def expand(self, step: DraftStep, nodes: DraftNodes) -> torch.Tensor:
        """``tree_causal``: one wave, a (real-token slot, MASK query slot) pair per node; the query sees the node,
        its ancestors' slots (earlier waves of this step) and itself."""
        b, device = nodes.batch, step.roots.device
        s = 2 * nodes.width
        base = self.step_slots
        vr, vq, vk = [], [], []  # (row, slot, key slot) pairs that may attend: the host lists first, one write after
        for i, k, v, parent in zip(nodes.host.rows, nodes.host.index, nodes.host.nodes, nodes.host.parents):
            for a in self.place(i, v, parent, base + 2 * k):
                vr += [i, i]
                vq += [2 * k, 2 * k + 1]
                vk += [a, a]
        ri_t, real_t = nodes.rows, 2 * nodes.index
        query_t = real_t + 1
        ids = torch.full((b, s), self.mask_id, dtype=torch.long, device=device)
        ids[ri_t, real_t] = nodes.tokens
        pos = step.root_pos[:, None].repeat(1, s)
        pos[ri_t, real_t] = nodes.positions
        pos[ri_t, query_t] = nodes.positions + 1
        visible = torch.zeros(b, s, base + s, dtype=torch.bool, device=device)
        visible[:, torch.arange(s), base + torch.arange(s)] = True  # every slot sees itself
        visible[ri_t, query_t, base + real_t] = True  # a query sees its node
        if vr:
            where = torch.tensor([vr, vq, vk], device=device)  # one copy to the device
            visible[where[0], where[1], where[2]] = True
        hidden = self._run(ids, pos, visible)
        return self.head.logits(hidden[ri_t, query_t])

    def update(self, step: DraftStep, tree, verdict) -> None:
        feats = self.taps.features().to(tree.tokens.device)  # [active, nodes, F] of the verification forward
        path = verdict.path.clamp(min=0)  # [active, depth + 1]
        kept = feats.gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))
        self._add_context(kept, step.root_pos[:, None] + tree.depth.gather(1, path), verdict.path >= 0)

    def select(self, kept) -> None:
        super().select(kept)
        self.new_feats, self.new_pos, self.new_valid = self.new_feats[kept], self.new_pos[kept], self.new_valid[kept]
