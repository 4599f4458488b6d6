"""The one selection pipeline (``autopolicy.choose``): ``slidedp plan`` and ``runtime.policy:
auto`` both run every stage of ``STAGES``, once each and in order; a cached or kept choice
ends the stages early."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from autopolicy.runs import resolve
from autopolicy.test_selection_cache import run  # noqa: F401  (the fixture)
from autopolicy.test_validate import GIB, FakeTrials
from slidedp.autopolicy import choose
from slidedp.cli import main
from slidedp.config import TrainConfig
from slidedp.plan.machine import Machine


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the stages ``choose`` runs from here on, in the order they run."""
    calls: list[str] = []

    def recording(stage: choose.Stage) -> choose.Stage:
        def recorded(s: choose.Selecting) -> None:
            calls.append(stage.__name__)
            stage(s)

        return recorded

    monkeypatch.setattr(choose, "STAGES", tuple(recording(s) for s in choose.STAGES))
    return calls


def test_plan_and_auto_run_every_stage_once_and_in_order(
    run: tuple[Path, Path, FakeTrials],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _, trials = run
    probe = Machine.probe

    def with_gpu(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Machine:
        return dataclasses.replace(probe(cfg, *args, **kwargs), gpu_total_bytes=80 * GIB)

    monkeypatch.setattr(Machine, "probe", with_gpu)
    stages = [s.__name__ for s in choose.STAGES]
    assert stages == ["kept", "cached", "measure", "profile", "host", "chunks", "solve",
                      "calibrate", "validate", "result", "check", "store"]  # fmt: skip
    calls = _recorded(monkeypatch)
    assert main(["plan", str(path), "--out", str(tmp_path / "plan.json")]) == 0
    assert calls == stages
    assert len(trials.ran) == 2  # the choice and the default, validated once
    calls.clear()
    resolve(path, "runtime.policy_force=true")  # select afresh, not from the plan's cache entry
    assert calls == stages
    assert len(trials.ran) == 4
    calls.clear()
    _, line = resolve(path)  # the cached selection: the stages after the cache do not run
    assert calls == ["kept", "cached"]
    assert "; from the cache " in line
