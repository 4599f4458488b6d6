"""``slidedp profile host``: the engine's AdamW timed on this CPU (a tiny store here), the
cache's key and its bad files, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from host_profile.fake import cache_rate
from slidedp.cli import main
from slidedp.kernels import Kernels
from slidedp.plan.machine import Machine, host_rate
from slidedp.plan.timing import ADAMW_BYTES_PER_PARAM
from slidedp.profile import host
from slidedp.profile.cache import cache_file
from slidedp.profile.host import cached_host, host_facts, model_gbps, pool_gbps, probe_host
from slidedp.update import UpdateWorker

CPU = torch.device("cpu")
TINY = 1 << 20  # bytes of FP32 state: enough to run every path, not to defeat the caches


def _probe(tmp_path: Path, threads: int = 1, **given: Any) -> dict[str, Any]:
    return probe_host(threads, CPU, state_bytes=TINY, budget_s=0.02,
                      cache_dir=str(tmp_path), **given)  # fmt: skip


def _count_measures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    measure = host._measure

    def counted(*args: Any) -> dict[str, Any]:
        calls.append(1)
        return measure(*args)

    monkeypatch.setattr(host, "_measure", counted)
    return calls


def test_the_probe_times_the_engines_update_and_caches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_measures(monkeypatch)
    report = _probe(tmp_path)
    assert math.isfinite(report["adamw_gbps"])
    assert report["adamw_gbps"] > 0
    assert report["joint_adamw_gbps"] is None  # no GPU: no DMA beside it
    assert model_gbps(report) == report["adamw_gbps"]
    assert report["params"] == pytest.approx(TINY / 12, rel=0.1)  # f32 master, m, v
    assert report["passes"] >= 2
    assert report["cached"] is None
    again = _probe(tmp_path)
    assert calls == [1]  # the second answer is the cached one
    assert again["cached"] == str(cache_file(str(tmp_path), "host", host_facts(1, None)))
    assert again["adamw_gbps"] == report["adamw_gbps"]
    assert cached_host(1, None, str(tmp_path)) == again


def test_ranks_time_their_pools_at_once_and_key_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks: two pools of one thread each, each its own worker, submitted together (the
    mechanics only: two cores cannot show a rate); one rank has no pool figures."""
    workers: list[UpdateWorker] = []

    def kept(store: Any, threads: int) -> UpdateWorker:
        workers.append(UpdateWorker(store, threads))
        return workers[-1]

    monkeypatch.setattr(host, "UpdateWorker", kept)
    report = _probe(tmp_path, threads=2, ranks=2)
    assert (report["ranks"], report["pool_threads"]) == (2, 1)
    assert report["pool_adamw_gbps"] > 0
    assert report["pools_adamw_gbps"] > 0
    assert pool_gbps(report) == report["pool_adamw_gbps"]
    assert len(workers) == 3  # the one pool of both threads, then one per rank
    pools = workers[1:]
    # every pool ran the warm-up, the calibration and REPEATS rounds of as many passes
    assert pools[0].stats()[0] == pools[1].stats()[0] > host.REPEATS * host.GROUPS
    assert cached_host(2, None, str(tmp_path), ranks=2) == _probe(tmp_path, threads=2, ranks=2)
    assert cached_host(2, None, str(tmp_path)) is None  # one rank's report is another key
    assert pool_gbps(_probe(tmp_path, threads=2)) is None
    assert "2 pools of 1 at once" in host.format_report(report)


def test_the_key_names_the_threads_and_the_gpu(tmp_path: Path) -> None:
    _probe(tmp_path, threads=1)
    assert cached_host(2, None, str(tmp_path)) is None
    assert cached_host(1, "NVIDIA H100 80GB HBM3", str(tmp_path)) is None
    keys = {cache_file(None, "host", host_facts(t, g)) for t in (1, 2) for g in (None, "H100")}
    assert len(keys) == 4


@pytest.mark.parametrize("changed", ["cpu", "logical_cores", "torch", "slidedp", "probe"])
def test_a_probe_whose_key_changed_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changed: str
) -> None:
    """The CPU model, its core count and the versions are in the key (issue #16): a change is a
    miss, measured again, never the old rate."""
    calls = _count_measures(monkeypatch)
    first = _probe(tmp_path)
    stale = {
        "cpu": lambda: monkeypatch.setattr(host, "cpu_model", lambda: "another CPU"),
        "logical_cores": lambda: monkeypatch.setattr(os, "cpu_count", lambda: 512),
        "torch": lambda: monkeypatch.setattr(torch, "__version__", "0.0.1"),
        "slidedp": lambda: monkeypatch.setattr(host, "__version__", "0.0.1"),
        # a report of the probe before it changed what it measures (a cast beside AdamW)
        "probe": lambda: monkeypatch.setattr(host, "PROBE_VERSION", host.PROBE_VERSION + 1),
    }
    stale[changed]()
    again = _probe(tmp_path)
    assert calls == [1, 1]
    assert again["cached"] is None
    assert again[changed] != first[changed]


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # cut short
        lambda text: "[]",
        lambda text: text.replace('"passes"', '"passes_"'),  # a field missing
        lambda text: json.dumps(json.loads(text) | {"adamw_gbps": float("nan")}),
        lambda text: json.dumps(json.loads(text) | {"joint_adamw_gbps": 1.0}),  # half a joint
        lambda text: json.dumps(json.loads(text) | {"threads": 2}),  # another key's report
    ],
)
def test_a_bad_cache_file_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: Callable[[str], str]
) -> None:
    calls = _count_measures(monkeypatch)
    _probe(tmp_path)
    path = cache_file(str(tmp_path), "host", host_facts(1, None))
    path.write_text(damage(path.read_text()))
    assert cached_host(1, None, str(tmp_path)) is None
    report = _probe(tmp_path)
    assert calls == [1, 1]
    assert report["cached"] is None
    assert report["adamw_gbps"] > 0
    assert cached_host(1, None, str(tmp_path)) is not None  # written anew, whole


def test_the_command_prints_the_rate_and_then_its_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile", "host", "--threads", "1", "--state-mib", "1", "--cache-dir", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["threads"] == 1
    assert report["gpu"] is None
    assert report["adamw_gbps"] > 0
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "AdamW alone" in out
    assert f"{report['adamw_gbps']:.1f} GB/s" in out
    assert "cached: " in out
    assert "no GPU: the model takes the rate alone" in out


def test_a_fake_cached_rate_is_what_a_lookup_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache_rate(16, "NVIDIA H100 80GB HBM3", 500.0, joint_gbps=70.0)
    report = cached_host(16, "NVIDIA H100 80GB HBM3")
    assert report is not None
    assert model_gbps(report) == 70.0  # beside a GPU the model takes the joint rate
    machine = Machine("cuda", "bfloat16", 16, 1 << 30, None, "NVIDIA H100 80GB HBM3")
    rate = host_rate(16, machine)
    # the step-time model takes both: alone where no copy overlaps the update
    assert (rate.gbps, rate.alone_gbps) == (70.0, 500.0)
    cache_rate(8, None, 90.0)
    assert host_rate(8, dataclasses.replace(machine, device="cpu")).alone_gbps is None


@pytest.mark.gpu
def test_beside_a_gpu_the_rate_is_adamw_under_both_copies(tmp_path: Path) -> None:
    """On the GPU machine: the joint rate, and the copies' own rates meanwhile, are measured."""
    cuda = torch.device("cuda")
    report = probe_host(4, cuda, state_bytes=64 << 20, budget_s=0.2, cache_dir=str(tmp_path))
    assert report["gpu"] == torch.cuda.get_device_name(cuda)
    for key in ("adamw_gbps", "joint_adamw_gbps", "joint_h2d_gbps", "joint_d2h_gbps",
                "joint_cast_gbps"):  # fmt: skip
        assert math.isfinite(report[key]), key
        assert report[key] > 0, key
    assert model_gbps(report) == report["joint_adamw_gbps"]


def test_the_probe_keeps_the_best_of_its_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # warm-up, first pass, then the repeats: one slowed down 4x by another tenant, one 2x,
    # one clean; the rate is the clean one's
    seconds = iter([1.0, 0.01, 0.04, 0.02, 0.01])
    monkeypatch.setattr(host._Bench, "busy_s", lambda self, passes: next(seconds))
    report = _probe(tmp_path)
    clean = ADAMW_BYTES_PER_PARAM * report["params"] * report["passes"] / 0.01 / 1e9
    assert report["adamw_gbps"] == pytest.approx(clean)
    assert next(seconds, None) is None, "every repeat measured"


def test_each_rank_takes_its_share_of_the_cores_but_one_for_host_kernels() -> None:
    """Two ranks' pools on all cores ran the cpu route 10% slower than on each rank's share
    (benchmarks/2026-11-27-two-gpus-routes-h200.md); beside a GPU, one core of the share is left
    to the rank's training thread (15 of 16 threads: Qwen3-4B B=16 1.19x with clipping,
    benchmarks/2026-11-29-clipped-update-h200.md); the trainer asks for that."""
    from types import SimpleNamespace

    from slidedp.kernels import default_threads
    from slidedp.runtime.trainer import Trainer

    assert host.engine_update_threads(16, True) == 15
    assert host.engine_update_threads(32, True, ranks=2) == 15
    assert host.engine_update_threads(64, True, ranks=4) == 15
    assert host.engine_update_threads(32, False, ranks=2) == 8  # half of the share on CPU
    assert host.engine_update_threads(3, True, ranks=8) == 1
    assert host.engine_update_threads(2, True, ranks=2) == 1  # never none
    cores = default_threads()
    for device, ctx, expected in [
        ("cuda", None, max(1, cores - 1)),
        ("cuda", SimpleNamespace(local_world=2), max(1, cores // 2 - 1)),
        ("cpu", SimpleNamespace(local_world=2), max(1, cores // 4)),
    ]:
        trainer = SimpleNamespace(device=torch.device(device), ctx=ctx)
        assert Trainer._default_host_threads(trainer) == expected  # type: ignore[arg-type]


class _FakeCopies:
    """Copy rounds that copy nothing (no GPU here): counted, as ``_under_copies`` runs them."""

    def __init__(self) -> None:
        self.rounds = 0

    def round(self) -> None:
        self.rounds += 1

    def finish(self) -> None:
        pass


def test_under_the_copies_no_cast_runs_beside_the_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """AdamW under DMA is timed with no f32->bf16 cast beside it (a run with the mirror casts
    nothing; a second pool casting without a pause beside the update read a quarter of the
    engine's rate), and the cast's rate under the copies is timed after the last update."""
    bench = host._Bench(TINY, 1, cuda=False)
    submitted: list[int] = []
    submit = bench.submit

    def counted(passes: int) -> int:
        submitted.append(submit(passes))
        return submitted[-1]

    monkeypatch.setattr(bench, "submit", counted)
    outstanding: list[int] = []  # updates not yet done at each cast
    cast = Kernels.cast_f32_to_bf16

    def watched(self: Any, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        outstanding.append(sum(submitted) - bench.worker.stats()[0])
        return cast(self, src, out)

    monkeypatch.setattr(Kernels, "cast_f32_to_bf16", watched)
    copies = _FakeCopies()
    rates = host._under_copies(bench, 3, copies)
    assert sum(submitted) == 3 * host.GROUPS
    assert outstanding == [0] * (host.CAST_PASSES * host.GROUPS)
    assert copies.rounds >= 1 + host.CAST_PASSES * host.GROUPS  # copies ran in both phases
    for key in ("joint_adamw_gbps", "joint_cast_gbps", "round_s"):
        assert math.isfinite(rates[key])
        assert rates[key] > 0
