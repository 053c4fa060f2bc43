"""Seconds of device work, timed without making the host wait.

What it is for
    The batch policy and the statistics need each step's forward time. Read with ``torch.cuda.synchronize()`` around
    every forward, the host waits for the device two or three times a step, which on a GPU is what makes decoding
    host-bound. :class:`DeviceTimer` records a pair of CUDA events around the work instead and reads them later, when
    :attr:`DeviceTimer.seconds` is asked for: by then the step's one read (the verdict) has waited for the device
    anyway, so reading the events costs nothing. Off CUDA it is the wall clock.

What it deliberately does not know
    What is timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["DeviceTimer"]


class DeviceTimer:
    """Accumulated seconds of the work run inside :meth:`timing` on ``device`` (see the module docstring)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._done = 0.0
        self._pending: list[tuple] = []  # (start, end) events not read yet

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Time the block: CUDA events recorded around it (read later), or the wall clock."""
        if not self.cuda:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._done += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((start, end))

    @property
    def seconds(self) -> float:
        """Every timed block's seconds so far (waits only for events the device has not reached yet)."""
        if self._pending:
            for start, end in self._pending:
                end.synchronize()  # (done already when the step's read has waited for the device)
                self._done += start.elapsed_time(end) / 1e3
            self._pending = []
        return self._done

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._pending = []
        self._done = float(value)
