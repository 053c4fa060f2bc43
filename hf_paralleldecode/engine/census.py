"""The host-sync census: what a decoding call asks of the device beyond its forwards, counted on any device.

What it is for
    On a GPU a decoding step is fast only when the host never waits for the device between forwards and launches
    few small kernels around them. Both are countable on a CPU, where nothing waits: :class:`HostCensus` records,
    while a ``generate`` call runs,

    * **reads**: the device-to-host reads (``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``,
      ``.numpy()``) outside the target's and the drafters' module forwards: each one a synchronisation on CUDA
      (those inside a forward, the modelling code's own, are counted apart as ``inner_reads``: stock pays them too);
    * **uploads**: tensors built from host lists for the run's device (``torch.tensor`` / ``torch.as_tensor`` of a
      Python list with a ``device=``): a blocking host-to-device copy on CUDA;
    * **ops**: the tensor operations dispatched *outside* the target's and the drafters' module forwards (the
      engine's and the strategies' own small ops, each a kernel launch on CUDA; views and metadata, which launch
      nothing, are not counted).

    Each read and upload is kept with the ``file:line`` of this package that made it. :func:`per_forward` turns two
    calls of different lengths into counts per target forward of the steady state (their difference over the
    difference of their forwards), which the census test holds to its budgets.

What it deliberately does not know
    Which strategy runs, and what a count costs on a given device.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..compat import no_kernel_ops, scalar_read_ops

__all__ = ["HostCensus", "Census", "per_forward", "host_values"]


def host_values(tensor: torch.Tensor) -> list:
    """``tensor.tolist()`` of a tensor that lives on the host whatever the run's device (a CPU generator's draw): not
    a read of the device, so the census does not count it."""
    _HOST.active = True
    try:
        return tensor.tolist()
    finally:
        _HOST.active = False

_PACKAGE = str(Path(__file__).resolve().parent.parent)
_HOST = threading.local()  # set while host_values reads a tensor that lives on the host
#: ops that read a tensor's value on the host (``item``, ``int``, ``bool``, ``float``)
_SCALAR_READS = scalar_read_ops()
#: ops that only describe a tensor or make a view of it (no kernel launched): not counted
_FREE_NAMES = no_kernel_ops()


def _site(depth: int = 2) -> str:
    """Where a read was made: the innermost ``depth`` frames of this package outside this file, innermost first
    (``path:line <- path:line``), else the innermost frame."""
    frames = traceback.extract_stack()[:-2]
    ours = [f for f in reversed(frames) if f.filename.startswith(_PACKAGE) and not f.filename.endswith("census.py")]
    if not ours:
        return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    root = Path(_PACKAGE).parent
    return " <- ".join(f"{Path(f.filename).relative_to(root)}:{f.lineno}" for f in ours[:depth])


@dataclass
class Census:
    """What one recorded stretch asked of the device (see the module docstring)."""

    reads: Counter = field(default_factory=Counter)  # file:line -> reads outside module forwards
    inner_reads: Counter = field(default_factory=Counter)  # file:line -> reads inside the target's / drafters' forwards
    uploads: Counter = field(default_factory=Counter)  # file:line -> host-built tensors
    ops: Counter = field(default_factory=Counter)  # op name -> count, outside module forwards
    forwards: int = 0  # target forwards (the prefill included)

    @property
    def num_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def num_uploads(self) -> int:
        return sum(self.uploads.values())

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())


class _Mode(TorchDispatchMode):
    def __init__(self, census: HostCensus):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        c = self.census
        if func in _SCALAR_READS:
            c.count_read()
        elif c.inside == 0 and (name := func.overloadpacket.__name__) not in _FREE_NAMES:
            c.record.ops[name] += 1
        return out


class HostCensus:
    """Counts reads, uploads and small ops while entered (see the module docstring).

    ``modules``: the target and the drafters whose ``forward`` calls are excluded from the op count (their reads are
    still counted: a read inside a model is a read). The target's forwards are counted as ``forwards``."""

    def __init__(self, target: torch.nn.Module, *modules: torch.nn.Module):
        self.target, self.modules = target, [target, *modules]
        self.inside = 0
        self.record = Census()

    @contextmanager
    def recording(self):
        """Record into a fresh :class:`Census` (yielded) while the block runs."""
        self.record = census = Census()
        hooks = []
        for module in self.modules:
            hooks.append(module.register_forward_pre_hook(self._enter))
            hooks.append(module.register_forward_hook(self._leave))
        hooks.append(self.target.register_forward_pre_hook(self._count_forward))
        patched = self._patch()
        try:
            with _Mode(self):
                yield census
        finally:
            for undo in patched:
                undo()
            for hook in hooks:
                hook.remove()

    def count_read(self) -> None:
        if getattr(_HOST, "active", False):
            return
        (self.record.inner_reads if self.inside else self.record.reads)[_site()] += 1

    def _enter(self, module, args):
        self.inside += 1

    def _leave(self, module, args, output):
        self.inside -= 1

    def _count_forward(self, module, args):
        if self.inside == 1:  # the target's own call (not a drafter reading it)
            self.record.forwards += 1

    def _patch(self) -> list:
        """Wrap the host reads that do not dispatch an op (``tolist``, ``numpy``) and the host-built tensors."""
        census = self
        undo = []

        def wrap_read(name):
            original = getattr(torch.Tensor, name)

            def read(self, *args, **kwargs):
                census.count_read()
                return original(self, *args, **kwargs)

            setattr(torch.Tensor, name, read)
            undo.append(lambda: setattr(torch.Tensor, name, original))

        for name in ("tolist", "numpy"):
            wrap_read(name)

        def wrap_build(name):
            original = getattr(torch, name)

            def build(data, *args, **kwargs):  # (a tensor built without device= stays on the host: not counted)
                if kwargs.get("device") is not None and isinstance(data, list | tuple):
                    census.record.uploads[_site()] += 1
                return original(data, *args, **kwargs)

            setattr(torch, name, build)
            undo.append(lambda: setattr(torch, name, original))

        for name in ("tensor", "as_tensor"):
            wrap_build(name)
        return undo


def per_forward(short: Census, long: Census) -> dict:
    """Counts per target forward of the steady state: ``long`` minus ``short`` (two calls of different lengths, the
    same prompts and settings) over the difference of their forwards. ``sites``: the reads and uploads of the
    difference, by ``file:line``, per forward."""
    forwards = long.forwards - short.forwards
    if forwards <= 0:
        raise ValueError(f"per_forward needs the longer call to make more forwards ({long.forwards} vs "
                         f"{short.forwards}): lengthen it.")
    reads = long.reads - short.reads
    uploads = long.uploads - short.uploads
    return dict(forwards=forwards, reads=(long.num_reads - short.num_reads) / forwards,
                uploads=(long.num_uploads - short.num_uploads) / forwards,
                ops=(long.num_ops - short.num_ops) / forwards,
                sites={k: v / forwards for k, v in (reads + uploads).most_common()})

