"""The policy selector's stage clock (``slidedp plan``, ``runtime.policy: auto``): each stage's
wall seconds, said in one line as it ends; their sum is the selection time, and
``break_even_steps`` what it costs in steps of the run.

Example::

    clock = Clock(say=print)
    with clock.stage("profile") as notes:       # says 'profile: 12.3 s (measured)' at its end
        report = profile_layer(args)
        notes.append("cached" if report["cached"] else "measured")
    clock.describe()   # 'selection 12.3 s (profile 12.3)'
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Clock:
    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._say = say

    @contextmanager
    def stage(self, name: str) -> Iterator[list[str]]:
        """Times the block as stage ``name``; what the block appends to the list is said
        after the seconds."""
        notes: list[str] = []
        start = time.perf_counter()
        yield notes
        spent = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + spent
        if self._say is not None:
            self._say(f"{name}: {spent:.1f} s" + (f" ({'; '.join(notes)})" if notes else ""))

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        return f"selection {self.total_s:.1f} s ({stages})"


def break_even_steps(selection_s: float, default_step_s: float, chosen_step_s: float) -> int | None:
    """Steps of the chosen policy that pay for the selection: its seconds over the seconds a
    step saves against the default (None: the choice saves nothing)."""
    saved = default_step_s - chosen_step_s
    return math.ceil(selection_s / saved) if saved > 0 else None
