"""``runtime.startup.StartupClock``: each part of the trainer's build timed (a part timed twice
adds up, one that raised still counted), and the banner's line in build order with the
engine's page-locking and resident state named inside its build; a part under 0.05 s unsaid."""

from __future__ import annotations

import time

import pytest

from slidedp.runtime.startup import StartupClock


def test_parts_add_up_and_the_line_keeps_the_build_order() -> None:
    clock = StartupClock()
    with clock.part("engine_s"):
        time.sleep(0.02)
    with clock.part("store_create_s"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), clock.part("store_create_s"):
        raise RuntimeError("a part that failed still took its time")
    assert clock.parts["engine_s"] >= 0.02
    assert clock.parts["store_create_s"] >= 0.01
    clock.parts.update(store_create_s=1.94, engine_s=8.26, fill_state_s=12.0, mirror_s=0.01)
    line = clock.line(pin_s=4.04, resident_s=0.01)  # under 0.05 s: not named
    assert (
        line
        == "  start-up: store created 1.9 s, weights 12.0 s, engine 8.3 s (of it pinning 4.0 s)"
    )
    assert StartupClock().line(0.0, 0.0) == "  start-up: 0.0 s"


def test_a_note_follows_the_parts_on_the_line() -> None:
    clock = StartupClock()
    clock.parts.update(fill_state_s=6.1, kernels_s=0.4)
    clock.note(None)  # nothing to say: nothing added
    clock.note("the kernel warm-up failed (x): the first step compiles its kernels")
    assert clock.line(0.0, 0.0) == (
        "  start-up: weights 6.1 s, kernel warm-up wait 0.4 s; the kernel warm-up failed (x): "
        "the first step compiles its kernels"
    )
