"""``slidedp profile host [--threads N] [--ranks R] [--device auto|cpu|cuda] [--state-mib 512]
[--force] [--json]``: the host AdamW lane's rate on the machine at hand.

The step-time model and the layout selector take it instead of ``plan.machine.ADAMW_GBPS``. The
probe runs the engine's own update path (``HostStore``, ``UpdateWorker``, the gradient ring) on
``--state-mib`` of FP32 state, beyond any CPU's caches. Rates are GB/s at
``ADAMW_BYTES_PER_PARAM`` (28) bytes per parameter: ``adamw_gbps`` alone; on CUDA
``joint_adamw_gbps`` while H2D/D2H copies share the DRAM (no cast beside it), with
``joint_h2d_gbps``, ``joint_d2h_gbps``, and ``joint_cast_gbps`` (the cast under the copies).
With ``--ranks R`` > 1 also R pools of threads/R at once, as R ranks' update workers run on
one node: ``pool_adamw_gbps`` (the slowest pool's) and ``pools_adamw_gbps`` (all together).
Invariant: cached (``profile.cache``) under the CPU model, cores, threads, ranks, GPU name and
versions;
``cached_host`` only looks up, ``probe_host`` measures where missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol

import torch

from slidedp import __version__
from slidedp.cli_args import count
from slidedp.kernels import Kernels, default_threads
from slidedp.plan.device import pick_device
from slidedp.plan.timing import ADAMW_BYTES_PER_PARAM, CAST_BYTES_PER_PARAM
from slidedp.profile.cache import cache_file, cpu_model, keep_report, read_report
from slidedp.runtime.lanes import new_event, new_stream
from slidedp.runtime.transfer import pin, unpin
from slidedp.store import GroupSpec, HostStore, ParamSpec
from slidedp.update import UpdateWorker

STATE_MIB = 512
GROUPS = 8
GRAD_SLOTS = 4  # the engine's gradient ring (runtime.grad_slots)
COLUMNS = 1024  # the parameters are matrices: weight decay applies, as to a layer's weights
BUDGET_S = 0.8  # per rate, alone and under DMA, all repeats: the probe stays under ~3 s
REPEATS = 3
IN_FLIGHT = 2  # copies queued per stream, so the DMA never pauses and never runs far ahead
DRAIN_TIMEOUT_S = 600.0
CAST_PASSES = 2  # casts of every group under the copies, after the updates
# any gradient: the kernel's time does not depend on the values (no denormals from this one)
GRAD = 1e-3
# a cached report's numbers, positive and finite, else it is measured again; the joint ones
# (CUDA) all or none
NUMBERS = ("adamw_gbps", "params", "passes", "state_bytes", "measured_s")
JOINT = ("joint_adamw_gbps", "joint_h2d_gbps", "joint_d2h_gbps", "joint_cast_gbps")
# what the probe measures, in the cache key: a report of another version is measured again
# (2: AdamW under the copies without a cast beside it, ``_under_copies``; 3: R pools, ``_pools``)
PROBE_VERSION = 3
POOLS = ("pool_adamw_gbps", "pools_adamw_gbps", "pool_threads")  # the reports of ranks > 1


def engine_update_threads(cores: int, cuda: bool, ranks: int = 1) -> int:
    """The host kernels' threads of one of ``ranks`` ranks sharing the host when
    ``runtime.update_threads`` is 0, as ``Trainer`` starts them: the rank's share of the cores
    but one beside a GPU (the rank's training thread issues the GPU's work and copies on that
    one; on a 16-core H200 host, 15 threads ran Qwen3-4B B=16's clipped steps as fast as 16
    once the moments were faulted in: benchmarks/2026-11-29-clipped-update-h200.md), half of
    the share on CPU (torch computes on the rest). Each rank runs two pools
    (AdamW, the cpu route's sums) at once: two ranks' pools on all 32 cores of the 2xH200 host
    ran the cpu route 10% slower than pools on each rank's share
    (benchmarks/2026-11-27-two-gpus-routes-h200.md). The host probe times one pool on the node's
    cores (``ranks=1``), and with ``ranks`` R > 1 also R pools of a share each at once
    (``_pools``: the step-time model's owner lanes, ``plan.update_lanes``)."""
    share = max(1, cores // ranks)
    return max(1, share - 1) if cuda else max(1, share // 2)


def host_facts(threads: int, gpu: str | None, ranks: int = 1) -> dict[str, Any]:
    """The cache key's facts: what the rate depends on."""
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "threads": threads,
        "ranks": ranks,
        "gpu": gpu,
        "torch": torch.__version__,
        "slidedp": __version__,
        "probe": PROBE_VERSION,
    }


def model_gbps(report: dict[str, Any]) -> float:
    """The rate the model takes: the joint one where the GPU's copies ran beside (CUDA)."""
    return float(report.get("joint_adamw_gbps") or report["adamw_gbps"])


def alone_gbps(report: dict[str, Any]) -> float | None:
    """The rate alone where the probe also ran under the copies (CUDA; the step-time model
    blends the two: ``plan.timing.host_update_gbps``), else None (``model_gbps`` throughout)."""
    return float(report["adamw_gbps"]) if report.get("joint_adamw_gbps") else None


def pool_gbps(report: dict[str, Any]) -> float | None:
    """The rate of one of the report's R pools while all ran (the slowest pool's), None where
    it was of one rank (``plan.update_lanes.owner_lane_gbps`` then shares the node's)."""
    return float(report["pool_adamw_gbps"]) if report.get("pool_adamw_gbps") else None


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _read(path: Path, facts: dict[str, Any]) -> dict[str, Any] | None:
    """The cached report of ``facts``, or None (none, or one that does not read: a miss)."""
    report = read_report(path)
    if report is None or any(report.get(k) != v for k, v in facts.items()):
        return None
    joint = [report.get(k) for k in JOINT]
    numbers = NUMBERS + (POOLS if facts["ranks"] > 1 else ())
    whole = all(_positive(report.get(k)) for k in numbers) and isinstance(report.get("isa"), str)
    if not whole or not (all(map(_positive, joint)) or joint == [None] * len(JOINT)):
        return None
    return report | {"cached": str(path)}


def cached_host(
    threads: int, gpu: str | None, cache_dir: str | None = None, *, ranks: int = 1
) -> dict[str, Any] | None:
    """The cached probe of this machine at ``threads`` beside ``gpu`` (None: CPU) for
    ``ranks`` ranks, or None; nothing is measured."""
    facts = host_facts(threads, gpu, ranks)
    return _read(cache_file(cache_dir, "host", facts), facts)


def probe_host(
    threads: int,
    device: torch.device,
    *,
    ranks: int = 1,
    state_bytes: int = STATE_MIB << 20,
    budget_s: float = BUDGET_S,
    cache_dir: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """The probe's report at ``threads`` on ``device`` (``ranks`` > 1: its R pools too):
    cached, else (or with ``force``) measured with ``state_bytes`` of FP32 state (per pool)
    and cached."""
    cuda = device.type == "cuda"
    facts = host_facts(threads, torch.cuda.get_device_name(device) if cuda else None, ranks)
    path = cache_file(cache_dir, "host", facts)
    if not force and (report := _read(path, facts)) is not None:
        return report
    start = time.perf_counter()
    rates = _measure(threads, device, state_bytes, budget_s)
    if ranks > 1:
        rates |= _pools(threads, ranks, state_bytes, budget_s, cuda)
    measured = (
        facts
        | rates
        | {
            "isa": Kernels.detect_isa(),
            "state_bytes": state_bytes,
            "measured_s": time.perf_counter() - start,
        }
    )
    keep_report(path, measured)
    return measured | {"cached": None}


class _Bench:
    """The store and update worker the probe times (module docstring)."""

    def __init__(self, state_bytes: int, threads: int, cuda: bool) -> None:
        rows = max(1, state_bytes // (3 * 4 * GROUPS * COLUMNS))
        groups = [
            GroupSpec(f"layers.{i}", [ParamSpec(f"layers.{i}.weight", (rows, COLUMNS))])
            for i in range(GROUPS)
        ]
        self.store = HostStore.create(
            groups,
            staging_slots=0,
            grad_slots=GRAD_SLOTS,
            grad_dtype="bf16" if cuda else "f32",
            bf16_mirror=cuda,
        )
        self.store.region("grad").fill_(GRAD)
        self.worker = UpdateWorker(self.store, threads)
        self.threads = threads
        self.group_params = rows * COLUMNS

    def master(self, group: int) -> torch.Tensor:
        """The FP32 master weights of ``group``, flat."""
        return self.store.param(f"layers.{group}.weight").view(-1)

    def submit(self, passes: int) -> int:
        """Queue ``passes`` updates of every group, slots in turn; the requests' count."""
        for i in range(passes * GROUPS):
            group, slot = i % GROUPS, i % GRAD_SLOTS
            self.worker.submit(
                group,
                0,
                self.group_params,
                slot,
                step=1,
                lr=1e-5,
                betas=(0.9, 0.999),
                eps=1e-8,
                weight_decay=0.01,
            )
        return passes * GROUPS

    def busy_s(self, passes: int) -> float:
        """Seconds the worker spends updating ``passes`` times."""
        before = self.worker.stats()[1]
        self.submit(passes)
        self.worker.drain(DRAIN_TIMEOUT_S)
        return self.worker.stats()[1] - before

    def gbps(self, passes: int, seconds: float) -> float:
        return ADAMW_BYTES_PER_PARAM * self.group_params * GROUPS * passes / seconds / 1e9


def _passes(bench: _Bench, budget_s: float) -> int:
    """Passes of every group that take about ``budget_s`` over ``REPEATS``, after a warm-up
    (fresh shared memory faults its pages in)."""
    bench.busy_s(1)
    first = bench.busy_s(1)
    return max(1, min(1000, round(budget_s / REPEATS / max(first, 1e-6))))


def _pools(
    threads: int, ranks: int, state_bytes: int, budget_s: float, cuda: bool
) -> dict[str, Any]:
    """AdamW on ``ranks`` pools of ``threads // ranks`` threads at once, each its own store
    and update worker (as each rank's worker updates its own groups; beside a GPU with its
    BF16 gradient and mirror, as the engine's), submitted together
    from this thread (the workers run off the GIL): the best of ``REPEATS`` of the slowest
    pool's rate (its bytes over its busy time) and of all the pools' bytes over the wall
    time from the first submission to the last drain."""
    share = max(1, threads // ranks)
    benches = [_Bench(state_bytes, share, cuda) for _ in range(ranks)]
    passes = max(_passes(b, budget_s) for b in benches)
    best = {"pool_adamw_gbps": 0.0, "pools_adamw_gbps": 0.0}
    for _ in range(REPEATS):
        before = [b.worker.stats()[1] for b in benches]
        start = time.perf_counter()
        for b in benches:
            b.submit(passes)
        for b in benches:
            b.worker.drain(DRAIN_TIMEOUT_S)
        wall_s = time.perf_counter() - start
        busy = [b.worker.stats()[1] - t for b, t in zip(benches, before, strict=True)]
        pool = min(b.gbps(passes, s) for b, s in zip(benches, busy, strict=True))
        if pool > best["pool_adamw_gbps"]:
            best = {"pool_adamw_gbps": pool,
                    "pools_adamw_gbps": sum(b.gbps(passes, wall_s) for b in benches)}  # fmt: skip
    return best | {"pool_threads": share}


def _measure(
    threads: int, device: torch.device, state_bytes: int, budget_s: float
) -> dict[str, Any]:
    """The best of ``REPEATS`` measurements of each rate: another tenant of the host can only
    slow a measurement down (on the H100 machines one probe read 58 GB/s under DMA where the
    engine's update lane ran at 99-112 and another probe at 120)."""
    bench = _Bench(state_bytes, threads, device.type == "cuda")
    passes = _passes(bench, budget_s)
    rates: dict[str, Any] = {
        "params": bench.group_params * GROUPS,
        "passes": passes,
        "adamw_gbps": max(bench.gbps(passes, bench.busy_s(passes)) for _ in range(REPEATS)),
        "joint_adamw_gbps": None,
    }
    if device.type == "cuda":
        joint = [_under_dma(bench, passes, device) for _ in range(REPEATS)]
        rates |= max(joint, key=lambda r: r["joint_adamw_gbps"])
    return rates


class _Copies:
    """The mirror going to the device and the gradients coming back into the slots, each copy
    stream kept ``IN_FLIGHT`` deep: a GPU copying both ways without a pause."""

    def __init__(self, mirror: torch.Tensor, grad: torch.Tensor, device: torch.device) -> None:
        self.mirror, self.grad, self.device = mirror, grad, device
        self.on_device = torch.empty_like(mirror, device=device)
        self.grads = torch.full_like(grad, GRAD, device=device)
        self.h2d, self.d2h = new_stream(device), new_stream(device)
        self.queued: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.rounds = 0

    def round(self) -> None:
        """Queue one copy each way; wait for the oldest beyond ``IN_FLIGHT``."""
        done = new_event(), new_event()
        with torch.cuda.stream(self.h2d):
            self.on_device.copy_(self.mirror, non_blocking=True)
            done[0].record(self.h2d)
        with torch.cuda.stream(self.d2h):
            self.grad.copy_(self.grads, non_blocking=True)
            done[1].record(self.d2h)
        self.queued.append(done)
        self.rounds += 1
        if len(self.queued) > IN_FLIGHT:
            for event in self.queued.popleft():
                event.synchronize()

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)


class CopyRounds(Protocol):
    """What ``_under_copies`` keeps running: ``_Copies`` (a test's fake on CPU)."""

    rounds: int

    def round(self) -> None: ...

    def finish(self) -> None: ...


def _under_dma(bench: _Bench, passes: int, device: torch.device) -> dict[str, float]:
    """``_under_copies`` with the mirror and the gradient slots pinned and copied."""
    mirror, grad = bench.store.region("mirror"), bench.store.region("grad")
    pinned = []
    try:
        for t, what in ((mirror, "mirror"), (grad, "gradient slots")):
            pin(t, f"the host probe's {what}")
            pinned.append(t)
        copies = _Copies(mirror, grad, device)
        rates = _under_copies(bench, passes, copies)
    finally:
        torch.cuda.synchronize(device)
        for t in pinned:
            unpin(t)
    round_s = rates.pop("round_s")
    return rates | {
        "joint_h2d_gbps": mirror.numel() * mirror.element_size() / round_s / 1e9,
        "joint_d2h_gbps": grad.numel() * grad.element_size() / round_s / 1e9,
    }


def _under_copies(bench: _Bench, passes: int, copies: CopyRounds) -> dict[str, float]:
    """``passes`` updates while ``copies`` run until the last is done, then ``CAST_PASSES``
    f32->bf16 casts of every group, this thread's, under the copies alone. Never both at
    once: a run with the mirror casts nothing, and without it the cast moves 6 bytes a
    parameter to AdamW's 28; a probe casting without a pause beside the update, on a second
    pool of as many threads, read AdamW at a quarter of the engine's rate (4x H200). Also
    ``round_s``: the seconds of one copy round while AdamW ran."""
    copies.finish()  # nothing of the set-up still running
    completed, busy = bench.worker.stats()
    start = time.perf_counter()
    copies.round()  # the copies run before the first update starts
    first = copies.rounds
    target = completed + bench.submit(passes)
    while bench.worker.stats()[0] < target:
        copies.round()
    bench.worker.drain(DRAIN_TIMEOUT_S)
    adamw_s = bench.worker.stats()[1] - busy
    copies.finish()
    round_s = (time.perf_counter() - start) / (copies.rounds - first + 1)
    kernels = Kernels(bench.threads)
    staging = torch.empty(bench.group_params, dtype=torch.bfloat16)
    cast_s = 0.0
    for i in range(CAST_PASSES * GROUPS):
        copies.round()
        at = time.perf_counter()
        kernels.cast_f32_to_bf16(bench.master(i % GROUPS), staging)
        cast_s += time.perf_counter() - at
    copies.finish()
    casts = CAST_PASSES * GROUPS
    return {
        "joint_adamw_gbps": bench.gbps(passes, adamw_s),
        # the cast reads 4 and writes 2 bytes per parameter (plan.timing's cast_s)
        "joint_cast_gbps": CAST_BYTES_PER_PARAM * bench.group_params * casts / cast_s / 1e9,
        "round_s": round_s,
    }


def format_report(report: dict[str, Any]) -> str:
    where = (
        f"cached: {report['cached']}"
        if report["cached"]
        else f"measured in {report['measured_s']:.1f} s"
    )
    threads = f"{report['threads']} update thread{'s' * (report['threads'] != 1)}"
    lines = [
        f"slidedp profile host: {report['cpu']} ({report['logical_cores']} logical cores), "
        f"{threads}, {report['isa']}, beside {report['gpu'] or 'no GPU'} ({where})",
        f"  AdamW alone      {report['adamw_gbps']:7.1f} GB/s  ({ADAMW_BYTES_PER_PARAM} B/param, "
        f"{report['params'] * 12 / 2**20:.0f} MiB of FP32 state, {report['passes']} passes)",
    ]
    if report["joint_adamw_gbps"] is None:
        lines.append("  AdamW under DMA       n/a  (no GPU: the model takes the rate alone)")
    else:
        lines.append(
            f"  AdamW under DMA  {report['joint_adamw_gbps']:7.1f} GB/s  (the model's rate while "
            f"copies run: H2D {report['joint_h2d_gbps']:.1f}, D2H {report['joint_d2h_gbps']:.1f}"
            f" GB/s; then the f32->bf16 cast {report['joint_cast_gbps']:.1f} GB/s under them)"
        )
    if report["ranks"] > 1:
        lines.append(
            f"  AdamW, {report['ranks']} pools of {report['pool_threads']} at once "
            f"{report['pool_adamw_gbps']:7.1f} GB/s each (the slowest), "
            f"{report['pools_adamw_gbps']:.1f} together (alone: each rank's update lane)"
        )
    return "\n".join(lines)


def add_probe_arguments(parser: argparse.ArgumentParser, device_help: str) -> None:
    """The options of every probe of the host's (``profile host``, ``profile chunks``):
    ``--threads``, ``--device``, ``--cache-dir``, ``--force``, ``--json``."""
    arg = parser.add_argument
    arg(
        "--threads",
        type=count(0),
        default=0,
        help="update threads (0: the engine's default, all cores beside a GPU, half on CPU)",
    )
    arg("--device", default="auto", choices=("auto", "cpu", "cuda"), help=device_help)
    arg("--cache-dir", default=None, help="default: $XDG_CACHE_HOME/slidedp/profile")
    arg("--force", action="store_true", help="measure even if cached")
    arg("--json", action="store_true", help="one JSON object instead of text")


def probe_device_threads(args: argparse.Namespace) -> tuple[torch.device, int]:
    """The device and update threads ``add_probe_arguments``' options ask for."""
    device = pick_device(args.device)
    threads = args.threads or engine_update_threads(default_threads(), device.type == "cuda")
    return device, threads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_probe_arguments(
        parser, "cuda: also AdamW under H2D/D2H copies (the model's rate); cpu: alone"
    )
    parser.add_argument(
        "--state-mib", type=count(1), default=STATE_MIB, help="FP32 state updated per pass"
    )
    parser.add_argument(
        "--ranks",
        type=count(1),
        default=1,
        help="ranks sharing the node: R > 1 also times R pools of threads/R at once",
    )


def main(args: argparse.Namespace) -> int:
    device, threads = probe_device_threads(args)
    report = probe_host(
        threads,
        device,
        ranks=args.ranks,
        state_bytes=args.state_mib << 20,
        cache_dir=args.cache_dir,
        force=args.force,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
