"""The machine a run would get, and its rates: ``Machine.probe`` (device, cores, free
/dev/shm, MemAvailable, the GPU), ``gpu_peak`` (dense bf16 FLOP/s of a GPU kind: the one
table), ``host_rate`` (host AdamW GB/s: ``slidedp profile host``'s cache, else the table of
benchmarks/2026-11-22-host-kernels.md).

Invariant: probing reads the machine and the probe caches; only ``host_rate(measure=True)``
measures anything (a few seconds; ``slidedp plan`` and AutoPolicy ask for it).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from slidedp.config import TrainConfig
from slidedp.envinfo import address_space_left_bytes, file_size_limit_bytes, meminfo_bytes
from slidedp.plan.device import pick_device, pick_dtype
from slidedp.profile.host import (
    alone_gbps,
    cached_host,
    engine_update_threads,
    model_gbps,
    pool_gbps,
    probe_host,
)

GIB = 2**30
SHM_DIR = Path("/dev/shm")
# AdamW GB/s by host threads (benchmarks/2026-11-22-host-kernels.md, section "Host kernels"; 16-core
# Sapphire Rapids, AVX-512)
ADAMW_GBPS = ((1, 18.0), (2, 31.6), (4, 62.8), (8, 100.5), (16, 170.4))
# Dense bf16 tensor-core FLOP/s by device name (first match wins: the PCIe H100 before H100)
GPU_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


@dataclass(frozen=True)
class Machine:
    """What the run would get: device kind, cores, free /dev/shm, MemAvailable, the GPU."""

    device: Literal["cuda", "cpu"]
    dtype: Literal["bfloat16", "float32"]
    cores: int
    shm_free_bytes: int
    mem_available_bytes: int | None
    gpu_name: str | None = None
    gpu_total_bytes: int | None = None
    cpu_flops: float | None = None  # measured torch matmul FLOP/s in ``dtype`` (CPU runs)
    gpu_count: int = 1  # GPUs visible to this process (``estimate --gpus`` may predict more)
    # what ``ulimit -v`` leaves to map, and ``ulimit -f``'s largest file (None: unlimited)
    address_space_left_bytes: int | None = None
    file_size_limit_bytes: int | None = None

    @classmethod
    def probe(cls, cfg: TrainConfig, shm_dir: Path = SHM_DIR, measure: bool = True) -> Machine:
        """This machine, for the device and dtype ``cfg`` resolves to (as the trainer does);
        ``measure=False`` skips the CPU matmul timing (no step time: the memory checks only)."""
        device = pick_device(cfg.runtime.launch.device)
        dtype = pick_dtype(cfg.train.dtype, device)
        stat = os.statvfs(shm_dir)
        facts: dict[str, Any] = {}
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device.index or 0)
            facts = {
                "gpu_name": props.name,
                "gpu_total_bytes": int(props.total_memory),
                "gpu_count": torch.cuda.device_count(),
            }
        elif measure:
            facts = {"cpu_flops": measure_cpu_flops(dtype)}
        return cls(
            device="cuda" if device.type == "cuda" else "cpu",
            dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
            cores=len(os.sched_getaffinity(0)),
            shm_free_bytes=stat.f_bavail * stat.f_frsize,
            mem_available_bytes=meminfo_bytes().get("mem_available_bytes"),
            address_space_left_bytes=address_space_left_bytes(),
            file_size_limit_bytes=file_size_limit_bytes(),
            **facts,
        )


def measure_cpu_flops(dtype: torch.dtype, n: int = 512, budget_s: float = 0.2) -> float:
    """torch's matmul FLOP/s on this CPU in ``dtype``: one thread's best ``n``³ product within
    ``budget_s`` (at least 3, after a warm-up) times torch's thread count. One thread, because
    a multi-threaded product on cores that other processes hold is ~10x slower (oversubscribed
    OpenMP barriers) and would describe the moment, not the machine."""
    threads = torch.get_num_threads()
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.set_num_threads(1)
    try:
        torch.matmul(a, b)
        best, spent, runs = math.inf, 0.0, 0
        while runs < 3 or spent < budget_s:
            start = time.perf_counter()
            torch.matmul(a, b)
            took = time.perf_counter() - start
            best, spent, runs = min(best, took), spent + took, runs + 1
    finally:
        torch.set_num_threads(threads)
    return 2.0 * n**3 / best * threads


def adamw_gbps(threads: int) -> float:
    """AdamW bandwidth at ``threads`` from ``ADAMW_GBPS``, measured on another machine
    (interpolated; linear beyond the table): where ``slidedp profile host`` has not run."""
    table = ADAMW_GBPS
    if threads >= table[-1][0]:
        return table[-1][1] * threads / table[-1][0]
    for (t0, g0), (t1, g1) in itertools.pairwise(table):
        if t0 <= threads <= t1:
            return g0 + (g1 - g0) * (threads - t0) / (t1 - t0)
    return table[0][1]


@dataclass(frozen=True)
class HostRate:
    """The host AdamW rate the step time takes, and where it comes from; beside a GPU, the
    probe's f32->bf16 cast under DMA too (the cast on delivery without the mirror) and the
    rate alone (``alone_gbps``: the update's share that no copy overlaps, ``plan.timing``'s
    ``host_update_gbps``; None: ``gbps`` throughout); on several ranks, one of their pools'
    while all update (``pool_gbps``, ``plan.update_lanes``; None: not probed)."""

    gbps: float
    source: str
    cast_gbps: float | None = None
    alone_gbps: float | None = None
    pool_gbps: float | None = None


def update_threads(cfg: TrainConfig, machine: Machine) -> int:
    """The update worker's threads for ``cfg`` on ``machine``, as ``Trainer`` starts it for
    one rank; with several, the node's cores (the host probe's rate is every rank's update
    together, ``engine_update_threads``)."""
    cuda = machine.device == "cuda"
    return cfg.runtime.layout.update_threads or engine_update_threads(machine.cores, cuda)


def host_rate(threads: int, machine: Machine, *, ranks: int = 1, measure: bool = False) -> HostRate:
    """The AdamW rate of ``slidedp profile host`` for ``threads`` on ``machine`` (beside its
    GPU: the rate under DMA; ``ranks`` > 1: their pools' too) where it is cached, else the
    table's (``adamw_gbps``).
    ``measure``: probe it when it is not cached (a few seconds: ``plan``, ``runtime.policy:
    auto``); estimating alone never measures."""
    gpu = machine.gpu_name if machine.device == "cuda" else None
    report = cached_host(threads, gpu, ranks=ranks)
    if report is None and measure:
        report = probe_host(threads, torch.device(machine.device), ranks=ranks)
    if report is None:
        table = "from the table (not measured on this machine: slidedp profile host)"
        return HostRate(adamw_gbps(threads), table)
    what = "measured under DMA" if report["joint_adamw_gbps"] else "measured"
    source = f"{what} ({'cached' if report['cached'] else 'now'})"
    return HostRate(model_gbps(report), source, report.get("joint_cast_gbps"),
                    alone_gbps(report), pool_gbps(report))  # fmt: skip


def gpu_peak(name: str | None) -> tuple[float | None, str]:
    """The dense bf16 FLOP/s of the GPU named ``name`` (``GPU_PEAK_FLOPS``, the one table
    the step-time model and the reports take it from), and a line saying which."""
    for key, flops in GPU_PEAK_FLOPS:
        if name is not None and key in name:
            return flops, f"{flops / 1e12:.0f} TFLOP/s dense bf16 ({key})"
    return None, f"unknown GPU {name!r}: no peak FLOP/s on record"
