"""DEER drafters: a masked-diffusion (or masked) LM that drafts a whole block in one denoising step.

Reference: Cheng et al., *DEER: Draft with Diffusion, Verify with Autoregressive Models*
(Tsinghua / SJTU, 2025; ``shared/seeds/deer_project_page.txt``).

What it is
    :class:`DiffusionDrafter` wraps any model that fills masked positions and shares the target's
    vocabulary: a stock ``*ForMaskedLM`` (BERT-style encoder), a LLaDA / Dream-style diffusion LM
    the user loaded with ``trust_remote_code=True`` (the library never loads remote code on its
    own), or a stock decoder (``*ForCausalLM``) run with block-diffusion masks. The drafter gives,
    for a prefix ``x_1..x_j`` and a block of ``k`` mask tokens, the per-position distributions
    ``q_1..q_k`` of the next ``k`` tokens from one forward (DEER: "one-step denoising"); the
    speculative strategy grows its draft tree from them and verifies it in one target forward.

Two attentions (:data:`DIFFUSION_ATTENTIONS`)
    * ``"block_causal"`` (block diffusion, SDAR / Fast-dLLM-v2 style): committed tokens attend
      causally, the block attends to the whole prefix and bidirectionally within itself. The
      prefix's keys/values never depend on the block, so the drafter keeps a KV cache of the
      committed tokens across steps and a step feeds only the newly committed tokens plus the
      block. Needs a model that takes 4D masks, ``position_ids`` and a KV cache
      (transformers' decoder classes with ``sdpa`` or ``eager`` attention).
    * ``"bidirectional"`` (LLaDA, Dream, BERT): every slot sees every slot, so the prefix's
      representation changes as it grows and there is nothing to cache: every step feeds the last
      ``context_window`` committed tokens plus the block (a cost linear in the window, per step;
      ``docs/methods/deer.md`` measures it).

Prediction conventions (``shifted``; one place, :meth:`DiffusionDrafter.query_index`)
    The block is ``[boundary?] + [MASK] * k`` after the *anchor* (the last committed token).
    * ``shifted=False`` (LLaDA, BERT: a masked slot predicts its own token): depth ``d`` is read
      from the ``d``-th mask slot.
    * ``shifted=True`` (Dream: position ``i`` predicts token ``i + 1``): depth ``d`` is read from
      the slot before the ``d``-th mask (the anchor, or the boundary token, for ``d = 1``).
    Training (``training/diffusion_alignment.py``) and drafting use the same function.

Vocabulary
    The drafter's vocabulary may extend the target's by special rows (its mask and boundary tokens
    are usually new rows): ``q`` is read from the target's ``V`` rows only. A drafter with fewer rows
    than the target, one recorded for another vocabulary size, or one whose tokenizer differs from
    the target's (compared by a fingerprint of ``get_vocab()`` when both are known) is refused
    before any forward (:meth:`DiffusionDrafter.check_target`).

What it deliberately does not know
    How trees are built or verified (``decoding/speculative.py``) or how it is trained.

Drafting (:class:`DiffusionState`; ``decoding/speculative.py`` grows the tree and verifies it)
    :meth:`DiffusionState.marginals` gives ``[active, k, V]`` draft logits for depths ``1..k``
    after each row's last committed token (the *anchor*), from one denoising forward of the
    drafter over ``[committed..., boundary?, MASK x k]`` (:class:`DiffusionDrafter`);
    ``k`` is the tree's depth (``tree_depth``, at most the drafter's ``block_size``).
    * ``block_causal`` drafters keep the committed tokens' keys/values in their own
      :class:`~hf_paralleldecode.engine.cache.SlotCache`: a step feeds only the tokens committed since the last step
      (left-padded per row, causal among themselves) plus the block (bidirectional, seeing the
      whole prefix); the block's slots are cut off afterwards. The first step feeds the prompt.
    * ``bidirectional`` drafters have no cache (every prefix token sees the block): a step feeds
      the last ``context_window`` committed tokens of each row plus the block, right-padded.
    * ``denoise_steps > 1``: each further forward re-feeds the block with the most confident
      masked positions filled by their argmax (LLaDA's low-confidence remasking, deterministic);
      a position's ``q`` is the distribution it was unmasked from. Given the drafter's own
      (deterministic) choices these are fixed distributions, so the tree drawn from them is
      verified exactly as a one-step draft: lossless with rejection sampling.
    :meth:`DiffusionState.update` queues the newly committed tokens (accepted drafts + the bonus).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compat import attn_implementation, cache_kwargs
from .base import (
    SHIPPED_DRAFTERS,
    Drafter,
    DrafterState,
    logit_rows,
    register_drafter_kind,
    shipped_drafter_dir,
    target_vocab_size,
)
from .context import DrafterContext, DraftStep
from .formats import DrafterFormat

__all__ = ["DiffusionDrafter", "DiffusionDrafterConfig", "DIFFUSION_ATTENTIONS", "EMBEDDED_DRAFTERS",
           "tokenizer_fingerprint"]

DIFFUSION_ATTENTIONS = ("block_causal", "bidirectional")
DRAFTER_CONFIG_NAME = "diffusion_drafter.json"

#: shipped diffusion drafters (``DiffusionDrafter.from_pretrained("default-deer")``) -> folder under assets/
EMBEDDED_DRAFTERS = {"default-deer": SHIPPED_DRAFTERS["default-deer"]}


def embedded_drafter_dir(name) -> Path | None:
    """The folder of a shipped drafter alias (any kind: :data:`~.base.SHIPPED_DRAFTERS`), else None."""
    return shipped_drafter_dir(name)


def tokenizer_fingerprint(tokenizer, vocab_size: int | None = None) -> str:
    """sha256 of a tokenizer's ``token -> id`` table (ids below ``vocab_size`` when given)."""
    items = sorted((i, t) for t, i in tokenizer.get_vocab().items() if vocab_size is None or i < vocab_size)
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def _int_at_least(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}.")


@dataclasses.dataclass
class DiffusionDrafterConfig:
    """What :class:`DiffusionDrafter` needs beyond the wrapped model (saved as ``diffusion_drafter.json``).

    Args:
        mask_token_id: the wrapped model's mask token.
        block_size: k, masked positions drafted per step (``tree_depth`` at most k).
        attention: ``"block_causal"`` (prefix KV cache) or ``"bidirectional"`` (no cache).
        shifted: ``True`` when position ``i`` predicts token ``i + 1`` (Dream), ``False`` when a
            masked slot predicts its own token (LLaDA, BERT).
        boundary_token_id: DEER's ``[SEP]``: a token placed between the prefix and the masks (in
            training and drafting alike); ``None`` = no boundary token.
        denoise_steps: denoising forwards per draft (1 = DEER's one step). With more, each step
            unmasks the most confident remaining positions and the next step conditions on them.
        context_window: ``"bidirectional"`` only: committed tokens fed per step (the most recent
            ones); default: the model's ``max_position_embeddings`` minus the block, at most 1024.
        target_vocab_size: the target vocabulary it was built / trained for (checked when set).
        tokenizer_fingerprint: :func:`tokenizer_fingerprint` of the target's tokenizer (checked when
            the target's tokenizer can be found).
        target_name_or_path: provenance, for the model card.
    """

    mask_token_id: int
    block_size: int = 16
    attention: str = "block_causal"
    shifted: bool = False
    boundary_token_id: int | None = None
    denoise_steps: int = 1
    context_window: int | None = None
    target_vocab_size: int | None = None
    tokenizer_fingerprint: str | None = None
    target_name_or_path: str | None = None

    def __post_init__(self):
        _int_at_least("mask_token_id", self.mask_token_id, 0)
        _int_at_least("block_size", self.block_size, 1)
        _int_at_least("denoise_steps", self.denoise_steps, 1)
        if self.denoise_steps > self.block_size:
            raise ValueError(f"denoise_steps={self.denoise_steps} exceeds block_size={self.block_size}: each step "
                             "unmasks at least one position. Lower denoise_steps.")
        if self.attention not in DIFFUSION_ATTENTIONS:
            raise ValueError(f"`attention` must be one of {DIFFUSION_ATTENTIONS}, got {self.attention!r}.")
        if not isinstance(self.shifted, bool):
            raise ValueError(f"`shifted` must be True or False, got {self.shifted!r}.")
        if self.boundary_token_id is not None:
            _int_at_least("boundary_token_id", self.boundary_token_id, 0)
            if self.boundary_token_id == self.mask_token_id:
                raise ValueError("boundary_token_id must differ from mask_token_id.")
        if self.context_window is not None:
            _int_at_least("context_window", self.context_window, 1)
        if self.target_vocab_size is not None:
            _int_at_least("target_vocab_size", self.target_vocab_size, 1)

    @property
    def block_length(self) -> int:
        """Slots of a drafted block: the boundary token (if any) and ``block_size`` masks."""
        return self.block_size + (self.boundary_token_id is not None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TOKENIZER_FINGERPRINTS: dict[tuple[str, int], str | None] = {}


def _target_fingerprint(target, vocab: int) -> str | None:
    """Fingerprint of the tokenizer stored next to a local target (``config.name_or_path``), or None."""
    path = getattr(target.config, "name_or_path", None) or ""
    if not path or not Path(path).is_dir():
        return None
    key = (str(Path(path).resolve()), vocab)
    if key not in _TOKENIZER_FINGERPRINTS:
        found = None
        if (Path(path) / "tokenizer.json").is_file() or (Path(path) / "tokenizer_config.json").is_file():
            try:
                from ..tokenization import load_tokenizer

                found = tokenizer_fingerprint(load_tokenizer(path), vocab)
            except Exception:  # noqa: BLE001 - an unreadable tokenizer just means nothing to compare
                found = None
        _TOKENIZER_FINGERPRINTS[key] = found
    return _TOKENIZER_FINGERPRINTS[key]


def _copy_target_weights(model, target, layers: int) -> None:
    """Copy the target's embeddings (+ mean rows for new tokens), first ``layers`` layers, final norm and LM head."""
    from ..engine.target import decoder_layers

    with torch.no_grad():
        for get in ("get_input_embeddings", "get_output_embeddings"):
            mine, theirs = getattr(model, get)(), getattr(target, get)()
            if mine is None or theirs is None:
                continue
            v = theirs.weight.shape[0]
            mine.weight[:v] = theirs.weight
            mine.weight[v:] = theirs.weight.mean(0, keepdim=True)
            if getattr(theirs, "bias", None) is not None and getattr(mine, "bias", None) is not None:
                mine.bias[:v] = theirs.bias
        src, dst = decoder_layers(target), decoder_layers(model)
        for i in range(layers):
            dst[i].load_state_dict(src[i].state_dict())
        # everything else the two share by name and shape (the final norm, rotary buffers)
        theirs = dict(target.state_dict())
        for name, tensor in model.state_dict().items():
            if ".layers." in name or "embed" in name or "lm_head" in name:
                continue
            if name in theirs and theirs[name].shape == tensor.shape:
                tensor.copy_(theirs[name])


@register_drafter_kind
class DiffusionDrafter(Drafter, nn.Module):
    """A masked-diffusion drafter for ``decoding="speculative"`` (see module docstring).

    Args:
        model: the masked / diffusion LM (a ``transformers`` model, or any module whose forward takes
            ``input_ids`` and ``attention_mask`` and returns ``.logits``).
        mask_token_id: its mask token (default: ``model.config.mask_token_id``, then the tokenizer's).
        block_size: see :class:`DiffusionDrafterConfig` (as are the four below).
        attention: defaults to ``"block_causal"`` for a stock ``*ForCausalLM`` and ``"bidirectional"``
            for anything else.
        shifted: see :class:`DiffusionDrafterConfig`.
        boundary_token_id: see :class:`DiffusionDrafterConfig`.
        denoise_steps: see :class:`DiffusionDrafterConfig`.
        context_window: see :class:`DiffusionDrafterConfig`.
        tokenizer: the tokenizer it shares with the target (its fingerprint is recorded and checked).
        target_name_or_path: the target it was made for, recorded in its config.
        config: a whole :class:`DiffusionDrafterConfig` instead of the settings above.
        target_vocab_size: the target vocabulary size, when known.
        vocab_size: rows of the model's logits, for a model that has neither an output embedding nor a
            ``config.vocab_size``.
    """

    def __init__(self, model: nn.Module, mask_token_id: int | None = None, block_size: int = 16,
                 attention: str | None = None,
                 shifted: bool = False, boundary_token_id: int | None = None, denoise_steps: int = 1,
                 context_window: int | None = None, tokenizer: Any = None, target_vocab_size: int | None = None,
                 target_name_or_path: str | None = None, config: DiffusionDrafterConfig | None = None,
                 vocab_size: int | None = None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise ValueError(f"DiffusionDrafter wraps a torch model (a masked / diffusion LM), got {type(model).__name__}.")
        if config is None:
            if mask_token_id is None:
                mask_token_id = getattr(getattr(model, "config", None), "mask_token_id", None)
            if mask_token_id is None and tokenizer is not None:
                mask_token_id = tokenizer.mask_token_id
            if mask_token_id is None:
                raise ValueError("DiffusionDrafter needs mask_token_id= (the wrapped model's mask token): neither the "
                                 "model's config nor the tokenizer names one.")
            if attention is None:
                attention = "block_causal" if type(model).__name__.endswith("ForCausalLM") else "bidirectional"
            config = DiffusionDrafterConfig(
                mask_token_id=mask_token_id, block_size=block_size, attention=attention, shifted=shifted,
                boundary_token_id=boundary_token_id, denoise_steps=denoise_steps, context_window=context_window,
                target_vocab_size=target_vocab_size,
                tokenizer_fingerprint=tokenizer_fingerprint(tokenizer, target_vocab_size) if tokenizer is not None
                else None,
                target_name_or_path=target_name_or_path,
            )
        self.config = config
        self.model = model
        rows = logit_rows(model) or vocab_size
        if rows is None:
            raise ValueError(f"Cannot tell how many vocabulary rows {type(model).__name__}'s logits have (no output "
                             "embedding, no config.vocab_size): pass vocab_size=.")
        self._rows = int(rows)
        self._takes_logits_to_keep = None  # read from the wrapped forward's signature on first use
        for name in ("mask_token_id", "boundary_token_id"):
            value = getattr(config, name)
            if value is not None and value >= rows:
                raise ValueError(f"{name}={value} is not a token of the wrapped model ({rows} rows).")
        if config.attention == "block_causal":
            impl = attn_implementation(model.config) if hasattr(model, "config") else None
            if impl not in (None, "sdpa", "eager"):
                raise ValueError(
                    f"A block_causal drafter feeds 4D block-diffusion masks, which attn_implementation={impl!r} does "
                    "not honour. Load the drafter with attn_implementation='sdpa' (or 'eager')."
                )

    # ---- facts --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the drafter's logits (the target's vocabulary plus any special rows)."""
        return self._rows

    @property
    def max_positions(self) -> int | None:
        config = getattr(self.model, "config", None)
        return getattr(config, "max_position_embeddings", None) if config is not None else None

    @property
    def context_window(self) -> int:
        """Committed tokens a bidirectional drafter reads per step."""
        if self.config.context_window is not None:
            return self.config.context_window
        limit = self.max_positions or 1024 + self.config.block_length
        return max(1, min(1024, limit - self.config.block_length))

    def block_ids(self, length: int | None = None) -> list[int]:
        """The block fed after the anchor: ``[boundary?] + [MASK] * length`` (default ``block_size``)."""
        c = self.config
        masks = c.block_size if length is None else length
        return ([c.boundary_token_id] if c.boundary_token_id is not None else []) + [c.mask_token_id] * masks

    def query_index(self, length: int | None = None) -> torch.Tensor:
        """``[length]`` (default ``block_size``): for depth ``d = 1..length``, the index into ``[anchor] + block``
        of the slot whose logits predict it (see "Prediction conventions" in the module docstring)."""
        first_mask = 1 + (self.config.boundary_token_id is not None)  # index of mask 1 in [anchor] + block
        d = torch.arange(self.config.block_size if length is None else length)
        return first_mask + d - (1 if self.config.shifted else 0)

    # ---- checking -----------------------------------------------------------------------------
    def check_target(self, target, tokenizer=None) -> None:
        """``ValueError`` when the drafter cannot draft for ``target`` (vocabulary or tokenizer differ).

        ``tokenizer``: the target's tokenizer; by default the one saved next to a local target.
        """
        vocab = target_vocab_size(target)
        c = self.config
        if self.vocab_size < vocab:
            raise ValueError(
                f"This diffusion drafter has {self.vocab_size} vocabulary rows, the target {vocab}: it does not share "
                "the target's vocabulary. Use a drafter trained with the target's tokenizer."
            )
        if c.target_vocab_size is not None and c.target_vocab_size != vocab:
            raise ValueError(
                f"This diffusion drafter was built for a {c.target_vocab_size}-token vocabulary, the target has "
                f"{vocab}. Use a drafter trained with the target's tokenizer."
            )
        if c.tokenizer_fingerprint is not None:
            theirs = tokenizer_fingerprint(tokenizer, c.target_vocab_size) if tokenizer is not None else \
                _target_fingerprint(target, c.target_vocab_size or vocab)
            if theirs is not None and theirs != c.tokenizer_fingerprint:
                raise ValueError(
                    "This diffusion drafter was trained with another tokenizer than the target's (their token -> id "
                    "tables differ). Use a drafter trained with the target's tokenizer."
                )
        limit = self.max_positions
        if c.attention == "bidirectional" and limit is not None and self.context_window + c.block_length > limit:
            raise ValueError(
                f"context_window={self.context_window} + the block ({c.block_length} slots) exceeds the drafter's "
                f"max_position_embeddings={limit}. Lower context_window."
            )

    def check_length(self, max_length: int) -> None:
        """Raise ``ValueError`` when drafting for a generation of ``max_length`` tokens would feed the wrapped model a
        position past its learned position table. A block-causal drafter reads every committed position plus its
        block (the last anchor sits at ``max_length - 2``); a bidirectional one reads a window that
        :meth:`check_target` already bounds."""
        from ..engine.support import position_table_size

        if self.config.attention != "block_causal":
            return
        table = position_table_size(self.model)
        if table is None:
            return
        reach = max_length - 1 + self.config.block_length  # positions 0 .. anchor + block
        if reach > table:
            raise ValueError(
                f"This block_causal drafter reads every committed position plus its {self.config.block_length}-slot "
                f"block: a generation of max_length={max_length} reaches {reach} positions, past its "
                f"{table} positions (max_position_embeddings={table}). Lower max_new_tokens to at most "
                f"{table + 1 - self.config.block_length} - prompt length, or use a drafter with a longer table."
            )

    # ---- the Drafter interface ------------------------------------------------------------------------
    kind = "diffusion"
    expansion = "marginals"
    FORMATS = (DrafterFormat("hf_paralleldecode diffusion drafter", "diffusion",
                             lambda c: DRAFTER_CONFIG_NAME in c.get("folder files", ())),)

    @classmethod
    def read_checkpoint(cls, fmt, folder, config: dict) -> DiffusionDrafter:
        return cls.from_pretrained(folder)

    @property
    def max_depth(self) -> int:
        return self.config.block_size

    def describe(self) -> str:
        return "diffusion drafter"

    def check_settings(self, depth: int, tree_waves: int | None, denoise_steps: int | None) -> None:
        super().check_settings(depth, tree_waves, None)
        if denoise_steps is not None and denoise_steps > min(depth, self.config.block_size):
            raise ValueError(f"denoise_steps={denoise_steps} exceeds the block of {min(depth, self.config.block_size)} "
                             "masks: each step unmasks at least one position. Lower denoise_steps.")

    def _steps(self, depth: int, denoise_steps: int | None) -> int:
        return denoise_steps or min(self.config.denoise_steps, depth)

    def run_settings(self, depth: int, denoise_steps: int | None = None) -> dict:
        c = self.config
        return {"drafter": self.kind, "diffusion_attention": c.attention,
                "denoise_steps": self._steps(depth, denoise_steps), "block_size": c.block_size}

    def start(self, context: DrafterContext, depth: int, denoise_steps: int | None = None) -> DiffusionState:
        return DiffusionState(context, self, depth, self._steps(depth, denoise_steps))

    # ---- running ------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
        """The wrapped model's forward (its logits: ``[batch, slots, drafter vocab]``)."""
        extra = {}
        if position_ids is not None:
            extra["position_ids"] = position_ids
        if cache is not None:
            extra.update(cache_kwargs(self.model, cache), use_cache=True)
        elif self.config.attention == "block_causal":
            extra["use_cache"] = False
        keep = kwargs.pop("logits_to_keep", None)
        if keep is not None and self._takes_logits_to_keep is None:
            import inspect

            self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        if keep is not None and self._takes_logits_to_keep:
            extra["logits_to_keep"] = keep
            keep = None
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra, **kwargs).logits
        return logits if keep is None else logits[:, -keep:]

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target, num_hidden_layers: int = 2, block_size: int = 16, attention: str = "block_causal",
                   hidden_size: int | None = None, shifted: bool = False, boundary_token: bool = False,
                   tokenizer=None, init_from_target: bool = False, **overrides) -> DiffusionDrafter:
        """A randomly initialised small drafter for ``target``: its vocabulary plus a mask row (and a boundary
        row with ``boundary_token=True``).

        ``block_causal`` builds a Llama-style decoder (``LlamaForCausalLM``, sdpa) run with block-diffusion
        masks; ``bidirectional`` a BERT encoder (``BertForMaskedLM``). ``hidden_size`` defaults to the
        target's; ``overrides`` go to the model config.

        ``init_from_target=True`` (``block_causal`` only; Dream's recipe of starting a diffusion LM from
        an AR model): the drafter is the target's own class with its first ``num_hidden_layers``
        layers, embeddings, final norm and LM head copied (the new mask / boundary rows start at the
        mean embedding). Pair it with ``shifted=True``, the convention the AR weights already follow.
        """
        import transformers

        if attention not in DIFFUSION_ATTENTIONS:
            raise ValueError(f"`attention` must be one of {DIFFUSION_ATTENTIONS}, got {attention!r}.")
        vocab = target_vocab_size(target)
        tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        hidden = hidden_size or int(getattr(tcfg, "hidden_size", None) or getattr(tcfg, "n_embd", 64))
        heads = int(getattr(tcfg, "num_attention_heads", None) or getattr(tcfg, "n_head", 4))
        if hidden % heads:
            heads = math.gcd(hidden, heads) or 1
        mask_id = vocab
        boundary_id = vocab + 1 if boundary_token else None
        rows = vocab + 1 + bool(boundary_token)
        max_pos = int(getattr(tcfg, "max_position_embeddings", None) or getattr(tcfg, "n_positions", 2048) or 2048)
        if init_from_target:
            if attention != "block_causal":
                raise ValueError("init_from_target copies a decoder's layers: it needs attention='block_causal'.")
            import copy

            cfg = copy.deepcopy(tcfg)
            for key, value in dict(num_hidden_layers=num_hidden_layers, vocab_size=rows, mask_token_id=mask_id,
                                   **overrides).items():
                setattr(cfg, key, value)
            if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
                cfg.layer_types = list(cfg.layer_types)[:num_hidden_layers]
            model = type(target)(cfg)
        elif attention == "block_causal":
            cfg = transformers.LlamaConfig(**{**dict(
                vocab_size=rows, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=num_hidden_layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_pos,
                tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                initializer_range=float(getattr(tcfg, "initializer_range", 0.02)), mask_token_id=mask_id,
            ), **overrides})
            model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.BertConfig(**{**dict(
                vocab_size=rows, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=num_hidden_layers,
                num_attention_heads=heads, max_position_embeddings=min(max_pos, 512 + block_size + 1),
                pad_token_id=0, type_vocab_size=1, mask_token_id=mask_id, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                initializer_range=float(getattr(tcfg, "initializer_range", 0.02)),
            ), **overrides})
            model = transformers.BertForMaskedLM(cfg)
        model.set_attn_implementation("sdpa")
        if init_from_target:
            _copy_target_weights(model, target, num_hidden_layers)
        drafter = cls(model, mask_token_id=mask_id, block_size=block_size, attention=attention, shifted=shifted,
                      boundary_token_id=boundary_id, tokenizer=tokenizer, target_vocab_size=vocab,
                      target_name_or_path=getattr(tcfg, "name_or_path", None) or None)
        return drafter.to(device=target.device, dtype=target.dtype).eval()

    # ---- saving and loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, trust_remote_code: bool = False, **kwargs) -> DiffusionDrafter:
        """Load a folder written by :meth:`save_pretrained` (or a shipped alias, :data:`EMBEDDED_DRAFTERS`).

        A Hub repo id is fetched with ``huggingface_hub.snapshot_download``. ``trust_remote_code`` is
        passed to transformers only when you set it (LLaDA / Dream checkpoints need it).
        """
        from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

        path = embedded_drafter_dir(path) or path
        folder = Path(path)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            hub = {k: kwargs.pop(k) for k in ("revision", "token") if k in kwargs}
            folder = Path(snapshot_download(str(path), **hub))
        spec = folder / DRAFTER_CONFIG_NAME
        if not spec.is_file():
            raise ValueError(f"{folder} holds no {DRAFTER_CONFIG_NAME}: it is not a DiffusionDrafter folder.")
        config = DiffusionDrafterConfig(**json.loads(spec.read_text()))
        model_config = folder / "config.json"
        arch = (json.loads(model_config.read_text()).get("architectures") or [""])[0] if model_config.is_file() else ""
        # the saved class decides: a decoder (block_causal, or wrapped bidirectionally), a masked LM, else AutoModel
        auto = AutoModelForCausalLM if arch.endswith("ForCausalLM") else \
            AutoModelForMaskedLM if arch.endswith("ForMaskedLM") else AutoModel
        kwargs.setdefault("use_safetensors", True)
        kwargs.setdefault("attn_implementation", "sdpa")
        model = auto.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)
        return cls(model, config=config).eval()

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """The wrapped model (safetensors), ``diffusion_drafter.json`` and a model card."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        kwargs["safe_serialization"] = True
        self.model.save_pretrained(out, **kwargs)
        (out / DRAFTER_CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2, sort_keys=True) + "\n")
        readme = out / "README.md"
        if not readme.exists():
            readme.write_text(self.model_card())

    def push_to_hub(self, repo_id: str, commit_message: str = "Upload diffusion drafter", private: bool | None = None,
                    token=None, revision: str | None = None, **kwargs) -> str:
        """Upload what :meth:`save_pretrained` writes to ``repo_id``."""
        from .base import upload_saved

        return upload_saved(self, repo_id, commit_message, private, token, revision, **kwargs)

    def model_card(self) -> str:
        c = self.config
        layers = getattr(getattr(self.model, "config", None), "num_hidden_layers", "?")
        return (
            "---\nlibrary_name: hf_paralleldecode\ntags:\n- speculative-decoding\n- diffusion-drafter\n- deer\n"
            + (f"base_model: {c.target_name_or_path}\n" if c.target_name_or_path else "")
            + "---\n\n"
            f"# DEER diffusion drafter\n\nA {layers}-layer {c.attention} masked-diffusion drafter "
            f"({type(self.model).__name__}) that drafts {c.block_size} tokens per denoising step for "
            f"`{c.target_name_or_path or 'its target'}` (mask token {c.mask_token_id}"
            + (f", boundary token {c.boundary_token_id}" if c.boundary_token_id is not None else "")
            + f", {'shifted' if c.shifted else 'unshifted'} predictions).\n\n```python\nimport hf_paralleldecode as hfpd\n\n"
            "target = hfpd.load_model(TARGET)\ndrafter = hfpd.DiffusionDrafter.from_pretrained(DRAFTER)\n"
            "out = target.generate(**inputs, decoding=\"speculative\", drafter=drafter)\n```\n\n"
            "Config:\n\n```json\n" + json.dumps(c.to_dict(), indent=2, sort_keys=True) + "\n```\n"
        )


class DiffusionState(DrafterState):
    """A DEER drafter's side of one call: draft marginals for the active rows (see "Drafting" in the module
    docstring)."""

    #: block-causal drafters: the most committed tokens per row one drafter forward catches up on after steps that
    #: did not draft (plain steps of the batch policy), the last step's tokens always included; ``None``: all of them
    max_catch_up: int | None = 16
    def __init__(self, context: DrafterContext, drafter: DiffusionDrafter, depth: int | None = None,
                 steps: int | None = None):
        super().__init__()
        self.context, self.drafter, self.vocab = context, drafter, context.vocab
        c = drafter.config
        self.causal = c.attention == "block_causal"
        device = context.device
        depth = c.block_size if depth is None else depth  # masks fed per step: the tree's depth
        self.block = torch.tensor(drafter.block_ids(depth), dtype=torch.long, device=device)  # [L]
        self.query = drafter.query_index(depth).to(device)  # [k] into [anchor] + block
        self.first_mask = 1 + (c.boundary_token_id is not None)  # index of mask 1 in [anchor] + block
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # shorter blocks, by depth
        self.steps = min(steps or c.denoise_steps, depth)
        self._fed_prompt = False
        if self.causal:
            self.open_cache(context.prompt.shape[0], device, drafter.dtype)
            roots = context.first_tokens
            self.pending = (  # the prompt (left-padded) and the first committed token, not yet fed
                torch.cat([context.prompt, roots[:, None]], dim=1),
                torch.cat([context.prompt_positions, context.first_positions[:, None]], dim=1),
                torch.cat([context.prompt_mask, torch.ones_like(roots[:, None], dtype=torch.bool)], dim=1),
            )

    # ---- forwards -------------------------------------------------------------------------------
    def _call(self, **kwargs) -> torch.Tensor:
        device = self.drafter.device
        with self.timed(device):  # (on CUDA: events, read when the seconds are asked for; no wait here)
            logits = self.drafter(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()})
        self.forwards += 1
        self.fed_tokens += int(kwargs["input_ids"].numel())
        return logits.to(self.context.device)

    def _causal_forward(self, block: torch.Tensor, root_pos: torch.Tensor, first: bool) -> torch.Tensor:
        """``[b, 1 + L, Vd]`` logits of ``[anchor] + block``; the first forward of a step also feeds the queue."""
        b, L = block.shape
        device = block.device
        block_pos = root_pos[:, None] + 1 + torch.arange(L, device=device)
        if first:
            ids, pos, valid = self.pending
            self._fed_prompt = True  # (from now on the queue keeps at most max_catch_up columns, see _queue)
            m = ids.shape[1]
            eye = torch.eye(m, dtype=torch.bool, device=device)
            causal = torch.ones(m, m, dtype=torch.bool, device=device).tril()
            top = torch.cat([(causal & valid[:, None, :]) | eye, torch.zeros(b, m, L, dtype=torch.bool, device=device)],
                            dim=-1)
            bottom = torch.cat([valid[:, None, :].expand(b, L, m), torch.ones(b, L, L, dtype=torch.bool, device=device)],
                               dim=-1)
            intra = torch.cat([top, bottom], dim=1)
            ids, pos = torch.cat([ids, block], dim=1), torch.cat([pos, block_pos], dim=1)
        else:
            m, valid = 0, None
            intra = torch.ones(b, L, L, dtype=torch.bool, device=device)
            ids, pos = block, block_pos
        logits = self._call(input_ids=ids, attention_mask=self.slots.attention_mask(intra), position_ids=pos,
                            cache=self.slots.cache, logits_to_keep=L + (1 if first else 0))
        self.slots.cache.crop(-L)  # the block's slots never stay
        if first:
            self.slots.valid = torch.cat([self.slots.valid, valid], dim=1)
            self.pending = None
            self._anchor = logits[:, :1]
            return logits
        return torch.cat([self._anchor, logits], dim=1)

    def _window(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Each active row's last ``context_window`` committed tokens (prompt included), left-aligned:
        ``ids [b, w_max]`` and ``lengths [b]``."""
        rows, context = step.rows, self.context
        plen = context.prompt_lengths[rows]
        total = plen + step.num_committed[rows]
        w = total.clamp(max=self.drafter.context_window)
        j = torch.arange(int(w.max()), device=rows.device)
        virtual = (total - w)[:, None] + j  # index into [real prompt tokens, committed tokens]
        physical = torch.where(virtual < plen[:, None], virtual, context.prompt.shape[1] + virtual - plen[:, None])
        tokens = torch.cat([context.packed_prompt[rows], step.committed[rows]], dim=1)
        return tokens.gather(1, physical.clamp(max=tokens.shape[1] - 1)), w

    def _bidirectional_forward(self, block: torch.Tensor, step: DraftStep) -> torch.Tensor:
        """``[b, 1 + L, Vd]`` logits of ``[anchor] + block`` from one forward over window + block (right-padded)."""
        window, w = self._window(step)
        b, L = block.shape
        device = block.device
        width = window.shape[1] + L
        cols = torch.arange(width, device=device)
        ids = torch.full((b, width), self.drafter.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, : window.shape[1]] = window
        ids.scatter_(1, w[:, None] + torch.arange(L, device=device), block)
        attention = (cols[None] < (w + L)[:, None]).long()
        logits = self._call(input_ids=ids, attention_mask=attention)
        at = (w - 1)[:, None] + torch.arange(L + 1, device=device)  # the anchor (last committed token) and the block
        return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))

    # ---- the step ----------------------------------------------------------------------------------
    def _block(self, depth: int | None):
        """``(block ids, query index)`` of a block of ``depth`` masks (default: the call's ``tree_depth``)."""
        if depth is None or depth == self.query.shape[0]:
            return self.block, self.query
        if depth not in self._blocks:
            device = self.block.device
            self._blocks[depth] = (torch.tensor(self.drafter.block_ids(depth), dtype=torch.long, device=device),
                                   self.drafter.query_index(depth).to(device))
        return self._blocks[depth]

    def marginals(self, step: DraftStep) -> torch.Tensor:
        """Draft logits ``[active, k, V]`` (fp32, the target's vocabulary) for depths ``1..k``; a step shallower than
        the call's ``tree_depth`` (``step.depth``) feeds a shorter block (a cheaper drafter forward)."""
        roots, root_pos = step.roots, step.root_pos
        b = roots.shape[0]
        base, query = self._block(step.depth)
        block = base[None].expand(b, -1).clone()
        k = query.shape[0]
        steps = min(self.steps, k)
        masked = torch.ones(b, k, dtype=torch.bool, device=roots.device)
        out = None
        for s in range(steps):
            logits = self._causal_forward(block, root_pos, s == 0) if self.causal else \
                self._bidirectional_forward(block, step)
            q = logits[:, query, : self.vocab].float()  # [b, k, V]
            out = q if out is None else torch.where(masked[..., None], q, out)
            if s == steps - 1:
                break
            left = int(masked[0].sum())  # every row has the same number of masked positions
            n = -(-left // (steps - s))  # ceil: the rest is spread over the remaining steps
            conf = q.amax(-1).masked_fill(~masked, float("-inf"))
            pick = conf.topk(n, dim=-1).indices  # [b, n] most confident masked depths
            masked.scatter_(1, pick, False)
            block.scatter_(1, pick + self.first_mask - 1, q.argmax(-1).gather(1, pick))
        return out

    def update(self, step: DraftStep, tree, verdict) -> None:
        """Queue each row's newly committed tokens (accepted drafts + bonus) for the next forward."""
        root_pos = step.root_pos
        if not self.causal:
            return  # the window is read from the commit log
        if verdict.tokens.shape[1] == 1:  # a plain step: one token per row, the new anchor
            self._queue((verdict.tokens, root_pos[:, None] + 1, torch.ones_like(verdict.tokens, dtype=torch.bool)))
            return
        n = verdict.num_accepted + 1  # [b]
        m = max(verdict.nums) + 1  # (host ints, read with the verdict)
        cols = torch.arange(m, device=n.device)
        shift = (m - n)[:, None]
        idx = (cols[None] - shift).clamp(min=0)  # left-padded: the new anchor is always the last column
        new = (verdict.tokens.gather(1, idx), root_pos[:, None] + 1 + idx, cols[None] >= shift)
        self._queue(new)

    def _queue(self, new: tuple) -> None:
        """Append ``new`` (ids, positions, valid; left-padded, the new anchor last) to the tokens not fed yet. A step
        that drafted nothing left its tokens queued: both go in. Once the prompt is in, at most the last
        :attr:`max_catch_up` columns are kept, and always the newest step's (older ones are skipped: a hole in the
        drafter's context)."""
        pending = new if self.pending is None else tuple(torch.cat(p, dim=1) for p in zip(self.pending, new))
        cap = None if self.max_catch_up is None else max(self.max_catch_up, new[0].shape[1])
        if self._fed_prompt and cap is not None and pending[0].shape[1] > cap:
            self.skipped_tokens += int(pending[2][:, :-cap].sum())
            pending = tuple(t[:, -cap:] for t in pending)
        self.pending = pending

    def select(self, kept: torch.Tensor) -> None:
        super().select(kept)
        if self.causal and self.pending is not None:
            self.pending = tuple(t[kept] for t in self.pending)
