"""The device timer (``engine/timing.py``): forward times without a wait for the device at each forward."""

from __future__ import annotations

import time

import pytest
import torch

from hf_paralleldecode.engine.timing import DeviceTimer


def test_off_cuda_it_is_the_wall_clock():
    timer = DeviceTimer("cpu")
    with timer.timing():
        time.sleep(0.01)
    assert 0.01 <= timer.seconds < 1.0
    timer.seconds = 0.0
    assert timer.seconds == 0.0


class FakeEvent:
    """A CUDA event that records when it was recorded and when it was waited for."""

    log: list = []

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = len(FakeEvent.log)
        FakeEvent.log.append("record")

    def synchronize(self):
        FakeEvent.log.append("wait")

    def elapsed_time(self, end):
        return 250.0  # ms


def test_on_cuda_events_are_recorded_around_the_work_and_read_only_when_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a forward made the host wait"))
    FakeEvent.log = []
    timer = DeviceTimer("cuda")
    for _ in range(3):
        with timer.timing():
            FakeEvent.log.append("work")
    assert FakeEvent.log == ["record", "work", "record"] * 3  # no wait while the steps run
    assert timer.seconds == pytest.approx(0.75)  # read later: three events of 250 ms
    assert FakeEvent.log.count("wait") == 3 and timer.seconds == pytest.approx(0.75)  # read once
