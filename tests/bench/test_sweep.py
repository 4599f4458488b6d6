"""The matched-batch summary of a sweep (geometric means, largest batches), in the report as it
is written run by run, and in ``slidedp bench plot`` over several reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.tiny import write_tiny_config
from slidedp.bench import train as bench_train
from slidedp.bench.measure import RunSpec
from slidedp.bench.report import ratios
from slidedp.bench.sweep import fits, summary_lines, sweep_summary
from slidedp.cli import main


def _run(system: str, batch: int, tokens_per_s: float | None, status: str = "ok") -> dict[str, Any]:
    if tokens_per_s is None:
        return {"system": system, "batch": batch, "status": status, "error": f"{status} line"}
    return {
        "system": system, "batch": batch, "status": "ok", "tokens_per_s": tokens_per_s,
        "gpu_peak_reserved_gib": 10.0, "host_pss_peak_gib": 50.0 + batch,
    }  # fmt: skip


NO = "unavailable"
RUNS = [
    _run("ours", 4, 400.0), _run("zero3-offload", 4, 100.0), _run("roundpipe", 4, None, NO),
    _run("ours", 8, 900.0), _run("zero3-offload", 8, 400.0), _run("roundpipe", 8, None, NO),
    _run("ours", 16, 1600.0), _run("zero3-offload", 16, None, "oom"),
    _run("roundpipe", 16, None, NO), _run("ours", 32, None, "timeout"),
    {**_run("ours", 8, 1700.0), "world": 2},  # runs of several ranks are not matched
]  # fmt: skip


def test_geometric_mean_over_the_batches_where_both_ran_and_the_largest_batches() -> None:
    summary = sweep_summary(RUNS)
    zero, rp = summary["peers"]
    assert zero["system"] == "zero3-offload"
    assert zero["matched_batches"] == [4, 8]
    assert zero["ours_over_peer"] == [4.0, 2.25]
    assert zero["geomean_ours_over_peer"] == pytest.approx(math.sqrt(4.0 * 2.25))  # 3.0
    assert zero["unavailable"] is None
    assert rp["matched_batches"] == []
    assert rp["geomean_ours_over_peer"] is None
    assert rp["unavailable"] == "unavailable line"
    assert summary["fits"] == {
        "ours": {"largest_batch": 16, "failed_batch": 32, "failed_status": "timeout"},
        "zero3-offload": {"largest_batch": 8, "failed_batch": 16, "failed_status": "oom"},
        "roundpipe": {"largest_batch": None, "failed_batch": 4, "failed_status": "unavailable"},
    }
    assert summary_lines(summary) == [
        "ours/zero3-offload: geometric mean 3.00x over batches 4, 8 (tokens/s where both ran)",
        "ours/roundpipe: not run (unavailable line)",
        "largest batch trained: ours 16 (TIMEOUT at 32), zero3-offload 8 (OOM at 16), "
        "roundpipe none (UNAVAILABLE at 4)",
    ]
    row = ratios([r for r in RUNS if r.get("world", 1) == 1])[0]
    # against the systems that ran only (no fsdp2 or reference in RUNS), an unavailable one too
    assert row == {"batch": 4, "ours_over_zero3-offload": 4.0, "ours_over_roundpipe": None}


def test_the_json_report_is_rewritten_after_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r.json"
    seen: list[list[tuple[str, int]] | None] = []

    def fake_child(spec: RunSpec, workdir: Path) -> tuple[dict[str, Any], int]:
        # what a sweep cut short here would have kept
        runs = json.loads(out.read_text())["runs"] if out.exists() else None
        seen.append(None if runs is None else [(r["system"], r["batch"]) for r in runs])
        step_s = 0.5 if spec.system == "ours" else 1.0
        raw = {"system": spec.system, "batch": spec.batch, "status": "ok",
               "step_times_s": [step_s], "tokens_per_step": spec.batch * spec.seq_len}  # fmt: skip
        return raw, 2**30

    monkeypatch.setattr(bench_train, "run_child", fake_child)
    config = write_tiny_config(tmp_path / "m")
    args = ["bench", "train", "--shape", str(config), "--seq", "16", "--device", "cpu"]
    args += ["--sweep", "2,4", "--systems", "ours,zero-offload", "--json", str(out)]
    assert main(args) == 0
    assert seen == [
        None, [("ours", 2)], [("ours", 2), ("zero-offload", 2)],
        [("ours", 2), ("zero-offload", 2), ("ours", 4)],
    ]  # fmt: skip
    report = json.loads(out.read_text())
    assert [(r["system"], r["batch"]) for r in report["runs"]] == [
        ("ours", 2), ("zero-offload", 2), ("ours", 4), ("zero-offload", 4)
    ]  # fmt: skip
    assert report["summary"]["peers"][0]["geomean_ours_over_peer"] == pytest.approx(2.0)
    assert report["summary"]["fits"]["zero-offload"]["largest_batch"] == 4
    # each run's whole process time, for planning a device call's limits
    assert all(isinstance(r["wall_s"], float) and r["wall_s"] >= 0 for r in report["runs"])


def test_one_figure_and_one_summary_from_a_report_per_system(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    paths = []
    for system in ("ours", "zero3-offload", "roundpipe"):
        runs = [r for r in RUNS if r["system"] == system and r.get("world", 1) == 1]
        paths.append(tmp_path / f"{system}.json")
        paths[-1].write_text(
            json.dumps({"shape": "qwen3-4b", "seq_len": 1024, "device_name": "H100", "runs": runs})
        )
    png = tmp_path / "sweep.png"
    assert main(["bench", "plot", "--png", str(png), *map(str, paths)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"summary: {line}" for line in summary_lines(sweep_summary(RUNS))]


def test_a_batch_that_ran_in_another_sitting_is_not_the_systems_failure() -> None:
    """Merged reports: zero-offload timed out at B=16 under a short limit, then ran under a
    longer one; it trained 16, and its first failure is the OOM at 32."""
    runs = [
        {"system": "zero-offload", "batch": 16, "status": "timeout"},
        {"system": "zero-offload", "batch": 16, "status": "ok", "tokens_per_s": 1.0},
        {"system": "zero-offload", "batch": 32, "status": "oom"},
    ]
    assert fits(runs, "zero-offload") == {
        "largest_batch": 16, "failed_batch": 32, "failed_status": "oom",
    }  # fmt: skip
