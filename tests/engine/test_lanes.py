"""The lane clock's waits: on CUDA a wait of the host thread is the compute stream's idle time
across it (timing events on that stream), not the host's wall time; on CPU the wall time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from slidedp.runtime import lanes
from slidedp.runtime.lanes import LaneClock


class _Event:
    """A timing event recorded at the GPU time ``clock`` gives next, in seconds."""

    def __init__(self, clock: Iterator[float]) -> None:
        self.clock, self.at = clock, 0.0

    def record(self, stream: Any) -> None:
        self.at = next(self.clock)

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000.0


def test_a_host_wait_on_cuda_counts_the_compute_streams_idle_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_times = iter([0.0, 0.004, 1.0, 1.0])  # (start, end) of the two waits, in record order
    monkeypatch.setattr(lanes, "new_event", lambda timing=False: _Event(gpu_times))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    clock = LaneClock(torch.device("cpu"))
    clock.cuda = True  # as on a GPU, with the events above
    with clock.host("wait_d2h"):  # the stream idled 4 ms of this 50 ms wait
        time.sleep(0.05)
    with clock.host("wait_update"):  # queued kernels outlasted this wait: no idle
        time.sleep(0.02)
    with clock.host("prep"):  # host work stays on the wall clock
        time.sleep(0.01)
    seconds = clock.summary()
    assert seconds["wait_d2h_s"] == pytest.approx(0.004)
    assert seconds["wait_update_s"] == 0.0
    assert seconds["prep_s"] >= 0.01


def test_a_wait_on_cpu_is_the_wall_time() -> None:
    clock = LaneClock(torch.device("cpu"))
    with clock.host("wait_d2h"):
        time.sleep(0.02)
    assert clock.summary()["wait_d2h_s"] >= 0.02
