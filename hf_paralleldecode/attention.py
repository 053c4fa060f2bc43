"""Which ``scaled_dot_product_attention`` backends a decoding call lets torch choose, and in which order.

Why
    On Hopper and Blackwell GPUs recent torch (with cuDNN 9.15 or later) tries cuDNN's attention first for bf16 and
    fp16. cuDNN builds an execution plan for every new combination of shapes, and decoding shapes are new at
    nearly every forward: the key length grows each step, a speculative step feeds a different number of tokens,
    a drafter runs at yet other lengths. cuDNN's own maintainers measure 55-70 ms per plan build on a B200
    (FlashInfer #5245), and torch has an opt-in to avoid the rebuilds (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``).
    On an H200 with torch 2.11 the DEER drafter's forward (2 layers) took 32-72 ms in bf16 against 2.0-2.5 ms in
    fp32, which cuDNN's attention does not serve.

What a decoding call does (:func:`decoding_attention`, entered by :func:`hf_paralleldecode.engine.run.decode`)
    Under the process-wide setting ``"auto"`` (the default), on a CUDA device whose priority order puts cuDNN's
    attention before flash and memory-efficient attention, the call runs with cuDNN's attention moved to the end
    of the order, i.e. torch's order on other GPUs: flash, then memory-efficient, then math. Which backends are
    *enabled* is not touched (a backend the user disabled stays disabled), and the order is restored when the call
    returns or raises. ``"torch"`` leaves torch's choice alone. A list of backend names (``"flash"``,
    ``"efficient"``, ``"cudnn"``, ``"math"``) is an explicit priority order for decoding calls, restricted to
    those backends. Everything else (CPU, other devices) is left as it is.

    Set it with :func:`set_attention_priority` (process-wide) or the :func:`attention_priority` context.
    The order is process-global torch state: another thread's attention calls during a decoding call see it too.

The same names serve the bench's ``--sdpa-backends`` (every entry restricted, stock ``generate`` included).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

__all__ = ["SDPA_BACKENDS", "ATTENTION_PRIORITIES", "check_sdpa_backends", "sdpa_backends_context",
           "check_attention_priority", "set_attention_priority", "get_attention_priority", "attention_priority",
           "decoding_attention", "sdpa_priority_names"]

#: backend names and torch's ``SDPBackend`` members they select
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
#: the named settings of :func:`set_attention_priority` (besides an explicit list of backend names)
ATTENTION_PRIORITIES = ("auto", "torch")

_setting: str | tuple[str, ...] = "auto"
_probed: set[str] = set()
_lock = threading.Lock()


def check_sdpa_backends(names, setting: str = "sdpa_backends",
                        torch_choice: str = "leave it unset for torch's own choice") -> list[str] | None:
    """``names`` as a list after checking them (``None``: torch's own choice); ``ValueError`` naming the choices,
    the ``setting`` they were given to and how that setting asks for torch's choice (``torch_choice``)."""
    if names is None:
        return None
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in SDPA_BACKENDS]
    if not names or unknown:
        raise ValueError(f"{setting} takes one or more of {sorted(SDPA_BACKENDS)}, got {names}"
                         f"{f' (unknown: {unknown})' if unknown else ''}: name the backends "
                         "scaled_dot_product_attention may use (e.g. flash efficient math to keep cuDNN's out), or "
                         f"{torch_choice}.")
    return names


def _members(names) -> list:
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names]


def sdpa_backends_context(names, priority: bool = False):
    """A context in which ``scaled_dot_product_attention`` uses only the backends ``names`` (torch's
    ``sdpa_kernel``; ``priority``: tried in that order); a no-op for ``None``."""
    names = check_sdpa_backends(names)
    if names is None:
        return contextlib.nullcontext()
    import inspect

    from torch.nn.attention import sdpa_kernel

    if not priority:
        return sdpa_kernel(_members(names))
    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        raise ValueError(f"An attention priority order ({names}) needs torch >= 2.6 (sdpa_kernel(set_priority=...)); "
                         f"this is torch {torch.__version__}. Upgrade torch or use the 'auto' / 'torch' setting.")
    return sdpa_kernel(_members(names), set_priority=True)


def check_attention_priority(value) -> str | tuple[str, ...]:
    """``value`` checked: ``"auto"``, ``"torch"`` or a non-empty sequence of backend names (returned as a tuple)."""
    if isinstance(value, str):
        if value in ATTENTION_PRIORITIES:
            return value
        raise ValueError(f"attention priority must be one of {ATTENTION_PRIORITIES} or a list of backend names "
                         f"({', '.join(SDPA_BACKENDS)}), got {value!r}: 'auto' moves cuDNN's attention after the "
                         "others on GPUs where torch tries it first, 'torch' leaves torch's order alone.")
    if isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        names = check_sdpa_backends(list(value), setting="attention priority",
                                    torch_choice="'torch' for torch's own order")
        if len(set(names)) != len(names):
            raise ValueError(f"attention priority names each backend once, got {names}.")
        return tuple(names)
    raise ValueError(f"attention priority must be one of {ATTENTION_PRIORITIES} or a non-empty list of backend "
                     f"names ({', '.join(SDPA_BACKENDS)}), got {value!r}.")


def set_attention_priority(value) -> None:
    """Set the attention priority of every later decoding call in this process (see the module docstring):
    ``"auto"`` (default), ``"torch"``, or a list of backend names tried in that order. ``ValueError`` on others."""
    global _setting
    _setting = check_attention_priority(value)


def get_attention_priority() -> str | tuple[str, ...]:
    """The process-wide attention priority of decoding calls."""
    return _setting


@contextlib.contextmanager
def attention_priority(value) -> Iterator[None]:
    """Within: decoding calls use the attention priority ``value`` (see :func:`set_attention_priority`)."""
    global _setting
    checked = check_attention_priority(value)
    before, _setting = _setting, checked
    try:
        yield
    finally:
        _setting = before


# ---- torch's state (small functions: the tests replace them) -------------------------------------------
def _priority_order() -> list[int] | None:
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    return None if get is None else [int(b) for b in get()]


def _set_priority_order(order: list[int]) -> None:
    torch._C._set_sdp_priority_order(order)


def _cudnn_enabled() -> bool:
    return bool(torch.backends.cuda.cudnn_sdp_enabled())


def _probe(device: torch.device) -> None:
    """One tiny math-only attention call on ``device``: torch settles its default order on the first call of a
    process (cuDNN first on Hopper / Blackwell), so the order read before any call is not the one it will use."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(1, 1, 2, 8, device=device, dtype=torch.float16)
    with sdpa_kernel([SDPBackend.MATH]):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)


def sdpa_priority_names() -> list[str] | None:
    """Torch's current priority order of the attention backends, by name (``None`` where torch has none)."""
    from torch.nn.attention import SDPBackend

    order = _priority_order()
    if order is None:
        return None
    names = {int(getattr(SDPBackend, member)): name for name, member in SDPA_BACKENDS.items()}
    return [names.get(b, SDPBackend(b).name.lower()) for b in order]


def _cudnn_last(order: list[int]) -> list[int] | None:
    """``order`` with cuDNN's attention after flash, memory-efficient and math; ``None`` when it already is."""
    from torch.nn.attention import SDPBackend

    cudnn = int(SDPBackend.CUDNN_ATTENTION)
    others = [int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.MATH)]
    if cudnn not in order or all(o not in order or order.index(o) < order.index(cudnn) for o in others):
        return None
    rest = [b for b in order if b != cudnn]
    last_of_others = max(rest.index(o) for o in others if o in rest)
    return rest[: last_of_others + 1] + [cudnn] + rest[last_of_others + 1:]


@contextlib.contextmanager
def decoding_attention(device) -> Iterator[dict]:
    """The attention priority of one decoding call on ``device`` (see the module docstring). Yields a dict that
    says what was done: ``{"attention_priority": setting, "sdpa_order": "torch" | "cudnn_last" | "explicit"}``."""
    device = torch.device(device)
    setting = _setting
    done = {"attention_priority": setting if isinstance(setting, str) else list(setting), "sdpa_order": "torch"}
    if device.type != "cuda" or setting == "torch":
        yield done
        return
    if isinstance(setting, tuple):
        with sdpa_backends_context(list(setting), priority=True):
            done["sdpa_order"] = "explicit"
            yield done
        return
    with _lock:
        if str(device) not in _probed:
            _probe(device)
            _probed.add(str(device))
    order = _priority_order()
    new = _cudnn_last(order) if order is not None and _cudnn_enabled() else None
    if new is None:
        yield done
        return
    _set_priority_order(new)
    done["sdpa_order"] = "cudnn_last"
    try:
        yield done
    finally:
        _set_priority_order(order)
