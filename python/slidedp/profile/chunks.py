"""``slidedp profile chunks [--shape NAME|config.json] [--device auto|cpu|cuda] [--no-mirror]
[--threads N] [--force] [--json]``: how the H2D/D2H chunk size (``runtime.chunk_elems``) changes
a layer's transfers and update here: AutoPolicy's chunk probes (``autopolicy.chunk_choice``).

For the whole layer and each of ``CHUNK_MIB``, ``step_s`` streams ``LAYERS`` layer-sized groups
as a backward does, through the engine's own ``HostStore``, ``Window``, ``GradLane`` and
``UpdateWorker``, without compute: the host side's service time (median of ``REPEATS``). The
gradient ring holds ``GRAD_SLOTS`` whole layers whatever the chunk, so a candidate changes only
how the work is cut. Cached (``profile.cache``, kind ``chunks``): ``cached_chunks`` reads.

Example::

    report = probe_chunks(layer_numel, threads=16, device=torch.device("cuda"), mirror=True)
    report["candidates"]   # [{"chunk_elems": 0, "grad_slots": 4, "step_s": ..., ...}, ...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import torch

from slidedp.kernels import Kernels
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.plan.policy import layer_numel
from slidedp.profile.cache import cache_file, keep_report, read_report
from slidedp.profile.host import (
    COLUMNS,
    GRAD,
    add_probe_arguments,
    host_facts,
    probe_device_threads,
)
from slidedp.runtime.grad_lane import AdamArgs, GradLane
from slidedp.runtime.lanes import LaneClock, new_stream
from slidedp.runtime.transfer import pin, unpin
from slidedp.runtime.window import Window, WindowSpec
from slidedp.store import GroupSpec, HostStore, ParamSpec
from slidedp.update import UpdateWorker

KIND = "chunks"
CHUNK_MIB = (8, 16, 32, 64, 128)  # of BF16: the paper found 8-128 MiB best, by machine
LAYERS = 4  # layers per measurement: the pipeline across layers, not one layer alone
GRAD_SLOTS = 4  # the engine's default gradient ring, in whole layers
STAGING_SLOTS = 2  # the engine's default staging ring (runtime.staging_slots)
REPEATS = 5
TIMEOUT_S = 600.0
BF16_BYTES = 2


def candidate_chunks(layer_numel: int, mib: tuple[int, ...] = CHUNK_MIB) -> list[int]:
    """``chunk_elems`` to measure: 0 (the whole layer) and each ``mib`` of BF16 that cuts the
    layer in at least two."""
    sizes = [(m << 20) // BF16_BYTES for m in mib]
    return [0] + [c for c in sizes if c < layer_numel]


def ring_slots(chunk_elems: int, layer_numel: int, whole_layers: int) -> int:
    """Gradient slots of ``chunk_elems`` that hold ``whole_layers`` layers (0: whole layers)."""
    if chunk_elems == 0:
        return whole_layers
    return whole_layers * math.ceil(layer_numel / chunk_elems)


def chunk_facts(threads: int, gpu: str | None, layer_numel: int, mirror: bool) -> dict[str, Any]:
    """The cache key's facts (the mirror only beside a GPU: on CPU nothing is loaded)."""
    return host_facts(threads, gpu) | {"layer_numel": layer_numel, "mirror": mirror and bool(gpu)}


def _valid(report: dict[str, Any] | None, facts: dict[str, Any]) -> bool:
    if report is None or any(report.get(k) != v for k, v in facts.items()):
        return False
    rows = report.get("candidates")
    if not isinstance(rows, list) or not rows or rows[0].get("chunk_elems") != 0:
        return False
    times = [row.get("step_s") for row in rows]
    return all(isinstance(t, int | float) and math.isfinite(t) and t > 0 for t in times)


def cached_chunks(
    threads: int, gpu: str | None, layer_numel: int, mirror: bool, cache_dir: str | None = None
) -> dict[str, Any] | None:
    """The cached probe for this machine, layer and mirror, or None; nothing is measured."""
    facts = chunk_facts(threads, gpu, layer_numel, mirror)
    path = cache_file(cache_dir, KIND, facts)
    report = read_report(path)
    return report | {"cached": str(path)} if report and _valid(report, facts) else None


def probe_chunks(
    layer_numel: int,
    threads: int,
    device: torch.device,
    *,
    mirror: bool,
    mib: tuple[int, ...] = CHUNK_MIB,
    cache_dir: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """The probe's report for a layer of ``layer_numel`` parameters, with or without the BF16
    mirror: cached, else (or with ``force``) measured and cached."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    facts = chunk_facts(threads, gpu, layer_numel, mirror)
    if not force and (found := cached_chunks(threads, gpu, layer_numel, mirror, cache_dir)):
        return found
    start = time.perf_counter()
    rows = [_measure(chunk, layer_numel, threads, device, facts["mirror"])
            for chunk in candidate_chunks(layer_numel, mib)]  # fmt: skip
    report = facts | {"candidates": rows, "measured_s": time.perf_counter() - start}
    keep_report(cache_file(cache_dir, KIND, facts), report)
    return report | {"cached": None}


class _Bench:
    """One layer-sized group in a store of ``chunk_elems`` chunks, its update worker and
    gradient lane, and on CUDA the window that loads it (the store's slots pinned)."""

    def __init__(
        self, chunk: int, layer_numel: int, threads: int, device: torch.device, mirror: bool
    ) -> None:

        self.cuda = device.type == "cuda"
        rows = math.ceil(layer_numel / COLUMNS)
        spec = GroupSpec("layers.0", [ParamSpec("layers.0.weight", (rows, COLUMNS))])
        self.slots = ring_slots(chunk, layer_numel, GRAD_SLOTS)
        mirror = mirror and self.cuda
        staging = STAGING_SLOTS if self.cuda and not mirror else 0  # as the engine's store
        self.store = HostStore.create([spec], staging_slots=staging,
                                      grad_dtype="bf16" if self.cuda else "f32",
                                      grad_slots=self.slots, chunk_elems=chunk or None,
                                      bf16_mirror=mirror)  # fmt: skip
        self.pinned: list[torch.Tensor] = []
        try:
            for region in ("staging", "grad", "mirror") if self.cuda else ():
                if self.store.region(region).numel():
                    pin(self.store.region(region), f"the chunk probe's {region}")
                    self.pinned.append(self.store.region(region))
        except BaseException:
            self._unpin()
            raise
        self.worker = UpdateWorker(self.store, threads)
        clock = LaneClock(device)
        stream = new_stream(device) if self.cuda else None
        self.lane = GradLane(self.store, self.worker, clock, stream, TIMEOUT_S, lambda g: g)
        dtype = torch.bfloat16 if self.cuda else torch.float32
        self.grad = torch.full((rows, COLUMNS), GRAD, dtype=dtype, device=device)
        self.window = None
        if self.cuda:
            window_spec = WindowSpec(torch.bfloat16, [0], slots=2, version_timeout_s=TIMEOUT_S)
            self.window = Window(self.store, Kernels(threads), device, clock, window_spec)
        self.device, self.version = device, 0

    def close(self) -> None:
        try:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.worker.drain(TIMEOUT_S)
        finally:
            self._unpin()
        self.window = None
        del self.grad
        if self.cuda:  # the run that follows in this process allocates afresh
            torch.cuda.empty_cache()

    def _unpin(self) -> None:

        while self.pinned:
            unpin(self.pinned.pop())

    def step(self) -> float:
        """Seconds for ``LAYERS`` layers streamed as a backward streams them (module
        docstring), the last version published and the last load landed."""

        self._sync()
        start = time.perf_counter()
        for i in range(LAYERS):
            if self.window is not None:  # another layer's load: the version already published
                buf = self.window.slots[i % len(self.window.slots)]
                buf.group = None  # the same group again: a load, not a hit
                self.window.load(buf, 0, self.store.version(0))
            self.version += 1
            adam = AdamArgs(step=self.version, lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01, grad_scale=1.0, version=self.version)  # fmt: skip
            ticket = self.lane.ticket(0, {"layers.0.weight": self.grad})
            self.lane.send(ticket, adam, check_finite=False)
            self.lane.flush(keep_last_group=True)
        self.lane.flush()
        self.store.wait_version(0, self.version, TIMEOUT_S)
        self._sync()
        return time.perf_counter() - start

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _measure(
    chunk: int, layer_numel: int, threads: int, device: torch.device, mirror: bool
) -> dict[str, Any]:
    """One candidate's row: the median of ``REPEATS`` after a warm-up pass (fresh shared
    memory faults its pages in)."""
    bench = _Bench(chunk, layer_numel, threads, device, mirror)
    try:
        bench.step()
        return {
            "chunk_elems": chunk,
            "grad_slots": bench.slots,
            "chunks": ring_slots(chunk, layer_numel, 1),
            "step_s": statistics.median(bench.step() for _ in range(REPEATS)),
        }
    finally:
        bench.close()


def format_report(report: dict[str, Any]) -> str:
    where = (
        f"cached: {report['cached']}"
        if report["cached"]
        else f"measured in {report['measured_s']:.1f} s"
    )
    loads = "none (CPU)" if report["gpu"] is None else "mirror" if report["mirror"] else "cast"
    lines = [
        f"slidedp profile chunks: a layer of {report['layer_numel']:,} parameters, "
        f"{report['threads']} update thread{'s' * (report['threads'] != 1)}, beside "
        f"{report['gpu'] or 'no GPU'}, loads: {loads} ({where}); {LAYERS} layers streamed, "
        f"median of {REPEATS}",
        "  chunk            chunks  grad slots  host side ms",
    ]
    for row in report["candidates"]:
        size = (
            "whole layer"
            if row["chunk_elems"] == 0
            else f"{row['chunk_elems'] * BF16_BYTES >> 20} MiB"
        )
        lines.append(
            f"  {size:<16} {row['chunks']:>6}  {row['grad_slots']:>10}  "
            f"{row['step_s'] * 1e3:>12.1f}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_probe_arguments(parser, "cuda: loads and returns through the GPU; cpu: returns alone")
    arg = parser.add_argument
    arg("--shape", default="qwen3-4b", help="a bench shape or a config.json: its largest layer")
    arg("--no-mirror", action="store_true", help="load by casting on the host (no BF16 mirror)")


def main(args: argparse.Namespace) -> int:

    device, threads = probe_device_threads(args)
    numel = layer_numel(HFAdapter(resolve_shape(args.shape)))  # as runtime.policy: auto takes it
    report = probe_chunks(numel, threads, device, mirror=not args.no_mirror, mib=CHUNK_MIB,
                          cache_dir=args.cache_dir, force=args.force)  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
