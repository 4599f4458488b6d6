"""SIGTERM and SIGINT become a request to stop after the current step (then checkpoint, exit).

The first signal sets ``received`` and puts SIGINT's previous handler back, so a second Ctrl-C
interrupts at once; with ``absorb_repeats`` (a rank the launcher started: its second signal kills
the ranks itself) a repeated SIGINT is absorbed too, and once one was received both stay
ignored after the context (the rank saves and leaves: a scheduler's second copy must not kill
it in its last collective). Invariant: further SIGTERMs are absorbed until the context ends (a
scheduler's copy through the launcher must not kill a rank mid-save). Handlers are installed
from the main thread only; elsewhere the context is inert.

Example::

    with StopSignals() as stop:
        for t in range(steps):
            step(t)
            if stop.received is not None:
                break  # then save a checkpoint
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self, absorb_repeats: bool = False) -> None:
        self.received: signal.Signals | None = None
        self.absorb_repeats = absorb_repeats
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        if not self.absorb_repeats:
            self._restore(signal.SIGINT)

    def _restore(self, *only: signal.Signals) -> None:
        """Put the previous handlers back (of ``only`` these signals, if given)."""
        for sig in [s for s in self._previous if not only or s in only]:
            handler = self._previous.pop(sig)
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set in C

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.absorb_repeats and self.received is not None:
            for sig in list(self._previous):
                self._previous[sig] = signal.SIG_IGN
        self._restore()
