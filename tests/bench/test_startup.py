"""The time to the first step of ours in ``slidedp bench train``'s report, in its parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny import tiny_spec
from slidedp.bench.child import run_child
from slidedp.bench.ours import process_age_s


@pytest.mark.e2e
def test_ours_reports_its_time_to_the_first_step_in_parts(tmp_path: Path) -> None:
    result, _ = run_child(tiny_spec(tmp_path / "m", "ours"), tmp_path)
    assert result["status"] == "ok", result
    s = result["startup_s"]
    assert set(s) == {"process_s", "config_s", "trainer_init_s", "fill_state_s", "pin_s",
                      "other_init_s", "first_step_s", "to_first_step_s"}  # fmt: skip
    assert all(v >= 0 for v in s.values()), s
    assert s["process_s"] > 0.5  # the interpreter and torch's import count
    assert s["fill_state_s"] > 0  # the tiny model initialised and copied into the store
    assert s["pin_s"] == 0  # nothing to page-lock without CUDA
    # the parts add up (each rounded to the millisecond)
    whole = s["trainer_init_s"] - s["fill_state_s"] - s["pin_s"]
    assert s["other_init_s"] == pytest.approx(whole, abs=3e-3)
    before = s["process_s"] + s["config_s"] + s["trainer_init_s"] + s["first_step_s"]
    assert s["to_first_step_s"] == pytest.approx(before, abs=4e-3)
    assert s["first_step_s"] > 0


def test_the_process_age_counts_from_the_process_start() -> None:
    first = process_age_s()
    assert 0 < first < 24 * 3600
    assert process_age_s() >= first
