"""Every use of transformers internals, in one place.

Why
    The library plugs into ``generate`` as a ``custom_generate`` callable, feeds models a KV cache
    between forwards, builds models on transformers' DFlash drafter and overrides a few ``Trainer``
    hooks. Those contracts are not all public, and they move: transformers 5.24 renamed the cache
    argument from ``past_key_values`` to ``cache`` in ``generate``, in model forwards and in model
    outputs; 5.19 added the ``Trainer`` flag that says a loss is already scaled for gradient accumulation.
    Everything the library needs from transformers beyond its documented public API is
    resolved here, once, for the installed release; no other module names a private transformers
    symbol or the cache argument, so the next rename is a change in this file.

What is here
    * The tested range (:data:`TESTED_TRANSFORMERS`) and the one warning on import outside it; what
      appeared inside it, release by release (:data:`INTRODUCED`), and whether the installed release has it
      (:func:`since`).
    * The cache argument: the key ``generate`` hands a ``custom_generate`` callable
      (:data:`GENERATE_CACHE_KEY`), the keyword a given model's ``forward`` takes
      (:func:`cache_kwargs`: read from its signature, so a remote-code model that still takes
      ``past_key_values`` keeps working on a newer transformers), a user's cache in a call's kwargs
      (:func:`user_cache`), and a model output's cache (:func:`output_cache`).
    * Cache classes (:class:`Cache`, :class:`DynamicCache`, :class:`DynamicLayer`).
    * The ``custom_generate`` contract: the arguments ``generate`` hands a callable
      (:data:`SAMPLE_ARGUMENTS`), the decoder-only output class, generation modes, the generation
      config's prepared special-token tensors, stopping criteria, logits processors, the
      distributed checks ``generate`` makes, the ``max_length`` it resolves for a call, the model inputs it
      accepts, and the streamer of the enclosing ``generate`` call.
    * Models: the attention implementation in use, transformers' DFlash drafter classes, a base
      class for the library's own ``PreTrainedModel`` subclasses, and the ``Trainer`` hooks.
    * :data:`INTERNALS`: every internal name this module relies on, checked by
      ``tests/test_compat.py`` on the installed version; :data:`INTRODUCED`, those that only the newer
      releases of the range have (checked to exist exactly from their release on).
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref

import transformers
from packaging.version import Version
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)
from transformers.generation import logits_process, stopping_criteria
from transformers.generation import utils as _generation_utils
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput

__all__ = [
    "TESTED_TRANSFORMERS", "TRANSFORMERS_VERSION", "tested_range_warning", "GENERATE_CACHE_KEY", "CACHE_KEYS",
    "cache_kwargs", "forward_cache_key", "user_cache", "output_cache", "Cache", "DynamicCache", "DynamicLayer",
    "CACHE_NAMES", "GenerationMode", "GenerateDecoderOnlyOutput", "SAMPLE_ARGUMENTS", "logits_process", "EosTokenCriteria",
    "MaxLengthCriteria", "pad_token_tensor", "eos_token_tensor", "distributed_world_size", "sharded_across_processes",
    "enclosing_generate_streamer", "generated_max_length", "generate_model_inputs", "attn_implementation", "default_cache", "is_sliding_window_layer", "has_recurrent_state", "length_dependent_rope", "set_body_attn_implementation", "dflash_classes",
    "HeadPreTrainedModel", "TrainerHooks", "GENERATION_CONFIG_BOOKKEEPING", "INTERNALS", "RUNTIME_INTERNALS",
    "INTRODUCED", "since", "TRAINER_READS_LOSS_SCALING",
]

logger = logging.getLogger("hf_paralleldecode")

# ---- versions -------------------------------------------------------------------------------------
#: transformers releases CI tests: ``(floor, first untested)``; pyproject's requirement states the same range
TESTED_TRANSFORMERS = ("5.16.1", "5.25")
TRANSFORMERS_VERSION = Version(transformers.__version__)


def tested_range_warning(version: str | Version | None = None) -> str | None:
    """The warning for a transformers release outside :data:`TESTED_TRANSFORMERS`, or ``None`` inside it."""
    v = Version(str(version)) if version is not None else TRANSFORMERS_VERSION
    low, high = (Version(x) for x in TESTED_TRANSFORMERS)
    if low <= Version(v.base_version) < high:
        return None
    return (f"hf_paralleldecode is tested with transformers>={TESTED_TRANSFORMERS[0]},<{TESTED_TRANSFORMERS[1]}; "
            f"transformers {v} is installed. Parallel decoding may fail on it, or differ from stock generate. "
            f"Install a tested release (pip install 'transformers>={TESTED_TRANSFORMERS[0]},<{TESTED_TRANSFORMERS[1]}'), "
            f"or check this one with `TRANSFORMERS_VERSION={v} bash scripts/transformers-env.sh` in a checkout "
            "(docs/compatibility.md).")


_warning = tested_range_warning()
if _warning:
    logger.warning(_warning)


def since(release: str, version: str | Version | None = None) -> bool:
    """Whether the installed transformers (or ``version``) is ``release`` or newer; a pre-release of ``release``
    counts as ``release`` (its code is what the release ships)."""
    v = Version(str(version)) if version is not None else TRANSFORMERS_VERSION
    return Version(v.base_version) >= Version(release)


#: ``(owner, attribute, release)``: what transformers added inside the tested range, which the releases before
#: ``release`` lack and this module bridges (``tests/test_compat.py`` checks each exists exactly from its release on,
#: so a gate below that names the wrong release fails on one of the two releases CI runs)
INTRODUCED: tuple[tuple[str, str, str], ...] = (
    # 5.19: Trainer reads `loss_is_scaled_for_ga` (is compute_loss's loss already scaled for gradient accumulation?);
    # before, it divided by the accumulation steps unless the model "accepts loss kwargs" (TrainerHooks bridges it)
    ("transformers.trainer.Trainer", "loss_is_scaled_for_ga", "5.19.0"),
    # 5.24: the cache argument is `cache`, and the older names are the deprecated ones (GENERATE_CACHE_KEY reads
    # ALL_CACHE_NAMES[0], which is `past_key_values` before 5.24)
    ("transformers.generation.utils", "DEPRECATED_CACHE_NAMES", "5.24.0"),
)
#: whether ``Trainer.training_step`` honours a trainer's ``loss_is_scaled_for_ga`` (transformers >= 5.19)
TRAINER_READS_LOSS_SCALING = since("5.19.0")

# ---- the cache argument ---------------------------------------------------------------------------
#: every name transformers has used for the cache argument, newest first
CACHE_NAMES = ("cache", "past_key_values")
#: the key ``generate`` puts the cache under in ``model_kwargs`` (what a ``custom_generate`` callable receives)
#: and the field of its output classes: ``ALL_CACHE_NAMES[0]`` is the current name
GENERATE_CACHE_KEY: str = _generation_utils.ALL_CACHE_NAMES[0]
#: names a user's ``generate`` call or ``model_kwargs`` may carry a cache under (the current one first)
CACHE_KEYS: tuple[str, ...] = tuple(dict.fromkeys([GENERATE_CACHE_KEY, *CACHE_NAMES]))

_FORWARD_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forward_cache_key(module) -> str:
    """The keyword ``module``'s forward takes its cache under: read from its signature (``cache`` on
    transformers >= 5.24, ``past_key_values`` before, and in remote-code or user models written for it);
    the installed release's name when the forward takes only ``**kwargs``."""
    fn = module.forward if hasattr(module, "forward") else module
    owner = getattr(fn, "__func__", fn)
    try:
        return _FORWARD_KEYS[owner]
    except (KeyError, TypeError):
        pass
    params = inspect.signature(fn).parameters
    key = next((name for name in CACHE_NAMES if name in params), GENERATE_CACHE_KEY)
    try:
        _FORWARD_KEYS[owner] = key
    except TypeError:  # pragma: no cover - not weak-referenceable
        pass
    return key


def cache_kwargs(module, cache) -> dict:
    """``{name: cache}`` to pass to ``module``'s forward (``module(**inputs, **cache_kwargs(module, cache))``)."""
    return {forward_cache_key(module): cache}


def user_cache(kwargs: dict):
    """The cache a ``generate`` call or ``model_kwargs`` carries under any of :data:`CACHE_KEYS`, or ``None``."""
    return next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)


def output_cache(outputs):
    """The cache a model output carries (``outputs.cache`` or ``outputs.past_key_values``), or ``None``."""
    return next((getattr(outputs, k) for k in CACHE_NAMES if getattr(outputs, k, None) is not None), None)


# ---- the custom_generate contract -----------------------------------------------------------------
#: the arguments ``generate`` hands a ``custom_generate`` callable: those of ``GenerationMixin._sample``
#: (transformers compares a callable's signature with it to find the callable's own settings)
SAMPLE_ARGUMENTS: frozenset[str] = frozenset(inspect.signature(GenerationMixin._sample).parameters)
EosTokenCriteria = stopping_criteria.EosTokenCriteria
MaxLengthCriteria = stopping_criteria.MaxLengthCriteria

#: generation-config fields that are bookkeeping, not settings (a config loaded from a model's config sets it)
GENERATION_CONFIG_BOOKKEEPING = frozenset({"_from_model_config", "transformers_version"})


def pad_token_tensor(generation_config):
    """The pad token ``generate`` prepared on the generation config (a tensor or ``None``)."""
    return getattr(generation_config, "_pad_token_tensor", None)


def eos_token_tensor(generation_config):
    """The end-of-sequence tokens ``generate`` prepared on the generation config (a tensor or ``None``)."""
    return getattr(generation_config, "_eos_token_tensor", None)


def distributed_world_size() -> int:
    """Processes in the default process group, as ``generate`` counts them (1 when none)."""
    return int(_generation_utils._get_torch_distributed_world_size())


def sharded_across_processes(model) -> bool:
    """Whether ``generate`` would set ``synced_gpus`` for ``model``: ZeRO-3 or FSDP with several processes."""
    return distributed_world_size() > 1 and bool(
        _generation_utils.is_deepspeed_zero3_enabled() or _generation_utils.is_fsdp_managed_module(model))


def enclosing_generate_streamer(depth: int = 2):
    """The ``streamer`` argument of the transformers ``generate`` call that (a few frames up) called the caller.

    transformers puts the prompt into the user's streamer and then does not hand it to a ``custom_generate``
    callable; this finds it in ``generate``'s frame (``None`` when the caller was not reached from ``generate``).
    """
    frame = sys._getframe(depth)
    for _ in range(8):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "generate" and code.co_filename.replace("\\", "/").endswith("generation/utils.py"):
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None


# ---- models ---------------------------------------------------------------------------------------
def generated_max_length(model, generation_config, input_length: int) -> int:
    """``max_length`` as ``generate`` resolves it for a prompt of ``input_length`` tokens (padding included; a call
    without a prompt starts from one BOS token per row, so 1): prompt + ``max_new_tokens`` when that is set, else
    ``max_length`` when the call or a generation config sets it, else transformers' default number of new tokens
    after the prompt, capped at ``max_position_embeddings`` (``GenerationMixin._prepare_generated_length``)."""
    if generation_config.max_new_tokens is not None:
        return int(input_length) + int(generation_config.max_new_tokens)
    if generation_config.max_length is not None:
        return int(generation_config.max_length)
    length = int(input_length) + int(type(generation_config)._get_default_generation_params()["max_length"])
    positions = getattr(model.config, "max_position_embeddings", None)
    return min(length, int(positions)) if positions is not None else length


def generate_model_inputs(model) -> frozenset[str]:
    """The keyword names stock ``generate`` accepts as model inputs of ``model`` (others it refuses as unused or typos:
    ``GenerationMixin._validate_model_kwargs``): ``prepare_inputs_for_generation``'s parameters, ``forward``'s when
    the former takes ``**kwargs``, and the model-agnostic ``TransformersKwargs``."""
    from transformers.utils import TransformersKwargs

    names = set(inspect.signature(model.prepare_inputs_for_generation).parameters)
    if "kwargs" in names or "model_kwargs" in names:
        names |= set(inspect.signature(model.forward).parameters)
    return frozenset(names | set(TransformersKwargs.__optional_keys__))


def attn_implementation(config) -> str | None:
    """The attention implementation a model (config) runs with, or ``None`` when unset."""
    return getattr(config, "_attn_implementation", None)


def set_body_attn_implementation(config, implementation: str) -> None:
    """Set the attention implementation of a config that builds a submodule directly (not ``from_pretrained``)."""
    config._attn_implementation = implementation


def dflash_classes():
    """transformers' DFlash drafter: ``(config class, model class)`` (``MuseGlimmerAssistant*``; every release of the
    tested range has it, with the cache argument under the release's name, read by :func:`forward_cache_key`)."""
    try:
        from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    except ImportError as err:  # pragma: no cover - depends on the installed transformers
        raise ImportError(
            f"The draft head needs transformers' DFlash drafter (MuseGlimmerAssistantModel, transformers>={TESTED_TRANSFORMERS[0]})."
        ) from err
    return MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel


def rotary_embedding(**config_kwargs):
    """transformers' rotary embedding for a Llama-style config (every ``rope_type``): ``module(x, position_ids)``
    gives ``(cos, sin)``; :func:`apply_rotary` applies them. Used by drafters that own their attention (EAGLE-3)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(LlamaConfig(**config_kwargs))


def activation(name: str):
    """transformers' activation module for a config's ``hidden_act`` name."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def apply_rotary(q, k, cos, sin):
    """Rotate ``q`` / ``k`` ``[b, heads, s, head_dim]`` by ``(cos, sin)`` ``[b, s, head_dim]`` (transformers' own)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


def default_cache(model):
    """The empty cache stock ``generate`` would build for ``model`` (its layers say full / sliding / recurrent)."""
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def is_sliding_window_layer(layer) -> bool:
    """Whether a cache layer is a plain sliding-window attention layer (no recurrent state beside it)."""
    return isinstance(layer, DynamicSlidingWindowLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin)


def has_recurrent_state(model) -> bool:
    """Whether ``model`` keeps a recurrent state between forwards (state-space or linear-attention layers: Mamba,
    RWKV, Jamba, Qwen3-Next, ...), which transformers marks as stateful."""
    return bool(getattr(model, "_is_stateful", False))


def length_dependent_rope(model) -> tuple[str, int] | None:
    """``(rope type, limit)`` when ``model``'s rotary frequencies depend on the forward's length, else ``None``.

    transformers recomputes the frequencies of ``"dynamic"`` rotary types (and switches ``"longrope"`` to its long
    factors) as soon as one forward holds a position ``>= limit``: a forward of many new tokens crosses it before
    stock decoding does. Below the limit both use the original frequencies. The smallest limit over the model's
    rotary modules (per layer type where a module has several)."""
    found = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None or not hasattr(module, "original_max_seq_len"):
            continue
        types = rope_type if isinstance(rope_type, dict) else {None: rope_type}
        for layer_type, kind in types.items():
            if not isinstance(kind, str) or not ("dynamic" in kind or kind == "longrope"):
                continue
            limit = module.original_max_seq_len
            if kind == "longrope":
                params = getattr(module.config, "rope_parameters", None) or {}
                params = params.get(layer_type, params) if layer_type is not None else params
                limit = params.get("original_max_position_embeddings") or limit
            found.append((int(limit), kind))
    if not found:
        return None
    limit, kind = min(found)
    return kind, limit


class HeadPreTrainedModel(PreTrainedModel):
    """Base of the library's own ``PreTrainedModel`` subclasses: declares SDPA support and routes weight
    initialisation to :meth:`init_module_weights`."""

    _supports_sdpa = True
    _supports_attention_backend = True

    def init_module_weights(self, module) -> None:  # pragma: no cover - per subclass
        raise NotImplementedError

    def _init_weights(self, module):
        self.init_module_weights(module)


class TrainerHooks:
    """Mixin before ``transformers.Trainer`` (``class MyTrainer(TrainerHooks, Trainer)``): the Trainer's
    overridable internals under public names.

    Override :meth:`count_items_in_batch` (the loss normaliser of one optimizer step, gathered over
    gradient accumulation), :meth:`save_model_files` (what a checkpoint / ``save_model`` writes) and
    :meth:`load_model_files` (``resume_from_checkpoint``); each defaults to the Trainer's own behaviour.

    A trainer that sets ``loss_is_scaled_for_ga`` (its own ``compute_loss`` divides by the step's
    ``num_items_in_batch``, or does not) gets that on every release of the range: transformers < 5.19 ignores the
    flag and divides the loss by the accumulation steps unless ``model_accepts_loss_kwargs`` is true and the step
    was counted, so there the flag is copied into ``model_accepts_loss_kwargs`` (which such a trainer's own
    ``compute_loss`` and ``count_items_in_batch`` make moot otherwise).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None and not TRAINER_READS_LOSS_SCALING:
            self.model_accepts_loss_kwargs = bool(scaled)

    def count_items_in_batch(self, batch_samples, device):
        return super()._get_num_items_in_batch(batch_samples, device)

    def save_model_files(self, output_dir, state_dict=None):
        return super()._save(output_dir, state_dict)

    def load_model_files(self, resume_from_checkpoint, model=None):
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _get_num_items_in_batch(self, batch_samples, device):
        return self.count_items_in_batch(batch_samples, device)

    def _save(self, output_dir=None, state_dict=None):
        return self.save_model_files(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return self.load_model_files(resume_from_checkpoint, model)


# ---- what this module relies on -------------------------------------------------------------------
#: ``(owner, attribute)`` pairs this module reads from transformers beyond its documented API (``owner``: a module,
#: or a class inside one); each must resolve on a supported release (``tests/test_compat.py``)
INTERNALS: tuple[tuple[str, str], ...] = (
    ("transformers.generation.utils", "ALL_CACHE_NAMES"),
    ("transformers.generation.utils", "_get_torch_distributed_world_size"),
    ("transformers.generation.utils", "is_deepspeed_zero3_enabled"),
    ("transformers.generation.utils", "is_fsdp_managed_module"),
    ("transformers.generation.utils", "GenerateDecoderOnlyOutput"),
    ("transformers.generation.utils.GenerationMixin", "_sample"),
    ("transformers.generation.configuration_utils", "GenerationMode"),
    ("transformers.generation.configuration_utils.GenerationConfig", "_get_default_generation_params"),
    ("transformers.generation.utils.GenerationMixin", "_prepare_generated_length"),
    ("transformers.generation.utils.GenerationMixin", "_validate_model_kwargs"),
    ("transformers.utils", "TransformersKwargs"),
    ("transformers.generation.stopping_criteria", "EosTokenCriteria"),
    ("transformers.generation.stopping_criteria", "MaxLengthCriteria"),
    ("transformers.cache_utils", "Cache"),
    ("transformers.cache_utils", "DynamicCache"),
    ("transformers.cache_utils", "DynamicLayer"),
    ("transformers.cache_utils", "DynamicSlidingWindowLayer"),
    ("transformers.cache_utils", "LinearAttentionCacheLayerMixin"),
    ("transformers.cache_utils.DynamicCache", "crop"),
    ("transformers.cache_utils.DynamicCache", "batch_select_indices"),
    ("transformers.models.muse_glimmer_assistant", "MuseGlimmerAssistantConfig"),
    ("transformers.models.muse_glimmer_assistant", "MuseGlimmerAssistantModel"),
    ("transformers.modeling_utils.PreTrainedModel", "_init_weights"),
    ("transformers.trainer.Trainer", "_get_num_items_in_batch"),
    ("transformers.trainer.Trainer", "_save"),
    ("transformers.trainer.Trainer", "_load_from_checkpoint"),
    ("transformers.modeling_utils.PreTrainedModel", "_is_stateful"),
    ("transformers.modeling_rope_utils", "dynamic_rope_update"),
    ("transformers.models.llama.modeling_llama", "LlamaRotaryEmbedding"),
    ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb"),
)
#: attributes transformers sets at run time on the objects named (checked on a real ``generate`` call)
RUNTIME_INTERNALS: dict[str, tuple[str, ...]] = {
    "the generation config generate hands a custom_generate callable": ("_pad_token_tensor", "_eos_token_tensor"),
    "a model's config": ("_attn_implementation",),
    "a rotary embedding module (rope_type, original_max_seq_len)": ("rope_type", "original_max_seq_len"),
    "a model output, and generate's output classes": (GENERATE_CACHE_KEY,),
}


def scalar_read_ops() -> set:
    """The aten ops through which a tensor's value reaches the host as a Python number (``item``, ``int``,
    ``bool``, ``float``): what the host-sync census (``engine/census.py``) counts as reads."""
    import torch

    return {torch.ops.aten._local_scalar_dense.default}


def no_kernel_ops() -> set[str]:
    """The aten ops (by packet name) that describe a tensor or make a view of it and launch no kernel: what the census
    (``engine/census.py``) does not count as small ops."""
    return {"detach", "device", "alias", "view", "_unsafe_view", "reshape", "_reshape_alias", "squeeze", "unsqueeze",
            "expand", "slice", "select", "as_strided", "t", "transpose", "permute", "split", "narrow", "unbind",
            "lift_fresh"}


#: the devices transformers compiles a static-cache ``generate`` on by itself (``_valid_auto_compile_criteria``)
AUTO_COMPILE_DEVICES = ("cuda", "xpu", "neuron", "tpu")


def fast_path_generate_kwargs(device) -> dict:
    """The ``generate`` arguments of stock decoding on transformers' own fast path: a static cache and a compiled
    forward (``cache_implementation="static"`` with a ``CompileConfig``). transformers compiles by itself only on
    :data:`AUTO_COMPILE_DEVICES`; elsewhere (a CPU) the config's switch to compile on every device is set."""
    import torch
    from transformers import CompileConfig

    config = CompileConfig()
    if torch.device(device).type not in AUTO_COMPILE_DEVICES:
        config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}

