"""The bandwidth of the collectives our routes use, measured on the ranks of the bench run.

Run by ``slidedp bench train --gpus N`` (or ``--ranks N`` on CPU) in its own child of N ranks:
for a bf16 tensor of the largest decoder layer's size and one of ``BIG_BYTES``, the median of
``REPS`` calls after ``WARMUP`` of ``all_gather`` (the sharded route, the engine's call),
``reduce`` (the gpu route) and ``all_reduce`` (for comparison). A call's time is the slowest
rank's. Bandwidths as ``nccl-tests`` defines them, in GB/s: algorithm ``size / time`` and bus
(x (R-1)/R all-gather, x 1 reduce, x 2(R-1)/R all-reduce).

Example::

    result = run_collectives(spec)  # a RunSpec with system="collectives", world >= 2, on a rank
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slidedp.bench.measure import RunSpec
from slidedp.runtime.dist import Dist, rank_device
from slidedp.runtime.lanes import synchronize

OPS = ("all_gather", "reduce", "all_reduce")
BIG_BYTES = {"cuda": 512 * 2**20, "cpu": 4 * 2**20}  # gloo on CPU: a size that tests in ms
WARMUP = 2
REPS = 5
DTYPE = torch.bfloat16


def bus_factor(op: str, world: int) -> float:
    """Bus bandwidth over algorithm bandwidth (``nccl-tests``' definitions)."""
    if op == "reduce":
        return 1.0
    return (world - 1) / world * (2 if op == "all_reduce" else 1)


def _call(op: str, flat: torch.Tensor, rank: int, world: int) -> Callable[[], object]:
    """One call of ``op`` on ``flat`` (numel divisible by ``world``), as the engine issues it."""
    if op == "all_gather":
        parts = list(flat.view(world, -1).unbind(0))
        share = parts[rank].clone()
        return lambda: dist.all_gather(parts, share)
    if op == "reduce":
        return lambda: dist.reduce(flat, dst=0)
    return lambda: dist.all_reduce(flat)


def _times_s(call: Callable[[], object], device: torch.device) -> list[float]:
    """Seconds of each of ``REPS`` calls after ``WARMUP``, on this rank (peers lined up first)."""
    times = []
    for rep in range(WARMUP + REPS):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        if rep >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def run_collectives(spec: RunSpec) -> dict[str, Any]:
    """Every op at both sizes; rank 0 returns the rows (the other ranks the same rows)."""
    ctx = Dist.from_env()
    assert ctx is not None, "collectives run on launched ranks (bench.ranks)"
    device = rank_device(ctx, spec.device)
    ctx.init(device, timeout_s=spec.ours["runtime"]["version_timeout_s"])
    element = torch.finfo(DTYPE).bits // 8
    sizes = {
        "layer": spec.layer_numel,
        f"{BIG_BYTES[device.type] // 2**20} MiB": BIG_BYTES[device.type] // element,
    }
    padded = {label: -(-numel // ctx.world) * ctx.world for label, numel in sizes.items()}
    cases = [(op, label, numel) for label, numel in padded.items() for op in OPS]
    measured = []
    for op, _, numel in cases:
        flat = torch.zeros(numel, dtype=DTYPE, device=device)
        measured.append(_times_s(_call(op, flat, ctx.rank, ctx.world), device))
        del flat
    slowest = torch.tensor(measured, dtype=torch.float64, device=device)  # [cases, REPS]
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = []
    for (op, label, numel), times in zip(cases, slowest.cpu().tolist(), strict=True):
        size_bytes = numel * element
        median_s = statistics.median(times)
        algbw = size_bytes / median_s / 1e9
        busbw = algbw * bus_factor(op, ctx.world)
        rows.append({
            "op": op, "size": label, "numel": numel, "bytes": size_bytes, "times_s": times,
            "time_s": median_s, "algbw_gbps": algbw, "busbw_gbps": busbw,
        })  # fmt: skip
    return {
        "backend": dist.get_backend(),
        "dtype": str(DTYPE).removeprefix("torch."),
        "warmup": WARMUP,
        "reps": REPS,
        "rows": rows,
    }
