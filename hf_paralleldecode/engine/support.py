"""What a parallel decoding can serve: one place that decides, for a model and a ``generate`` call.

Used twice: by the strategies before any forward (:func:`~.base.start` raises ``ValueError``) and
by ``enable()``'s ``generate`` before transformers prepares anything (an explicit ``decoding=``
raises; a checkpoint's default decoding steps aside to stock ``generate``). Each check returns the
reason as a sentence ending in the fix, or ``None``. The full table of ``generate`` arguments and
generation-config fields (supported / refused / not applicable) is ``docs/generate-arguments.md``.

Decisions
    * Models: decoder-only, an attention implementation that honours custom 4D masks
      (:data:`SUPPORTED_ATTENTION`), and explicit ``position_ids`` in ``forward``. ALiBi models
      (Bloom, MPT; Falcon with ``alibi=True``) derive positions from the 2D mask, so a tree cannot
      be fed to them: they are refused (decided from the forward signature and ``config.alibi``,
      not from a list of model names).
    * Generation modes: greedy and sampling only. Beam, contrastive, DoLa, constrained and assisted
      modes (``get_generation_mode()``) are refused.
    * Caches: the default ``DynamicCache``; static, offloaded, quantized and paged caches are
      refused (entries cannot be cut back and gathered, or transformers bypasses the callable).
    * Inputs: ``input_ids`` with ``attention_mask`` / ``position_ids`` / ``token_type_ids``;
      anything else the model would get at every step is refused by name.
    * ``stop_strings`` work through ``decoding=`` (the mixin builds the criterion from
      ``tokenizer=``, which transformers does not hand a callable); ``token_healing`` is refused.
    * Distributed: under ZeRO-3 / FSDP with several processes every rank must run the same number
      of forwards (``synced_gpus``), which a data-dependent decoding loop cannot promise: refused.
"""

from __future__ import annotations

import copy
import inspect

import torch

from ..compat import (
    CACHE_KEYS,
    GenerationMode,
    attn_implementation,
    default_cache,
    generate_model_inputs,
    generated_max_length,
    has_recurrent_state,
    length_dependent_rope,
    sharded_across_processes,
    user_cache,
)
from .settings import GENERATE_ARGUMENTS, STRATEGIES, STREAMER_ARGUMENT, settings_class, unknown_settings_hint

__all__ = ["SUPPORTED_ATTENTION", "STEP_INPUTS", "model_conflict", "generation_config_conflict",
           "model_inputs_conflict", "distributed_conflict", "call_conflict"]

#: attention implementations that honour a custom 4D additive mask
SUPPORTED_ATTENTION = ("sdpa", "eager")
#: model inputs fed at every step exactly as stock generation extends them
STEP_INPUTS = ("token_type_ids",)
#: what ``generate`` hands every callable and the strategies consume (the output flags are checked
#: with the generation config)
HANDLED_INPUTS = frozenset({"attention_mask", "position_ids", *CACHE_KEYS, "use_cache", "logits_to_keep",
                            "cache_position", "inputs_embeds", "output_attentions", "output_hidden_states",
                            "return_dict"})
_STOCK = 'use decoding="stock" for this call'
_UNCUTTABLE_CACHES = ("static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked",
                      "offloaded_hybrid", "offloaded_hybrid_chunked", "quantized", "offloaded")


def model_conflict(model) -> str | None:
    """Why no parallel decoding can run on ``model`` at all, or ``None``."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        return f"supports decoder-only causal LMs; {name} is encoder-decoder ({_STOCK})."
    attn = attn_implementation(model.config) or "eager"
    if attn not in SUPPORTED_ATTENTION:
        return (f"builds custom 4D attention masks, which attn_implementation={attn!r} does not honour. Load the "
                "model with attn_implementation='sdpa' (or 'eager'), or call model.set_attn_implementation('sdpa').")
    if has_recurrent_state(model):
        return (f"verifies token trees and rolls rejected guesses back; {name} keeps a recurrent state (state-space or "
                f"linear-attention layers) that can neither branch into a tree nor be rolled back ({_STOCK}).")
    if "position_ids" not in inspect.signature(type(model).forward).parameters or getattr(model.config, "alibi", False):
        return (f"feeds token trees with explicit position ids and a custom 4D mask; {name} derives its positions "
                f"from the 2D attention mask (ALiBi) and cannot take them ({_STOCK}).")
    return None


def generation_config_conflict(gc) -> str | None:
    """Why a parallel decoding cannot serve a call with this (resolved) generation config, or ``None``."""
    mode = gc.get_generation_mode()
    if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE, GenerationMode.GROUP_BEAM_SEARCH):
        return "does not combine with beam search: set num_beams=1."
    if mode == GenerationMode.ASSISTED_GENERATION:
        return ("replaces the decoding loop; it cannot be combined with assisted generation (assistant_model, "
                "prompt_lookup_num_tokens, assistant_early_exit, use_mtp). Drop one of them.")
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"runs greedy search or sampling only; this call asks for {mode.value} ({_STOCK})."
    if gc.num_return_sequences not in (None, 1):
        return "supports num_return_sequences=1 only."
    if gc.use_cache is False:
        return "needs the KV cache: do not pass use_cache=False."
    if gc.output_attentions or gc.output_hidden_states:
        return ("cannot return per-step attentions or hidden states: set output_attentions=False and "
                "output_hidden_states=False.")
    if gc.cache_implementation == "paged":
        return f"cannot run on the paged cache (transformers switches to continuous batching; {_STOCK})."
    if gc.cache_implementation in _UNCUTTABLE_CACHES:
        return (f"needs a cache it can cut back and gather; cache_implementation={gc.cache_implementation!r} "
                "(StaticCache, offloaded or quantized caches) is not one. Remove cache_implementation to use the "
                "default DynamicCache.")
    if getattr(gc, "prefill_chunk_size", None) is not None:
        return f"prefills the prompt in one forward; prefill_chunk_size is not honoured ({_STOCK})."
    if getattr(gc, "token_healing", False):
        return ("cannot heal tokens (token_healing): transformers does not hand a custom decoding the tokenizer. Heal the prompt "
                f"first (model.heal_tokens(input_ids, tokenizer)), or {_STOCK}.")
    if gc.guidance_scale is not None and gc.guidance_scale != 1:
        return ("cannot apply classifier-free guidance (guidance_scale), whose processor expects exactly one call "
                f"per generated token ({_STOCK}).")
    if type(gc.watermarking_config).__name__ == "SynthIDTextWatermarkingConfig":
        return f"cannot apply SynthID watermarking, whose processor keeps per-token state ({_STOCK})."
    return None


def processors_conflict(logits_processor) -> str | None:
    """Why a logits processor of the call cannot run under a parallel decoding (it expects exactly one call per
    generated token), or ``None``."""
    from .processors import ONE_CALL_PER_TOKEN_PROCESSORS

    for proc in logits_processor or []:
        reason = ONE_CALL_PER_TOKEN_PROCESSORS.get(type(proc).__name__)
        if reason is not None:
            return (f"cannot run {type(proc).__name__} ({reason}): it expects exactly one call per generated token, "
                    f"and a parallel decoding scores a whole block per forward. Drop that setting, or {_STOCK}.")
    return None


def rope_conflict(model, max_length: int) -> str | None:
    """Why a generation up to ``max_length`` tokens (prompt included, padding included) cannot be exact on
    ``model`` because of position-dependent rotary scaling it would cross, or ``None``. Every forward of a
    strategy stays below ``max_length``. (What a sliding window allows is decided by ``cache.prepare_cache``.)"""
    rope = length_dependent_rope(model)
    if rope is not None and max_length > rope[1]:
        kind, limit = rope
        return (f"feeds several new positions per forward, and {type(model).__name__}'s rotary embedding "
                f"(rope_type={kind!r}) changes its frequencies once one forward reaches position {limit}: a "
                f"multi-token forward gets there before stock decoding does, and the output would differ. This call "
                f"may reach max_length={max_length}: lower max_new_tokens so that prompt + new tokens <= {limit}, or "
                f"{_STOCK}.")
    return None


def position_table_size(model) -> int | None:
    """Positions ``model`` can embed when it has a learned absolute position table (GPT-2's ``n_positions``,
    OPT, BioGPT, ...): every forward must stay below it. ``None`` for rotary and other computed positions."""
    config = getattr(model, "config", None)  # a wrapped drafter may be a plain torch module
    if config is None:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not size:
        return None
    words = model.get_input_embeddings()
    for module in model.modules():  # a position table: an embedding of (about) that many rows, not the words
        if isinstance(module, torch.nn.Embedding) and module is not words and 0 <= module.num_embeddings - size <= 2:
            return int(size)
    return None


def model_inputs_conflict(model_inputs: dict, model=None, decoding=None) -> str | None:
    """Why the model inputs of a call cannot be fed at every step, or ``None``.

    With ``model`` and ``decoding`` (a registered name or a strategy callable), a key that looks like a
    setting (a near miss of one of the decoding's, another registered decoding's, or a name ``model.forward``
    cannot take) is reported as an unknown setting (the settings are the strategies' settings classes)."""
    refused = sorted(k for k, v in model_inputs.items()
                     if v is not None and k not in HANDLED_INPUTS and k not in STEP_INPUTS)
    if not refused:
        return None
    if model is not None and decoding is not None:
        strategy = decoding if callable(decoding) else STRATEGIES.get(decoding)
        settings = sorted(settings_class(strategy).names()) if strategy is not None else []
        reason = _unknown_settings(refused, model, settings)
        if reason:
            return reason
    return (f"cannot feed the model input(s) {refused} at every step (it feeds input_ids, attention_mask, "
            f"position_ids and {', '.join(STEP_INPUTS)}); they would be silently ignored. "
            'Use decoding="stock" for this call.')


def _unknown_settings(keys: list[str], model, settings: list[str]) -> str | None:
    """Keys that look like settings rather than model inputs: a setting of another decoding, a near miss of one
    of this decoding's ``settings``, or a name stock ``generate`` would not take as an input of ``model``."""
    inputs = generate_model_inputs(model)
    others = {d: settings_class(strategy).names() for d, strategy in STRATEGIES.items()}
    elsewhere = {k: [d for d, ds in others.items() if k in ds] for k in keys}
    unknown = [k for k in keys if elsewhere[k] or unknown_settings_hint([k], settings) or k not in inputs]
    if not unknown:
        return None
    hint = unknown_settings_hint(unknown, settings)
    where = "; ".join(f"{k!r} is a setting of decoding={', '.join(map(repr, ds))}" for k, ds in elsewhere.items()
                      if ds and k in unknown)
    listed = f" Its settings: {', '.join(settings)}." if settings else ""
    return (f"got unknown setting(s) {unknown}{hint}: not settings of this decoding"
            f"{' (' + where + ')' if where else ''}, and not inputs of {type(model).__name__}.{listed}")


def distributed_conflict(model, synced_gpus) -> str | None:
    """Why generation under ZeRO-3 / FSDP with several processes would hang, or ``None``."""
    if synced_gpus:
        return "does not support synced_gpus=True (every rank would have to run the same number of forwards)."
    if synced_gpus is None and sharded_across_processes(model):
        return ("runs a data-dependent number of forwards per row, but the model is sharded with ZeRO-3 / FSDP over "
                "several processes, whose ranks must run the same forwards (transformers would set synced_gpus, "
                "which a custom decoding does not receive) and would hang. Generate with an unsharded copy per "
                f"process, or {_STOCK}.")
    return None


def call_conflict(model, strategy, kwargs: dict, input_length: int = 1, drafter=None) -> str | None:
    """Why ``model.generate(decoding=..., **kwargs)`` cannot run ``strategy``, checked before transformers
    prepares anything (the generation config is merged as ``generate`` will merge it). The strategies run the
    same checks (``base.start``), so a checkpoint's default decoding steps aside exactly when it would refuse.
    ``input_length``: the prompt's length (padding included; 1 for a call without a prompt, which ``generate``
    starts from one BOS token per row), for the checks that depend on ``max_length``;
    ``drafter``: the drafter the call will use (given or attached), for a strategy with a ``drafter_conflict``."""
    reason = model_conflict(model) or distributed_conflict(model, kwargs.get("synced_gpus"))
    if reason:
        return reason
    if kwargs.get("assistant_model") is not None:
        return ("replaces the decoding loop; it cannot be combined with assisted generation (assistant_model). "
                "Drop one of them.")
    if kwargs.get("custom_generate") is not None:
        return "cannot be combined with custom_generate: pass one of them."
    if kwargs.get("inputs_embeds") is not None:
        return "needs input_ids; inputs_embeds are not supported."
    gc = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    gc.update(**{k: v for k, v in kwargs.items() if hasattr(gc, k)})
    max_length = generated_max_length(model, gc, input_length)
    from .cache import prepare_cache

    given = user_cache(kwargs)
    try:  # the check base.start makes on the cache generate hands the strategy (the user's, or the default one)
        prepare_cache(model, given if given is not None else default_cache(model), max_length)
    except ValueError as err:
        return f"cannot use this cache: {err}"
    reason = (generation_config_conflict(gc) or processors_conflict(kwargs.get("logits_processor"))
              or rope_conflict(model, max_length))
    if not reason and drafter is not None and hasattr(strategy, "drafter_conflict"):
        reason = strategy.drafter_conflict(drafter, max_length)
    if reason:
        return reason
    from transformers import GenerationMixin

    not_inputs = (set(settings_class(strategy).names()) | GENERATE_ARGUMENTS | {STREAMER_ARGUMENT}
                  | set(inspect.signature(GenerationMixin.generate).parameters)
                  | {"tokenizer", "assistant_tokenizer", "trust_remote_code", "decoding", "generation_config"})
    inputs = {k: v for k, v in kwargs.items() if k not in not_inputs and not hasattr(gc, k)}
    return model_inputs_conflict(inputs, model, strategy)
