"""A smaller machine than this one (``--gpu-limit``, ``--host-limit``) and one sweep figure drawn
from several reports (``slidedp bench plot``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench.tiny import tiny_spec
from slidedp.bench.child import crash_status, run_child
from slidedp.bench.measure import gpu_memory, process_tree
from slidedp.bench.plot import merge_reports
from slidedp.cli import main
from slidedp.errors import ConfigError


@pytest.mark.e2e
def test_a_run_past_the_host_limit_is_killed_and_reported_as_oom(tmp_path: Path) -> None:
    # Any Python process that has imported torch is well past 10 MiB of PSS.
    spec = dataclasses.replace(tiny_spec(tmp_path, "reference"), host_limit_gib=0.01)
    result, peak = run_child(spec, tmp_path)
    assert result["status"] == "oom"
    assert result["error"].startswith("host memory: PSS ")
    assert result["error"].endswith("passed --host-limit 0.01 GiB; killed")
    assert peak > 0.01 * 2**30
    assert process_tree(os.getpid()) == [os.getpid()], "the killed child left no process"


def test_a_negative_limit_is_one_error_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any worker starts; a limit that touches no run is reported by
    tests/bench/test_train.py's end-to-end bench (``--host-limit 64``)."""
    config = tiny_spec(tmp_path / "m", "ours").config_dir
    args = ["bench", "train", "--shape", config, "--seq", "16", "--device", "cpu", "--batch", "2"]
    assert main([*args, "--host-limit", "-1"]) == 2
    assert "--gpu-limit and --host-limit are GiB > 0" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_run_past_the_gpu_limit_is_oom(tmp_path: Path) -> None:
    spec = dataclasses.replace(
        tiny_spec(tmp_path, "reference"), device="cuda", batch=64, seq_len=128, gpu_limit_gib=0.001
    )
    result, _ = run_child(spec, tmp_path)  # a child, as the bench: the cap is per process
    assert result["status"] == "oom"
    assert result["error"].startswith("OutOfMemoryError")


def test_the_allocators_retries_are_reported_with_the_peaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run at the edge of the device's memory shows as retries (each a synchronising pass
    that freed the cache), beside the peaks; on CPU every key is there, None."""
    import torch

    stats = {"num_alloc_retries": 7}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 2 * 2**30)
    assert gpu_memory(torch.device("cuda", 0)) == {
        "gpu_peak_reserved_bytes": 3 * 2**30, "gpu_peak_allocated_bytes": 2 * 2**30,
        "gpu_alloc_retries": 7,
    }  # fmt: skip
    assert gpu_memory(torch.device("cpu")) == {
        "gpu_peak_reserved_bytes": None, "gpu_peak_allocated_bytes": None,
        "gpu_alloc_retries": None,
    }  # fmt: skip


def _report(shape: str, batches: tuple[int, ...]) -> dict[str, object]:
    runs = [
        {"system": system, "batch": b, "status": "ok", "tokens_per_s": 100.0 * b,
         "gpu_peak_reserved_gib": 1.0, "host_pss_peak_gib": 2.0}
        for b in batches
        for system in ("ours", "fsdp2")
    ]  # fmt: skip
    return {"shape": shape, "seq_len": 8, "device_name": "gpu", "runs": runs}


def test_reports_of_one_sweep_merge_into_one_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    merged = merge_reports([_report("x", (8, 16)), _report("x", (4,))])
    assert [(r["batch"], r["system"]) for r in merged["runs"]] == [
        (b, s) for b in (4, 8, 16) for s in ("ours", "fsdp2")
    ]
    paths = []
    for i, report in enumerate((_report("x", (4, 8)), _report("x", (16, 32)))):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(report))
    png = tmp_path / "sweep.png"
    assert main(["bench", "plot", "--png", str(png), *map(str, paths)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reports_of_different_sweeps_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"reports differ in shape \('x' vs 'y'\)"):
        merge_reports([_report("x", (4,)), _report("y", (8,))])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    pytest.importorskip("matplotlib")
    assert main(["bench", "plot", "--png", str(tmp_path / "p.png"), str(bad)]) == 2
    assert "bad.json: not a readable JSON report" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def _configured(report: dict[str, Any], **runtime: Any) -> dict[str, Any]:
    train = {"max_grad_norm": runtime.pop("max_grad_norm", 1.0), "learning_rate": 1e-5}
    return report | {"ours_config": {"train": train, "runtime": {"kernels": "auto"} | runtime}}


def test_reports_whose_ours_rows_ran_different_configs_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ours at B=4, 8 with one config and at B=16, 32 with another would be one curve and one
    geometric mean: one error line instead, naming the key."""
    pytest.importorskip("matplotlib")
    paths = []
    for i, report in enumerate(
        (_configured(_report("x", (4, 8))), _configured(_report("x", (16, 32)), kernels="eager"))
    ):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(report))
    png = tmp_path / "sweep.png"
    assert main(["bench", "plot", "--png", str(png), *map(str, paths)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "slidedp bench plot: error: reports differ in ours_config.runtime.kernels ('auto' vs "
        "'eager'): rows of two configurations would be drawn and summarised as one; plot the "
        "reports of one configuration"
    ]
    assert not png.exists()


def test_a_peer_report_needs_only_the_same_train_section(tmp_path: Path) -> None:
    """A report of peers alone ran no ours row: our runtime does not matter to it, our train
    section (hyperparameters, clipping) does."""
    ours = _configured(_report("x", (4,)))
    peers = _configured(_report("x", (8,)), kernels="eager")
    peers["runs"] = [r | {"system": "zero3-offload"} for r in peers["runs"]]
    assert len(merge_reports([ours, peers])["runs"]) == 4
    unclipped = _configured(peers, max_grad_norm=0.0)
    with pytest.raises(ConfigError, match=r"ours_config\.train\.max_grad_norm \(1\.0 vs 0\.0\)"):
        merge_reports([ours, unclipped])


def test_a_key_an_older_report_lacks_is_no_difference() -> None:
    """A report written before ``runtime.resident_layers`` existed ran without resident
    layers, as the default does: it merges with a newer one; a key both have still counts."""
    old = _configured(_report("x", (16,)))
    new = _configured(_report("x", (4,)), resident_layers=0)
    assert len(merge_reports([new, old])["runs"]) == 4
    with pytest.raises(ConfigError, match=r"ours_config\.runtime\.kernels"):
        merge_reports([new, _configured(_report("x", (8,)), kernels="eager")])


def test_reports_whose_variant_of_ours_ran_different_configs_are_refused() -> None:
    """``ours:auto`` rows of two reports are one curve: their ``ours_variants`` entry must
    agree; a report without such rows is not asked."""

    def with_auto(report: dict[str, Any], policy: str) -> dict[str, Any]:
        runs = [r | {"system": "ours:auto"} for r in report["runs"] if r["system"] == "ours"]
        variant = {"train": report["ours_config"]["train"], "runtime": {"policy": policy}}
        return report | {"runs": report["runs"] + runs, "ours_variants": {"ours:auto": variant}}

    a, b = (with_auto(_configured(_report("x", (n,))), "auto") for n in (4, 8))
    assert len(merge_reports([a, b])["runs"]) == 6
    assert len(merge_reports([a, _configured(_report("x", (16,)))])["runs"]) == 5
    other = with_auto(_configured(_report("x", (16,))), "policy.yaml")
    with pytest.raises(ConfigError, match=r"ours_variants\.ours:auto\.runtime\.policy"):
        merge_reports([a, other])


GIB = 2**30


def test_a_sigkill_near_the_hosts_memory_is_the_kernels_oom_killer() -> None:
    # ZeRO-3 on Qwen3-8B (H200 host, 125 GiB): its stderr's last line was a warning's.
    status, error = crash_status(-9, "warn\n  return func(*args, **kwargs)\n", 123 * GIB, 125 * GIB)
    assert status == "oom"
    assert error.startswith("host memory: killed by SIGKILL at a PSS peak of 123.0 GiB of the")
    assert "func(" not in error


@pytest.mark.parametrize(
    ("code", "peak", "status", "error"),
    [
        (-9, 40 * GIB, "killed", "killed by SIGKILL; last stderr line: boom"),  # far from full
        (-11, 124 * GIB, "killed", "killed by SIGSEGV; last stderr line: boom"),  # not the OOM
        (1, 124 * GIB, "error", "boom"),
    ],
)
def test_other_crashes_keep_their_signal_and_last_line(
    code: int, peak: int, status: str, error: str
) -> None:
    assert crash_status(code, "x\nboom\n\n", peak, 125 * GIB) == (status, error)
    assert crash_status(code, "", peak, 0)[0] == status  # no meminfo: never called an OOM
