"""Hardware presets: per-strategy settings derived from each GPU generation's datasheet roofline.

The derivation (``docs/hardware.md``)
    A decoder forward feeding ``n`` new tokens (all rows of the batch together) through a model
    of ``P`` parameters in bf16 does about ``2 P n`` FLOPs and reads the weights once (``2 P``
    bytes) plus the KV cache of its rows (``kv`` bytes per cached token, ``context`` tokens per
    row, ``batch`` rows). Its arithmetic intensity is therefore

        I(n) = 2 P n / (2 P + kv * context * batch)   FLOP per byte,

    and the forward stays memory-bound, so that extra tokens ride along almost for free, while
    ``I(n)`` is below the part's ridge point ``R = dense bf16 FLOP/s / memory bytes/s``. The
    *knee* is

        n* = R * (1 + kv * context * batch / (2 P))   tokens per forward.

    A preset spends those ``n*`` tokens: divided by the batch they are each row's width, which
    sets the block / window / tree sizes below (the budget shrinks under load). Measured
    ``tune`` results for a device win over the paper preset.

The CPU has no such knee worth the name (every token costs compute): its preset is what was
measured on the embedded models (:data:`CPU_DEFAULTS` for Jacobi Forcing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["GPU_DEFAULTS", "CPU_DEFAULTS", "GpuSpec", "GPU_SPECS", "DEFAULT_MODEL", "knee_tokens", "hardware_preset",
           "preset_name", "device_preset", "preset_settings", "cpu_has_native_bf16", "cpu_has_fast_matmul"]


#: Jacobi Forcing's settings in the paper (n=64, K=2, r=0.85, pool 4): the Hopper / Blackwell preset's values
GPU_DEFAULTS = dict(block_size=64, num_blocks=2, activation_ratio=0.85, pool_size=4, context_matches=0,
                    context_tokens=10)
# Chosen by measurement on the embedded models, 2 CPU cores. The block_size x pool_size grid (K=2, r=0.85
# fixed, as the paper does) gave (4, 8) before context n-grams existed; on a CPU every extra token in a
# forward costs compute, so small blocks win. Context n-grams then beat recycling at equal width: two
# 6-token context matches and no pool gave 1.41x AR against 0.78x for (4, 8) on the base model, and 1.57x
# against 1.28x on the Jacobi Forcing model (docs/tree-budgets.md, "Measured").
CPU_DEFAULTS = dict(block_size=4, num_blocks=2, activation_ratio=0.85, pool_size=0, context_matches=2,
                    context_tokens=6)


@dataclass(frozen=True)
class GpuSpec:
    """One representative part of a compute capability, from its public datasheet."""

    part: str
    bf16_tflops: float  # dense (no sparsity) bf16 tensor-core TFLOP/s
    memory_tbps: float  # memory bandwidth, TB/s

    @property
    def ridge(self) -> float:
        """FLOP per byte where the part stops being memory-bound."""
        return self.bf16_tflops / self.memory_tbps


#: compute capability -> the representative part whose datasheet the preset is derived from
GPU_SPECS: dict[tuple[int, int], GpuSpec] = {
    (8, 0): GpuSpec("A100 SXM 80GB (Ampere)", 312.0, 2.039),
    (8, 6): GpuSpec("A10 (Ampere)", 125.0, 0.600),
    (8, 9): GpuSpec("L40S (Ada)", 362.0, 0.864),
    (9, 0): GpuSpec("H200 SXM (Hopper; H100 SXM: 3.35 TB/s)", 989.0, 4.8),
    (10, 0): GpuSpec("B200 (Blackwell)", 2250.0, 8.0),
    # datasheet: 4 PFLOPS FP4 with sparsity; dense bf16 = / 2 (sparsity) / 4 (FP4 -> bf16)
    (12, 0): GpuSpec("RTX PRO 6000 Blackwell (Blackwell, workstation)", 500.0, 1.792),
}


#: the model the presets are derived for by default: Qwen2.5-7B (the Jacobi Forcing seed's base), bf16;
#: KV bytes per token = 28 layers x 4 KV heads x 128 dims x 2 (K and V) x 2 bytes
DEFAULT_MODEL = dict(params=7.6e9, kv_bytes_per_token=57344.0, context=2048)


def knee_tokens(spec: GpuSpec, params: float = 7.6e9, kv_bytes_per_token: float = 57344.0, context: int = 2048,
                batch: int = 1) -> float:
    """``n*``: tokens per forward (all rows) where the forward turns compute-bound (module docstring).

    Defaults: :data:`DEFAULT_MODEL` (a 7B model with grouped-query attention, 2,048 tokens of
    context per row).
    """
    return spec.ridge * (1.0 + kv_bytes_per_token * context * batch / (2.0 * params))


def _pow2_floor(x: float, low: int, high: int) -> int:
    p = low
    while p * 2 <= min(x, high):
        p *= 2
    return p


def _settings_for_width(width: float) -> dict[str, dict]:
    """Per-strategy settings that spend about ``width`` tokens per row per forward."""
    # Jacobi Forcing: K = 2 blocks of n (the chain, 2n tokens) must fit under the knee; the paper's
    # n=64, pool 4 is the anchor (H200 / B200 at batch 1)
    n = _pow2_floor(width / 2, 4, 64)
    pool = 4 if width >= 2 * n + 64 else (2 if width >= 2 * n + 16 else 0)
    # lookahead: W columns and G guesses of N - 1 tokens each; LADE's 7B A100 setting (15, 5, 15) is the cap
    ngram = 5 if width >= 64 else 4
    window = max(1, min(15, int(width // (2 * (ngram - 1)))))
    return {
        "jacobi": {"block_size": _pow2_floor(width, 4, 64)},
        "jacobi_forcing": {"block_size": n, "num_blocks": 2, "activation_ratio": 0.85, "pool_size": pool,
                           "context_matches": 0, "context_tokens": 10},
        "lookahead": {"window_size": window, "ngram_size": ngram, "guess_set_size": window, "context_matches": 2},
        "prompt_lookup": {"tree_budget": _pow2_floor(width, 8, 64), "max_matches": 4, "num_tokens": 10},
        "speculative": {"tree_budget": _pow2_floor(width, 16, 256), "drafter_dtype": "target"},
    }


def _cpu_preset() -> dict[str, dict]:
    return {
        "jacobi": {"block_size": 16},
        "jacobi_forcing": dict(CPU_DEFAULTS),
        "lookahead": {"window_size": 5, "ngram_size": 4, "guess_set_size": 5, "context_matches": 2},
        "prompt_lookup": {"tree_budget": 32, "max_matches": 4, "num_tokens": 10},
        "speculative": {"tree_budget": 16, "drafter_dtype": "bfloat16" if cpu_has_native_bf16() else "target"},
    }


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX): a drafter forward then reads half
    the bytes of an fp32 one at full speed; without them bf16 is emulated and slower than fp32. Probed once: every
    run on a CPU reads it through the preset."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(bool(getattr(torch.cpu, name)()) for name in probes if hasattr(torch.cpu, name))
    except Exception:  # noqa: BLE001 - a private probe that changed: assume no native bf16
        return False


#: torch's probes of oneDNN's half-precision matrix kernels (AVX-512 and up for bf16; AVX-512-FP16 or AMX for fp16)
_FAST_MATMUL_PROBES = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}


@functools.cache
def cpu_has_fast_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices on a oneDNN kernel. Without one (an AVX2-only CPU: no AVX-512)
    torch falls back to a kernel whose cost grows with every row: measured on such a CPU (2 threads), a 2048 x 2048
    bf16 product took 122 s against 0.28 s in fp32, and a 2048 x 8192 bf16 projection 4 ms for one token and 96 ms
    for 32 (fp32: 7 ms and 51 ms). A forward that feeds many tokens (a prompt, a draft tree, a large batch) is then
    many times slower than in fp32, and no speed figure in that dtype says what a model costs. ``True`` for fp32,
    and when torch's probe is missing (no warning on a guess)."""
    name = _FAST_MATMUL_PROBES.get(dtype)
    if name is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, name)())
    except Exception:  # noqa: BLE001 - a private probe that changed or is missing: assume the kernel exists
        return True


class SlowMatmulWarning(UserWarning):
    """A model is built in a dtype this CPU multiplies on a slow fallback (:func:`cpu_has_fast_matmul`)."""


def slow_matmul_message(dtype: torch.dtype, what: str, fix: str = "float32") -> str | None:
    """The warning for ``what`` (e.g. ``"--dtype bfloat16"``) in ``dtype`` on this CPU, naming the fix (``fix``: how
    the caller asks for float32); ``None`` where the CPU has a fast kernel for it."""
    if cpu_has_fast_matmul(dtype):
        return None
    name = str(dtype).replace("torch.", "")
    needs = "AVX-512" if dtype == torch.bfloat16 else "AVX-512-FP16 or AMX"
    return (f"{what} on this CPU: its oneDNN has no {name} matrix kernel (it needs {needs}), so torch multiplies such "
            f"matrices on a fallback whose cost grows with every token fed, many times float32's. Speed figures "
            f"measure that fallback, not the model; use {fix} here, or a CPU with {needs}.")


def _capability(device_or_capability) -> tuple[int, int] | None:
    """``(major, minor)`` for a CUDA device or a capability tuple; ``None`` for the CPU."""
    if isinstance(device_or_capability, str):
        try:
            device_or_capability = torch.device(device_or_capability)
        except RuntimeError as err:
            raise ValueError(f"hardware_preset: {device_or_capability!r} is not a device ('cpu', 'cuda', 'cuda:1'), "
                             "nor a compute capability tuple such as (9, 0).") from err
    if isinstance(device_or_capability, torch.device):
        if device_or_capability.type == "cpu":
            return None
        if device_or_capability.type != "cuda":
            raise ValueError(f"No preset for device type {device_or_capability.type!r}: use a CUDA device or 'cpu'.")
        return tuple(torch.cuda.get_device_capability(device_or_capability))
    if (isinstance(device_or_capability, tuple) and len(device_or_capability) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in device_or_capability)):
        return device_or_capability
    raise ValueError(
        f"hardware_preset takes a torch.device, 'cpu' / 'cuda[:i]', or a compute capability tuple such as (9, 0); "
        f"got {device_or_capability!r}."
    )


def preset_name(device_or_capability) -> str:
    """``"cpu"`` or ``"sm90"``-style name of the preset :func:`hardware_preset` picks."""
    cc = _capability(device_or_capability)
    return "cpu" if cc is None else f"sm{cc[0]}{cc[1]}"


def hardware_preset(device_or_capability, batch_size: int = 1, params: float = 7.6e9,
                    kv_bytes_per_token: float = 57344.0, context: int = 2048) -> dict[str, dict]:
    """Per-strategy settings for a device (``torch.device``, ``"cpu"`` / ``"cuda"``, or a capability tuple).

    GPUs: the knee ``n*`` of the part (:func:`knee_tokens`, for the given model size, context and
    batch) divided by ``batch_size`` is each row's width, which sets every strategy's sizes (see
    ``docs/hardware.md``). A capability between listed ones takes the closest lower listed
    architecture (``(8, 7)`` -> sm86). CPU: the settings measured on this project's CPU runs.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    cc = _capability(device_or_capability)
    if cc is None:
        return _cpu_preset()
    known = [c for c in sorted(GPU_SPECS) if c <= cc]
    if not known:
        raise ValueError(f"No preset for compute capability {cc}: the oldest supported is sm80 (Ampere).")
    spec = GPU_SPECS[known[-1]]
    width = knee_tokens(spec, params, kv_bytes_per_token, context, batch_size) / batch_size
    return _settings_for_width(width)


def device_preset(device) -> tuple[str, dict[str, dict]]:
    """``(name, preset)`` a strategy running on ``device`` uses for the settings it is not given.

    Unlike :func:`hardware_preset` it never refuses: a GPU older than sm80 takes the sm80 preset,
    and a device with no roofline here (``mps``, ``xpu``, ...) takes the CPU one; the name says which.
    """
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return preset_name(device), hardware_preset(device)
        except ValueError:
            return "sm80", hardware_preset((8, 0))
    return "cpu", _cpu_preset()


def preset_settings(model, decoding: str, **given) -> tuple[str, dict]:
    """``given`` with each ``None`` replaced by the model's device preset for ``decoding``; and the preset's name."""
    name, preset = device_preset(model.device)
    values = preset.get(decoding, {})
    return name, {k: (values[k] if v is None and k in values else v) for k, v in given.items()}
