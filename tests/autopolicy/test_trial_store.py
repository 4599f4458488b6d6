"""The host store held between the trials of one process (``autopolicy.trial_store``): a trial
of the held layout creates no store and starts at version 0, one of another layout replaces it,
a trial that fails drops it, and every trial still reports its step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from autopolicy.runs import run_config
from slidedp.autopolicy import validate
from slidedp.autopolicy.trial_store import TrialStores
from slidedp.config import TrainConfig, load_config
from slidedp.runtime.trainer import Trainer
from slidedp.store import HostStore


def _trial_config(tmp_path: Path, *overrides: str) -> TrainConfig:
    """The tiny Qwen3's run as a trial runs it (scratch output, no resume)."""
    cfg = load_config(run_config(tmp_path, 4, {}), list(overrides))
    return validate.trial_config(cfg, 3, tmp_path / "scratch")


def _shm_mappings() -> set[str]:
    """This process's mappings of shared-memory files (a store is one, in /dev/shm)."""
    return {x for x in Path("/proc/self/maps").read_text().splitlines() if "/dev/shm/" in x}


@pytest.fixture
def creations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per ``HostStore.create`` call."""
    made: list[int] = []
    create = HostStore.create

    def counted(cls: type[HostStore], *args: Any, **kwargs: Any) -> HostStore:
        made.append(1)
        return create(*args, **kwargs)

    monkeypatch.setattr(HostStore, "create", classmethod(counted))
    return made


@pytest.mark.e2e
def test_trials_of_one_layout_share_one_store(tmp_path: Path, creations: list[int]) -> None:
    """The layer policy is not in the store's layout: the default after the choice creates
    nothing, its steps start at version 0 and it still reports its step."""
    stores = TrialStores()
    first = validate.run_trial(_trial_config(tmp_path, "runtime.layers=N"), 3, stores=stores)
    held = stores.held
    assert held is not None
    assert held.version(0) == 3  # the first trial's three steps published
    trainer = stores.trainer(_trial_config(tmp_path, "runtime.layers=F"))
    assert trainer.store is held
    assert [held.version(g) for g in range(held.num_groups)] == [0] * held.num_groups
    times = trainer.timed_steps(3)
    del trainer
    assert len(times) == 3
    assert all(t > 0 for t in times)
    second = validate.run_trial(_trial_config(tmp_path, "runtime.layers=F"), 3, stores=stores)
    assert (len(creations), stores.created, stores.reused) == (1, 1, 2)
    assert [(t.layout, t.reserved_bytes) for t in (first, second)] == [("N", None), ("F", None)]
    assert first.step_s is not None
    assert second.step_s is not None
    assert second.step_s > 0


@pytest.mark.e2e
def test_another_layout_replaces_the_held_store(tmp_path: Path, creations: list[int]) -> None:
    stores = TrialStores()
    before = _shm_mappings()
    validate.run_trial(_trial_config(tmp_path), 2, stores=stores)
    first = _shm_mappings() - before
    assert first  # held between trials
    validate.run_trial(_trial_config(tmp_path, "runtime.grad_slots=3"), 2, stores=stores)
    assert (len(creations), stores.created, stores.reused) == (2, 2, 0)
    now = _shm_mappings() - before
    assert now  # the second store held
    assert not now & first  # the first released
    stores.drop()
    assert _shm_mappings() <= before


@pytest.mark.e2e
def test_a_trial_out_of_memory_drops_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, creations: list[int]
) -> None:
    """Its store is mid-step: the next trial starts on a fresh one."""
    stores = TrialStores()
    validate.run_trial(_trial_config(tmp_path), 2, stores=stores)
    steps = Trainer.timed_steps

    def out_of_memory(self: Trainer, count: int) -> list[float]:
        self.engine.close()
        raise torch.OutOfMemoryError("CUDA out of memory (faked)")

    monkeypatch.setattr(Trainer, "timed_steps", out_of_memory)
    failed = validate.run_trial(_trial_config(tmp_path), 2, stores=stores)
    assert failed.step_s is None
    assert stores.held is None
    monkeypatch.setattr(Trainer, "timed_steps", steps)
    again = validate.run_trial(_trial_config(tmp_path), 2, stores=stores)
    assert again.step_s is not None
    assert (len(creations), stores.created, stores.reused) == (2, 2, 1)
