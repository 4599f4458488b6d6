"""The golden loss curves (scripts/loss_golden.py, tests/assets/losses/) hold bit for bit, and
the comparison names each step and value that moved."""

from __future__ import annotations

import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from slidedp.kernels import Kernels

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "loss_golden.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loss_golden", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


def _curve(losses: list[float], digest: str = "d0") -> dict[str, Any]:
    steps = [{"step": i + 1, "loss": x, "grad_norm": 2.0} for i, x in enumerate(losses)]
    return {"case": {"arch": "qwen3"}, "steps": steps, "final_params_sha256": digest}


def test_every_case_has_a_checked_in_curve() -> None:
    golden = _script()
    names = {c.name for c in golden.CASES}
    assert names == {p.stem for p in golden.GOLDEN_DIR.glob("*.json")}
    for name in names:
        curve = json.loads((golden.GOLDEN_DIR / f"{name}.json").read_text())
        assert [s["step"] for s in curve["steps"]] == [1, 2, 3, 4, 5], name


def test_resident_groups_on_two_ranks_keep_the_all_host_curve() -> None:
    """GPU-resident state on 2 ranks (each owner updates its groups) changes no bit of the
    2-rank all-host run's curve nor of its final parameters."""
    golden = _script().GOLDEN_DIR
    resident = json.loads((golden / "dense-2ranks-resident.json").read_text())
    host = json.loads((golden / "dense-2ranks-gpu-sharded.json").read_text())
    assert resident["steps"] == host["steps"]
    assert resident["final_params_sha256"] == host["final_params_sha256"]


def test_the_comparison_names_the_step_the_key_and_both_values() -> None:
    differences = _script().differences
    old = _curve([5.5, 5.25, 5.0])
    assert differences(old, _curve([5.5, 5.25, 5.0])) == []
    moved = differences(old, _curve([5.5, 5.250000000000001, 5.0], digest="d1"))
    assert moved == [
        "final_params_sha256: 'd0' -> 'd1'",
        "step 2 loss: 5.25 -> 5.250000000000001 (+1.7e-16)",  # one f64 ulp is a change
    ]
    assert differences(old, _curve([5.5, 5.25])) == ["steps: 3 -> 2"]
    assert differences(None, old) == ["no checked-in curve"]


@pytest.mark.e2e
@pytest.mark.skipif(
    platform.machine() != "x86_64" or "avx2" not in Kernels.supported_isas(),
    reason="the golden curves are the bits of x86-64 AVX2 paths",
)
def test_the_golden_curves_are_unchanged() -> None:
    """Ten short trainings (scripts/loss_golden.py's CASES); on failure its output lists each
    step that moved: a change of the math regenerates them on purpose (--regenerate)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all cases bit-identical" in proc.stdout
