"""``slidedp bench nodes``: the prediction's shape (the reduction grows with the nodes, blocking
costs more than its own stream) and its refusals. The measurement launches simulated nodes
(tests/multirank/test_node_launch.py tests those launches)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from cli.util import one_error_line, run


def test_the_prediction_grows_with_the_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "nodes.json"
    code, out, _ = run(
        capsys,
        "bench",
        "nodes",
        "--predict",
        "qwen3-1.7b",
        "--batch",
        "4",
        "--seq-len",
        "512",
        "--json",
        str(report),
    )
    assert code == 0
    assert "PREDICTION" in out
    rows = json.loads(report.read_text())
    assert [r["nodes"] for r in rows] == [1, 2, 4, 8]
    for a, b in itertools.pairwise(rows):
        assert b["reduce_layer_s"] > a["reduce_layer_s"]
        assert b["blocking_s"] > a["blocking_s"]
        assert b["overlapped_s"] >= a["overlapped_s"]
    for r in rows:  # the engine's synchronous collective can only cost more
        assert r["blocking_s"] >= r["overlapped_s"]
    # blocking: each of the 28 layers' backward waits for its reduction, so a second node adds
    # about one cross-node all-reduce per layer to the step
    assert rows[1]["blocking_s"] - rows[0]["blocking_s"] > 10 * rows[1]["reduce_layer_s"]


@pytest.mark.parametrize("argv", [["--nodes", "1"], ["--steps", "2"], ["--ranks", "0"]])
def test_bad_measurement_settings_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, _, err = run(capsys, "bench", "nodes", *argv)
    assert code == 2
    one_error_line(err, "bench", "--nodes must be >= 2")
