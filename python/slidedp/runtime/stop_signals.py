"""SIGTERM and SIGINT become a request to stop after the current step (then checkpoint, exit).

The first signal only sets ``received`` and puts the previous handlers back, so a second
Ctrl-C interrupts at once. Handlers are installed from the main thread only (Python delivers
signals there); elsewhere the context is inert.

Example::

    with StopSignals() as stop:
        for t in range(steps):
            step(t)
            if stop.received is not None:
                save_checkpoint(...)
                break
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set in C
        self._previous.clear()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._restore()
