"""Per-step wall time of each lane and the time the compute lane waited on each of them.

Lanes: ``prep`` (host cast into staging), ``h2d``, ``compute``, ``d2h``, ``offload``,
``update`` (host AdamW, from the update worker), ``nodes`` (the cross-node all-reduce). Waits
are the compute lane's: ``wait_update`` (version gates), ``wait_h2d`` / ``wait_d2h`` /
``wait_offload``. On CUDA a wait is the compute stream's idle time it caused: a stall on a copy
event, or, for a wait of the host thread, the time between the compute stream running out of
queued work and the thread issuing more (none when the thread is ahead of the GPU, as at long
sequences, where a layer's kernels outlast the wait). On CPU a wait is the host's wall time.
Invariant: no sync inside the step: on CUDA intervals are timing-event pairs resolved once at
the end of the step; on CPU ``time.monotonic`` (the Rust worker's clock). ``start_trace()``
keeps the intervals as spans on one timeline for ``runtime.trace``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

LANES = ("prep", "h2d", "compute", "d2h", "offload", "update", "nodes")
WAITS = ("wait_h2d", "wait_update", "wait_d2h", "wait_offload")


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel of ``device`` (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_event(timing: bool = False) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """Issue work on ``stream`` (CUDA), or in place (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


Span = tuple[str, float, float]  # (lane or wait key, start, end) in time.monotonic() seconds


class LaneClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda, self.device = device.type == "cuda", device
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.spans: list[Span] | None = None  # kept only while tracing
        self._reference: tuple[float, torch.cuda.Event] | None = None

    def reset(self) -> None:
        self._seconds = defaultdict(float)
        self._events = []

    def start_trace(self) -> None:
        """Keep this step's intervals as spans (until ``stop_trace``)."""
        self.spans = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            event = new_event(timing=True)
            event.record(torch.cuda.current_stream(self.device))
            event.synchronize()
            self._reference = (time.monotonic(), event)

    def stop_trace(self) -> list[Span]:
        spans, self.spans, self._reference = self.spans or [], None, None
        return spans

    def add(self, key: str, seconds: float) -> None:
        self._seconds[key] += seconds

    @contextmanager
    def host(self, key: str) -> Iterator[None]:
        """Time host work with the wall clock; a wait of the host thread (``WAITS``) on CUDA by
        the compute stream's idle time across it (see the module docstring)."""
        if self.cuda and key in WAITS:
            with self.stream(key, torch.cuda.current_stream(self.device)):
                yield
            return
        start = time.monotonic()
        try:
            yield
        finally:
            end = time.monotonic()
            self._seconds[key] += end - start
            if self.spans is not None:
                self.spans.append((key, start, end))

    @contextmanager
    def stream(self, key: str, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Time work issued on ``stream`` (CUDA events), or on the host when on CPU."""
        if not self.cuda or stream is None:
            with self.host(key):
                yield
            return
        start = new_event(timing=True)
        end = new_event(timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self._events.append((key, start, end))

    def summary(self) -> dict[str, float]:
        """Seconds per lane and per wait for the step (synchronises pending timing events)."""
        for key, start, end in self._events:
            end.synchronize()
            self._seconds[key] += start.elapsed_time(end) / 1000.0
            if self.spans is not None and self._reference is not None:
                t0, ref = self._reference
                begin = t0 + ref.elapsed_time(start) / 1000.0
                self.spans.append((key, begin, t0 + ref.elapsed_time(end) / 1000.0))
        self._events = []
        return {f"{k}_s": round(self._seconds.get(k, 0.0), 6) for k in LANES + WAITS}
