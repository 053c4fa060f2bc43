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

Slot conventions (what the head is trained for; ``decoding/speculative.py`` drafts with them)
    A block starts at the *anchor* (the last committed token, whose target features are not
    known yet) at position ``p``. A slot whose input is ``mask_token_id`` at position ``p + d``
    predicts the token at ``p + d``.
    * ``block_bidirectional``: ``[anchor, MASK x block_size]``, all slots see each other: one
      forward gives per-depth marginals ``q_d`` for depths ``1..block_size``.
    * ``tree_causal``: a tree node ``u`` (depth ``d``) is a real-token slot at ``p + d``; the
      distribution of its children comes from a MASK *query* slot at ``p + d + 1`` that sees
      ``u``, ``u``'s ancestors and itself: ``q(y | x, pi(u))``, branch-conditioned (Eq. 10).

What it deliberately does not know
    How trees are built or verified (``decoding/speculative.py``, ``decoding/verify.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PretrainedConfig

from ..compat import HeadPreTrainedModel, cache_kwargs, dflash_classes, set_body_attn_implementation

__all__ = ["DraftHeadConfig", "DraftHead", "HEAD_ATTENTIONS", "EMBEDDED_HEADS", "default_target_layer_ids"]

HEAD_ATTENTIONS = ("tree_causal", "block_bidirectional")

#: the package's shipped checkpoints (the embedded models, heads and drafters)
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

#: shipped heads for the embedded model (``DraftHead.from_pretrained("default-jetspec")``) -> folder under assets/
EMBEDDED_HEADS = {
    "default-jetspec": "stdlib-coder-8m-jetspec-head",  # recipes/draft_head_tiny_cpu.yaml
    "default-dflash": "stdlib-coder-8m-dflash-head",  # recipes/dflash_head_tiny_cpu.yaml
}


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` layers spread evenly over ``1 .. L - 3`` (the last layers are the LM head's business).

    Small targets use every layer they have except the last one.
    """
    if num_target_layers <= 3:
        return sorted({min(i, num_target_layers - 1) for i in range(min(count, num_target_layers))})
    lo, hi = 1, num_target_layers - 3
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def upload_saved(drafter, repo_id: str, commit_message: str, private: bool | None = None, token=None,
                 revision: str | None = None, **kwargs) -> str:
    """Create ``repo_id`` if needed and upload what ``drafter.save_pretrained`` writes (weights, config, card)."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(tmp)
        info = api.upload_folder(folder_path=tmp, repo_id=repo_id, commit_message=commit_message,
                                 revision=revision, **kwargs)
    return str(info)


class DraftHeadConfig(PretrainedConfig):
    """Configuration of a :class:`DraftHead` and of the target it was built for.

    Args:
        attention: ``"tree_causal"`` (JetSpec) or ``"block_bidirectional"`` (DFlash).
        block_size: drafted positions per block (the anchor comes on top).
        mask_token_id: a row of the target's input embedding used for MASK slots.
        target_layer_ids: target decoder layers whose outputs feed the head.
        target_hidden_size: the target's hidden size. This and the four ``target_*`` fields below
            describe the target the head belongs to (checked before any forward).
        target_vocab_size: the target's vocabulary size.
        target_num_hidden_layers: the target's number of decoder layers.
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
        target_vocab_size: int = 32000,
        target_num_hidden_layers: int = 4,
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
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        bad = [i for i in self.target_layer_ids if not 0 <= i < target_num_hidden_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must be non-empty and within 0..{target_num_hidden_layers - 1}."
            )
        if not 0 <= mask_token_id < target_vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is not a row of the target's {target_vocab_size}-row vocabulary.")
        super().__init__(**kwargs)

    def assistant_config(self):
        """The body's config: transformers' ``MuseGlimmerAssistantConfig`` (DFlash drafter)."""
        return dflash_classes()[0](
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings, sliding_window=self.max_position_embeddings,
            layer_types=["full_attention"] * self.num_hidden_layers, hidden_act=self.hidden_act,
            block_size=self.block_size + 1, mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids), bos_token_id=None, eos_token_id=None, pad_token_id=None,
            initializer_range=self.initializer_range,
        )


def _target_facts(target) -> dict:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return dict(
        target_hidden_size=int(config.hidden_size),
        target_vocab_size=int(target.get_input_embeddings().weight.shape[0]),
        target_num_hidden_layers=int(config.num_hidden_layers),
        target_model_type=getattr(config, "model_type", None),
    )


class DraftHead(HeadPreTrainedModel):
    """A draft head (see module docstring). Build one with :meth:`for_target`, load with ``from_pretrained``."""

    config_class = DraftHeadConfig
    base_model_prefix = "draft_head"
    main_input_name = "noise_embeds"
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
        """``PreTrainedModel.from_pretrained``, plus the shipped heads' aliases (:data:`EMBEDDED_HEADS`)."""
        if isinstance(pretrained_model_name_or_path, str) and pretrained_model_name_or_path in EMBEDDED_HEADS:
            pretrained_model_name_or_path = ASSETS_DIR / EMBEDDED_HEADS[pretrained_model_name_or_path]
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    # ---- building and checking ---------------------------------------------------------------
    @classmethod
    def for_target(cls, target_model, attention: str = "tree_causal", num_hidden_layers: int = 1,
                   block_size: int = 16, target_layer_ids: list[int] | None = None, **overrides) -> DraftHead:
        """A randomly initialised head bound to ``target_model`` (sizes, vocabulary, tapped layers).

        ``target_layer_ids`` default to ``max(num_hidden_layers, 3)`` layers spread through the
        target's depth (:func:`default_target_layer_ids`); ``mask_token_id`` defaults to the last
        row of the target's input embedding.
        """
        facts = _target_facts(target_model)
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

    def check_target(self, target_model) -> None:
        """``ValueError`` naming the mismatch when ``target_model`` is not the head's target."""
        facts = _target_facts(target_model)
        wrong = [
            f"{key[len('target_'):].replace('_', ' ')}: head expects {getattr(self.config, key)}, target has {value}"
            for key, value in facts.items()
            if key != "target_model_type" and getattr(self.config, key) != value
        ]
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

    # ---- saving -----------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, **kwargs):
        """Only the head (safetensors) + its config + a model card; the target's weights never."""
        kwargs["safe_serialization"] = True
        out = super().save_pretrained(save_directory, *args, **kwargs)
        readme = Path(save_directory) / "README.md"
        if not readme.exists():
            readme.write_text(self.model_card())
        return out

    def push_to_hub(self, repo_id: str, commit_message: str = "Upload draft head", private: bool | None = None,
                    token=None, revision: str | None = None, **kwargs) -> str:
        """Upload what :meth:`save_pretrained` writes (head, config, this head's model card) to ``repo_id``.

        (The stock ``push_to_hub`` would replace the card with a generic one.)
        """
        return upload_saved(self, repo_id, commit_message, private, token, revision, **kwargs)

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
