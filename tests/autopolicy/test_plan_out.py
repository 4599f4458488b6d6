"""``slidedp plan``'s output: a plan for another GPU (``--gpu-memory``) computes in that GPU's
dtype; a refused plan leaves no folder behind, and a report path that cannot be written is
refused before measuring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.util import one_error_line, run
from plan.test_plan_json import _run


@pytest.mark.e2e
def test_a_plan_for_another_gpu_runs_in_its_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, out = _run(tmp_path), tmp_path / "p.json"
    argv = ["plan", str(path), "--gpu-memory", "80", "--out", str(out), "--steps", "1"]
    code, _, err = run(capsys, *argv, "--warmup", "0")
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert (plan["device"], plan["dtype"]) == ("cuda", "bfloat16")  # not this CPU's float32
    assert not (tmp_path / ".p.json.tmp").exists()


def test_a_refused_plan_leaves_no_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = _run(tmp_path), tmp_path / "new" / "p.json"
    code, _, err = run(capsys, "plan", str(path), "--gpu-memory", "80", "--out", str(out),
                       "train.max_stpes=3")  # fmt: skip
    assert code == 2
    assert "unknown key 'train.max_stpes'" in err
    assert not out.parent.exists()


def test_a_report_path_that_is_a_folder_is_refused_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = _run(tmp_path), tmp_path / "p.json"
    (tmp_path / "p.report.json").mkdir()
    code, _, err = run(capsys, "plan", str(path), "--gpu-memory", "80", "--out", str(out))
    assert code == 2
    one_error_line(err, "plan", "p.report.json: cannot write a file there")
    assert not out.exists()
