"""``slidedp bench train --ranks N`` (``--gpus N`` on CUDA): the runs of several ranks, weak
scaling, the route table, the collectives, a failed or out-of-memory rank, bad arguments."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.tiny import tiny_spec, write_tiny_config
from slidedp.bench import multi
from slidedp.bench import train as bench_train
from slidedp.bench.child import run_child
from slidedp.bench.measure import RunSpec
from slidedp.bench.ours import ours_raw_config
from slidedp.bench.train import ours_config
from slidedp.cli import build_parser, main
from slidedp.errors import ConfigError

OPS = {"all_gather", "reduce", "all_reduce"}


def _cli(config: Path, out: Path, *extra: str) -> int:
    args = ["bench", "train", "--shape", str(config), "--seq", "16", "--device", "cpu"]
    return main(
        [*args, "--batch", "2", "--warmup", "1", "--steps", "1", "--json", str(out), *extra]
    )


@pytest.mark.e2e
def test_two_ranks_end_to_end_and_predicted_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bench command, checked as two (each of its runs starts processes that import torch:
    minutes on 2 cores): ours on one rank, then on two ranks by one route (sharded/cpu: both of
    its routes differ from the default's), traced, and the step-time model's prediction of every
    run calibrated here (``--predict``, its probes cached in the run's own ``XDG_CACHE_HOME``).
    One route, not two: each is two more processes that import torch; the table of several
    routes is test_route_table_scaling_and_a_failed_route's, the training of every route on two
    ranks tests/multirank/test_parity.py's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the probes measure here
    config = write_tiny_config(tmp_path / "m")
    out, trace = tmp_path / "report.json", tmp_path / "trace.json"
    extra = ("--ranks", "2", "--systems", "ours", "--routes", "sharded/cpu",
             "--trace", str(trace), "--predict")  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert _cli(config, out, *extra) == 0
    report = json.loads(out.read_text())
    _two_ranks_ran_traced_and_scaled(tmp_path, report, printed.getvalue())
    _every_run_of_ours_is_predicted(tmp_path, report, printed.getvalue())


def _two_ranks_ran_traced_and_scaled(tmp: Path, report: dict[str, Any], printed: str) -> None:
    """Weak scaling, the traces, the route table and the collectives of ``--ranks 2``."""
    one, two = report["runs"]
    assert (one["world"], one["route"], one["status"]) == (1, None, "ok")
    assert (two["world"], two["route"], two["status"]) == (2, "sharded/cpu", "ok")
    assert one["tokens_per_step"] == 2 * 16
    assert two["tokens_per_step"] == 2 * 2 * 16  # weak scaling: batch 2 on each rank
    assert set(two["exposed_wait_s"]) == {"h2d", "update", "d2h", "offload"}
    assert two["host_pss_peak_gib"] > one["host_pss_peak_gib"]  # both ranks, not the launcher
    for rank in (0, 1):  # the 2-rank run traced its first measured step, one file per rank
        spans = json.loads((tmp / f"trace-x2-sharded-cpu-rank{rank}.json").read_text())
        names = {e["name"] for e in spans["traceEvents"] if e["ph"] == "X"}
        assert names >= {"compute", "h2d"}, rank
    (row,) = report["scaling"]  # of the first route run (the config's does not run here)
    assert row["ours_efficiency"] == two["tokens_per_s"] / (2 * one["tokens_per_s"])
    assert row["fsdp2_efficiency"] is None  # fsdp2 did not run
    assert [r["route"] for r in report["route_table"]] == ["sharded/cpu"]
    collectives = report["collectives"]
    assert (collectives["status"], collectives["backend"]) == ("ok", "gloo")
    assert {(r["op"], r["size"]) for r in collectives["rows"]} == {
        (op, size) for op in OPS for size in ("layer", "4 MiB")
    }
    for r in collectives["rows"]:
        assert r["bytes"] == 2 * r["numel"]  # bf16
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["time_s"] > 0
    assert "ours x2 sharded/cpu" in printed
    assert f"efficiency {row['ours_efficiency']:.1%}" in printed
    assert "collectives on 2 ranks (gloo, bfloat16" in printed


def _every_run_of_ours_is_predicted(tmp: Path, report: dict[str, Any], printed: str) -> None:
    """``--predict`` calibrated here: a prediction beside each measured run of ours."""
    predictions = report["predictions"]
    assert [(p["world"], p["route"]) for p in predictions] == [(1, None), (2, "sharded/cpu")]
    for row, run in zip(predictions, report["runs"], strict=True):
        assert row["measured_step_s"] == run["step_time_s"]
        assert 0 < row["predicted_step_s"] < 60
        assert row["error"] == pytest.approx(row["predicted_step_s"] / row["measured_step_s"] - 1)
    # the collectives of the same command calibrate the routes; the host probe the copies
    gather = next(
        r["algbw_gbps"] for r in report["collectives"]["rows"]
        if r["op"] == "all_gather" and r["size"] == "layer"
    )  # fmt: skip
    for two in predictions[1:]:
        assert two["links"]["source"] == "measured"
        assert two["links"]["gather_gbps"] == gather
    assert list((tmp / "cache").rglob("layer-*.json")), "the layer profile is cached"
    assert "step-time model (calibrated here" in printed


@pytest.mark.e2e
def test_fsdp2_on_two_ranks_on_cpu(tmp_path: Path) -> None:
    spec = dataclasses.replace(tiny_spec(tmp_path / "m", "fsdp2"), world=2)
    result, peak_pss_bytes = run_child(spec, tmp_path)
    assert result["status"] == "ok", result
    assert result["tokens_per_step"] == 2 * 2 * 16
    assert len(result["step_times_s"]) == 2
    assert all(5.0 < loss < 6.0 for loss in result["losses"])  # about ln(256)
    assert peak_pss_bytes > 0


def test_routes_auto_beside_the_fixed_default(tmp_path: Path) -> None:
    """One command runs the fixed default and AutoPolicy on N ranks: ``--routes X,auto``."""
    args = ["bench", "train", "--ranks", "2", "--routes", "replicated/gpu,auto"]
    scale = multi.parse_scale(build_parser().parse_args(args), ["ours"], "cpu", ours_config([]))
    assert scale is not None
    assert scale.routes == (("replicated", "gpu"), multi.AUTO_ROUTE)
    assert scale.main_route == ("replicated", "gpu")
    single = dataclasses.replace(tiny_spec(tmp_path / "m", "ours"), batch=4)
    fixed, chosen = multi.scaled_specs(single, ["ours"], scale)
    assert (fixed.ours["runtime"]["policy"], fixed.auto_routes) == ("", False)
    assert (chosen.ours["runtime"]["policy"], chosen.auto_routes) == ("auto", True)
    assert [multi.run_keys(s)["route"] for s in (fixed, chosen)] == ["replicated/gpu", "auto"]
    assert [s.name for s in (fixed, chosen)] == ["ours-b4-x2-replicated-gpu", "ours-b4-x2-auto"]
    # --set runtime.policy=auto alone: auto chooses the route too
    auto = ours_config(["runtime.policy=auto"])
    only = multi.parse_scale(build_parser().parse_args(args[:4]), ["ours"], "cpu", auto)
    assert only is not None
    assert only.routes == (multi.AUTO_ROUTE,)
    layers = ours_config(["runtime.layers=N"])
    with pytest.raises(ConfigError, match=r"^route auto: runtime\.policy=auto chooses"):
        multi.parse_scale(build_parser().parse_args(args), ["ours"], "cpu", layers)


# Read when the step runs, not at import: a rank forked from its launcher's zygote shares the
# imports (this file included) made before its RANK was set.
INJECT = """
import os
import torch
from slidedp.runtime.engine import Engine

step = Engine.step

def failing(self, t, *args, **kwargs):
    if t == 1 and os.environ.get("RANK") == "1":  # rank 1 of a launch raises in step 1
        raise {error}
    return step(self, t, *args, **kwargs)

Engine.step = failing
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("error", "status", "message"),
    [
        ('RuntimeError("injected failure")', "error", "rank 1 exited with 1"),
        ('torch.OutOfMemoryError("CUDA out of memory (injected)")', "oom",
         "rank 1: OutOfMemoryError: CUDA out of memory (injected)"),
    ],
)  # fmt: skip
def test_a_failing_rank_ends_the_run_of_every_rank(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    error: str,
    status: str,
    message: str,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(INJECT.format(error=error))  # runs in every child
    monkeypatch.setenv("PYTHONPATH", str(site))
    spec = dataclasses.replace(tiny_spec(tmp_path / "m", "ours"), world=2)
    result, _ = run_child(spec, tmp_path)
    assert result["status"] == status
    assert message in result["error"]
    if status == "error":  # the failing rank's traceback is shown once; its peer stays quiet
        assert capfd.readouterr().err.count("RuntimeError: injected failure") == 1


def _fake_child(calls: list[RunSpec]) -> Any:
    """Results as a worker would return them: ours on N ranks slower per route, in this order."""
    route_s = {"replicated/gpu": 0.01, "replicated/cpu": 0.0125, "sharded/gpu": 0.02}

    def run_child(spec: RunSpec, workdir: Path) -> tuple[dict[str, Any], int]:
        calls.append(spec)
        if spec.system == "collectives":
            rows = [{"op": "reduce", "size": "layer", "numel": 8, "bytes": 16, "times_s": [1e-3],
                     "time_s": 1e-3, "algbw_gbps": 16e-6, "busbw_gbps": 16e-6}]  # fmt: skip
            return {"status": "ok", "backend": "gloo", "dtype": "bfloat16", "warmup": 2,
                    "reps": 5, "rows": rows}, 0  # fmt: skip
        route = multi.run_keys(spec)["route"]
        if route == "sharded/cpu":  # this route's run fails
            return {"system": "ours", "batch": spec.batch, "status": "error", "error": "boom"}, 0
        step_s = (
            route_s[route]
            if route
            else {"ours": 0.01, "reference": 0.005, "fsdp2": 0.04}[spec.system]
        )
        if spec.system == "fsdp2" and spec.world == 2:
            step_s = 0.1
        result = {
            "system": spec.system, "batch": spec.batch, "status": "ok", "step_times_s": [step_s],
            "tokens_per_step": spec.global_batch * spec.seq_len, "host_pss_end_bytes": 2**30,
            "gpu_peak_reserved_bytes": None,
        }  # fmt: skip
        if spec.system == "ours":
            lanes = ("wait_h2d_s", "wait_update_s", "wait_d2h_s", "wait_offload_s")
            result["lanes_s"] = {k: 0.001 for k in lanes}
        return result, 2**30

    return run_child


def test_route_table_scaling_and_a_failed_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[RunSpec] = []
    monkeypatch.setattr(bench_train, "run_child", _fake_child(calls))
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "r.json"
    extra = ("--ranks", "2", "--routes", "all", "--set", "train.max_grad_norm=0")
    assert _cli(config, out, *extra) == 1  # the failed route: exit 1 after the report
    report = json.loads(out.read_text())
    ran = [(s.system, s.world, multi.run_keys(s)["route"]) for s in calls]
    assert ran == [
        ("collectives", 2, None), ("ours", 1, None), ("reference", 1, None), ("fsdp2", 1, None),
        ("ours", 2, "replicated/gpu"), ("ours", 2, "replicated/cpu"), ("ours", 2, "sharded/gpu"),
        ("ours", 2, "sharded/cpu"), ("fsdp2", 2, None),
    ]  # fmt: skip
    for spec in calls[4:8]:  # the route reaches our trainer's config on each rank
        raw = ours_raw_config(spec, tmp_path / "d.jsonl", tmp_path / "o")
        assert (
            f"{raw['runtime']['param_route']}/{raw['runtime']['grad_route']}"
            == (multi.run_keys(spec)["route"])
        )
        assert (raw["runtime"]["ranks"], raw["train"]["global_batch_size"]) == (2, 4)
    table = report["route_table"]
    assert [r["route"] for r in table] == [multi.route_name(r) for r in multi.ROUTES]
    # ours on 1 rank: 32 tokens in 0.01 s; on 2 ranks 64 tokens in 0.01 s: 100% efficiency
    assert [r["efficiency"] for r in table[:3]] == pytest.approx([1.0, 0.8, 0.5])
    assert (table[3]["status"], table[3]["efficiency"]) == ("error", None)
    (row,) = report["scaling"]
    assert row["route"] == "replicated/gpu"  # the config's route
    assert row["ours_n_tokens_per_s"] == pytest.approx(6400)
    assert row["fsdp2_efficiency"] == pytest.approx(640 / (2 * 800))
    assert row["reference_projected_tokens_per_s"] == pytest.approx(2 * 6400)
    assert row["ours_over_fsdp2"] == pytest.approx(6400 / 640)
    assert row["ours_over_reference_projected"] == pytest.approx(6400 / 12800)
    assert report["ratios"] == [{"batch": 2, "ours_over_fsdp2": 4.0, "ours_over_reference": 0.5}]
    printed = capsys.readouterr().out
    assert "ratios at batch 2 on 1 rank (tokens/s): ours/fsdp2 4.00x, ours/reference 0.50x" in (
        printed
    )
    assert "ours/fsdp2 10.00x, ours/reference (projected) 0.50x" in printed
    assert f"    2 {'sharded/cpu':<22} {'ERROR':>10}" in printed
    assert "reduce       layer" in printed


def test_scaled_first_and_no_collectives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A time-limited call asks for the runs on N ranks first and no collectives: the same
    runs in that order, the same figures, no collectives in the report or the print."""
    calls: list[RunSpec] = []
    monkeypatch.setattr(bench_train, "run_child", _fake_child(calls))
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "r.json"
    extra = ("--ranks", "2", "--systems", "ours,reference", "--scaled-first", "--no-collectives")
    assert _cli(config, out, *extra, "--set", "train.max_grad_norm=0") == 0
    ran = [(s.system, s.world) for s in calls]
    assert ran == [("ours", 2), ("ours", 1), ("reference", 1)]
    report = json.loads(out.read_text())
    assert "collectives" not in report
    (row,) = report["scaling"]
    assert row["ours_efficiency"] == pytest.approx(1.0)  # 1 -> 2 ranks matched by batch
    assert "collectives on" not in capsys.readouterr().out


def test_a_failed_collectives_run_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_child([])

    def failing(spec: RunSpec, workdir: Path) -> tuple[dict[str, Any], int]:
        if spec.system == "collectives":
            return {"system": "collectives", "batch": 0, "status": "error", "error": "nccl"}, 0
        return fake(spec, workdir)  # type: ignore[no-any-return]

    monkeypatch.setattr(bench_train, "run_child", failing)
    config = write_tiny_config(tmp_path / "m")
    assert _cli(config, tmp_path / "r.json", "--ranks", "2", "--systems", "ours") == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["collectives"] == {"status": "error", "error": "nccl"}


def _scale(*argv: str, device: str = "cpu", systems: str = "ours,fsdp2") -> multi.Scale | None:
    args = build_parser().parse_args(["bench", "train", *argv])
    return multi.parse_scale(args, systems.split(","), device, ours_config([]))


@pytest.mark.parametrize(
    ("argv", "device", "message"),
    [
        (["--gpus", "2"], "cpu", "--gpus needs CUDA: on CPU use --ranks N --device cpu"),
        (["--gpus", "4"], "cuda", "--gpus 4 but 1 CUDA device(s) are visible"),
        (["--ranks", "2"], "cuda", "--ranks runs CPU processes: add --device cpu"),
        (["--ranks", "1"], "cpu", "--ranks 1: needs 2 or more"),
        (["--ranks", "2", "--gpus", "2"], "cpu", "--gpus and --ranks: give one"),
        (["--routes", "all"], "cpu", "--routes needs --gpus N"),
        (["--scaled-first"], "cpu", "--scaled-first needs --gpus N"),
        (["--no-collectives"], "cpu", "--no-collectives needs --gpus N"),
        (["--ranks", "2", "--routes", "sharded/nvlink"], "cpu",
         "--routes 'sharded/nvlink': use all, or comma-separated PARAM/GRAD routes from "
         "replicated/gpu, replicated/cpu, "
         "sharded/gpu, sharded/cpu"),
    ],
)  # fmt: skip
def test_bad_scale_arguments_are_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], device: str, message: str
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        _scale(*argv, device=device)


def test_scale_routes_and_the_single_gpu_bench_unchanged() -> None:
    assert _scale() is None
    scale = _scale("--ranks", "2")
    assert scale == multi.Scale(2, (("replicated", "gpu"),), ("replicated", "gpu"))
    scale = _scale("--ranks", "3", "--routes", "sharded/gpu,replicated/gpu,sharded/gpu")
    assert scale is not None
    assert scale.routes == (("sharded", "gpu"), ("replicated", "gpu"))
    assert scale.main_route == ("replicated", "gpu")  # the config's, when it runs
    with pytest.raises(ConfigError, match="need ours, fsdp2 or a peer"):
        _scale("--ranks", "2", systems="reference")
    with pytest.raises(ConfigError, match=r"'runtime\.gpus' is set by the bench"):
        ours_config(["runtime.gpus=2"])


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_every_route(tmp_path: Path) -> None:
    config = write_tiny_config(tmp_path / "m", hidden_size=256, intermediate_size=768, head_dim=64)
    out = tmp_path / "report.json"
    extra = ("--device", "cuda", "--gpus", "2", "--routes", "all", "--set", "train.max_grad_norm=0")
    assert _cli(config, out, *extra) == 0
    report = json.loads(out.read_text())
    assert [(r["system"], r["world"]) for r in report["runs"]] == [
        ("ours", 1), ("reference", 1), ("fsdp2", 1), *[("ours", 2)] * 4, ("fsdp2", 2),
    ]  # fmt: skip
    for run in report["runs"]:
        assert run["status"] == "ok", run
        assert run["gpu_peak_reserved_gib"] > 0
        assert 0 < run["mfu"] < 1
    (row,) = report["scaling"]
    assert row["ours_efficiency"] > 0
    assert row["fsdp2_efficiency"] > 0
    assert row["ours_over_reference_projected"] > 0
    assert len(report["route_table"]) == 4
    assert report["collectives"]["backend"] == "nccl"
    assert {r["size"] for r in report["collectives"]["rows"]} == {"layer", "512 MiB"}
    assert all(r["algbw_gbps"] > 0 for r in report["collectives"]["rows"])
