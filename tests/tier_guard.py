"""The fast tier stays fast: a test without the ``e2e`` marker that trains fails, naming the fix.

Training here means ``Trainer.run`` or ``Trainer.timed_steps`` in this process (forked ranks
inherit the check), or a child process (started or forked from a zygote) of ``python -m
slidedp train|bench`` or of one of slidedp's worker modules (ranks, trials, probes, bench
workers), or the golden-curve script.
The call raises ``EndToEndOutsideItsTier`` and the test fails at teardown with one line, even
where the code under test caught the error. Loaded by ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import pytest

VERBS = frozenset({"train", "bench"})
SCRIPTS = ("loss_golden.py",)


# Tiers that are never the fast one: GPU tests are deselected unless asked for by marker.
OWN_TIERS = ("e2e", "gpu", "multi_gpu")


class EndToEndOutsideItsTier(RuntimeError):
    """Raised where a test outside the end-to-end and GPU tiers starts a training."""


class Guard:
    """The running test and the trainings it started without the marker."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started: list[str] = []

    def check(self, what: str) -> None:
        if self.item is None or any(self.item.get_closest_marker(m) for m in OWN_TIERS):
            return
        self.started.append(what)
        raise EndToEndOutsideItsTier(
            f"{self.item.nodeid} runs {what} without @pytest.mark.e2e: mark it (see "
            "docs/testing.md), or test the unit without training"
        )


def trains(argv: Sequence[object]) -> str | None:
    """What ``argv`` (a child process's command) runs, where that is a training; else None."""
    args = [str(a) for a in argv]
    if any(a.endswith(SCRIPTS) for a in args):
        return " ".join(args[1:2])
    for flag, module, verb in zip(args, args[1:], [*args[2:], ""], strict=False):
        if flag == "-m" and module == "slidedp" and verb in VERBS:
            return f"slidedp {verb}"
        if flag == "-m" and module.startswith("slidedp."):
            return f"python -m {module}"
    return None


def _wrap(guard: Guard, what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        guard.check(what)
        return original(*args, **kwargs)

    return guarded


def _popen(guard: Guard, original: Callable[..., None]) -> Callable[..., None]:
    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        command = kwargs.get("args", args[0] if args else ())
        what = trains([command] if isinstance(command, str | bytes) else list(command))
        if what is not None:
            guard.check(what)
        original(self, *args, **kwargs)

    return guarded


def _forked(guard: Guard, original: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(self: Any, module: str, argv: list[str], *args: Any, **kwargs: Any) -> Any:
        what = trains(["python", "-m", module, *argv])
        if what is not None:
            guard.check(what)
        return original(self, module, argv, *args, **kwargs)

    return guarded


GUARD = Guard()


def pytest_configure(config: pytest.Config) -> None:
    import subprocess

    from slidedp.runtime.trainer import Trainer
    from slidedp.runtime.zygote import Zygote

    mp = pytest.MonkeyPatch()
    config.add_cleanup(mp.undo)
    mp.setattr(Trainer, "run", _wrap(GUARD, "Trainer.run", Trainer.run))
    mp.setattr(Trainer, "timed_steps", _wrap(GUARD, "Trainer.timed_steps", Trainer.timed_steps))
    mp.setattr(subprocess.Popen, "__init__", _popen(GUARD, subprocess.Popen.__init__))
    mp.setattr(Zygote, "start", _forked(GUARD, Zygote.start))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    GUARD.item, GUARD.started = item, []
    try:
        return (yield)
    finally:
        GUARD.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "teardown" and GUARD.started and item is GUARD.item:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started {', '.join(GUARD.started)} without @pytest.mark.e2e: "
            "mark it (docs/testing.md) or test the unit without training"
        )
    return report
