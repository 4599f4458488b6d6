"""The step-time model (``slidedp_core::model``, ``plan.timing``) from Python: the binding, its
errors, and a traced H100 step the model must reproduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slidedp.cli import main
from slidedp.errors import InvalidArgumentError
from slidedp.plan.timing import predict_step, spec_from_trace, traced_step_s

TRACES = Path(__file__).parents[2] / "benchmarks" / "traces"


def _spec(layers: int = 3, update_s: float = 0.1) -> dict[str, object]:
    groups = layers + 2
    return {
        "forward_s": [1.0] * layers, "backward_s": [2.0] * layers, "embed_forward_s": 0.0,
        "head_s": 1.0, "embed_backward_s": 0.0, "load_s": [0.5] * groups,
        "grad_copy_s": [0.5] * groups, "update_s": [update_s] * groups, "slots": 2,
        "grad_slots": 4, "clipping": False,
    }  # fmt: skip


def test_the_binding_returns_the_rust_prediction() -> None:
    p = predict_step(_spec())
    # 3 x (1 + 2) + 1 = 10 s of compute; the boundary adds the last copies (layer 1, embedding),
    # the embedding's update and the next step's first two loads: 1 + 0.1 + 1
    assert p["step_s"] == pytest.approx(12.1)
    assert p["busy_s"]["compute"] == pytest.approx(10.0)
    assert p["critical_path"][-1] == "t3 end"
    slow = predict_step(_spec(update_s=3.0))
    assert slow["regime"].startswith("Update-bound")


def test_a_bad_spec_is_one_error_naming_the_field() -> None:
    bad = _spec()
    bad["update_s"] = [0.1]
    with pytest.raises(InvalidArgumentError, match="update_s has 1 entries, expected 5"):
        predict_step(bad)
    missing = _spec()
    del missing["head_s"]
    with pytest.raises(InvalidArgumentError, match="head_s"):
        predict_step(missing)


@pytest.mark.parametrize(
    ("trace", "clipping"),
    [("qwen3-4b-h100-mirror-clip-b16.json", True), ("qwen3-4b-h100-mirror-noclip-b16.json", False)],
)
def test_a_traced_h100_step_is_predicted_within_ten_percent(trace: str, clipping: bool) -> None:
    # measured 2026-11-22 (BENCHMARKS.md); the model is given each operation's traced duration
    # and must reproduce the step from the engine's dependencies alone
    data = json.loads((TRACES / trace).read_text())
    spec = spec_from_trace(data, slots=2, grad_slots=4)
    assert spec["clipping"] is clipping
    assert len(spec["forward_s"]) == 36
    error = predict_step(spec)["step_s"] / traced_step_s(data) - 1
    assert abs(error) <= 0.10, error


def test_bench_model_prints_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.json"
    trace = TRACES / "qwen3-4b-h100-mirror-clip-b4.json"
    assert main(["bench", "model", str(trace), "--json", str(out)]) == 0
    assert "qwen3-4b-h100-mirror-clip-b4.json" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert abs(row["error"]) < 0.02
    assert row["regime"].startswith("Update-bound")  # B=4: one AdamW pass binds the step
