"""How long each part of a trainer's build took: the store created (``/dev/shm``, every page
allocated), the weights into it (read or initialised), the BF16 mirror cast, the data read,
the engine built (of which page-locking and the GPU-resident groups' state, timed by the
engine). The banner prints them; the bench reports them per run (``bench.ours.startup``).

Example::

    clock = StartupClock()
    with clock.part("store_create_s"):
        store = HostStore.create(...)
    clock.parts  # {"store_create_s": 1.9}
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from slidedp.kernels import Kernels, default_threads
from slidedp.runtime.window import fill_mirror
from slidedp.store import HostStore

if TYPE_CHECKING:
    from slidedp.models.hf import HFAdapter

# the parts in build order, as the banner names them
PARTS = {
    "store_create_s": "store created",
    "fill_state_s": "weights",
    "mirror_s": "BF16 mirror",
    "data_s": "data",
    "engine_s": "engine",
    "kernels_s": "kernel warm-up wait",
}


class StartupClock:
    """Seconds per part of the build (a part timed twice adds up); parts not run stay out."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.notes: list[str] = []  # what the banner's line adds (a part that fell short)
        self.warmup_s: float | None = None  # the kernel warm-up's own time, beside the parts

    def note(self, line: str | None) -> None:
        """Adds ``line`` (None: nothing) to the banner's start-up line."""
        if line is not None:
            self.notes.append(line)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - started

    def line(self, pin_s: float, resident_s: float) -> str:
        """The banner's line: each part that took time (0.05 s or more), in build order, and
        of the engine's build its page-locking and resident state (``pin_s``, ``resident_s``,
        timed by the engine)."""
        shown = {key: s for key, s in self.parts.items() if key in PARTS and s >= 0.05}
        said = [f"{what} {shown[key]:.1f} s" for key, what in PARTS.items() if key in shown]
        inside = [
            f"{what} {s:.1f} s"
            for what, s in (("pinning", pin_s), ("resident state", resident_s))
            if s >= 0.05
        ]
        if inside and "engine_s" in shown:
            said[-1] += f" (of it {', '.join(inside)})"
        said = said or [f"{sum(self.parts.values()):.1f} s"]
        return "  start-up: " + "; ".join([", ".join(said), *self.notes])


def build_store(
    adapter: HFAdapter,
    args: dict[str, Any],
    fill: Callable[[HostStore], str],
    clock: StartupClock,
) -> tuple[HostStore, str]:
    """A node's store (``HostStore.create(adapter's groups, **args)``), its state written by
    ``fill`` (which says where from) and its BF16 mirror cast, each part timed on ``clock``."""
    with clock.part("store_create_s"):
        store = HostStore.create(adapter.group_specs(), **args)
    with clock.part("fill_state_s"):
        source = fill(store)
    with clock.part("mirror_s"):
        fill_mirror(store, Kernels(default_threads()))
    return store, source
