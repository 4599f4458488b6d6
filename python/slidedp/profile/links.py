"""The collectives between this host's GPUs that the routes use, at one decoder layer's size:
the bf16 ``reduce`` of the gpu gradient route and the bf16 ``all_gather`` of the sharded route;
``autopolicy.route_choice`` predicts each route's step with them.

One process, torch's single-process NCCL API over the first ``gpus`` devices (no rendezvous);
the median of ``REPS`` after ``WARMUP``, as algorithm bandwidths in GB/s of the whole layer's
bytes (``plan.timing.Links``). Invariant: cached (``profile.cache``) under the GPU name and
count, the layer's size and the torch, NCCL and slidedp versions; ``cached_links`` only looks
up, ``probe_links`` measures where missing.

Example::

    report = probe_links(2, layer_numel=50_000_000)
    report["reduce_gbps"], report["gather_gbps"]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from slidedp import __version__
from slidedp.profile.cache import cache_file, keep_report, read_report

WARMUP = 2
REPS = 5
DTYPE = torch.bfloat16
RATES = ("reduce_gbps", "gather_gbps")


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    except (AttributeError, RuntimeError):
        return "none"


def links_facts(gpus: int, gpu_name: str, layer_numel: int) -> dict[str, Any]:
    """The cache key's facts: what the rates depend on."""
    return {
        "gpu": gpu_name,
        "gpus": gpus,
        "layer_numel": layer_numel,
        "torch": torch.__version__,
        "nccl": _nccl_version(),
        "slidedp": __version__,
    }


def _read(facts: dict[str, Any], cache_dir: str | None) -> dict[str, Any] | None:
    path = cache_file(cache_dir, "links", facts)
    report = read_report(path)
    if report is None or any(report.get(k) != v for k, v in facts.items()):
        return None
    rates = [report.get(k) for k in RATES]
    if not all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in rates):
        return None
    return report | {"cached": str(path)}


def cached_links(
    gpus: int, gpu_name: str, layer_numel: int, cache_dir: str | None = None
) -> dict[str, Any] | None:
    """The cached probe of ``gpus`` GPUs named ``gpu_name`` at ``layer_numel``, or None;
    nothing is measured."""
    return _read(links_facts(gpus, gpu_name, layer_numel), cache_dir)


def probe_links(
    gpus: int, layer_numel: int, *, cache_dir: str | None = None, force: bool = False
) -> dict[str, Any]:
    """The probe's report for the first ``gpus`` CUDA devices: cached, else (or with
    ``force``) measured and cached."""
    if torch.cuda.device_count() < gpus:
        raise RuntimeError(f"the link probe needs {gpus} visible GPUs, found "
                           f"{torch.cuda.device_count()}")  # fmt: skip
    facts = links_facts(gpus, torch.cuda.get_device_name(0), layer_numel)
    if not force and (report := _read(facts, cache_dir)) is not None:
        return report
    start = time.perf_counter()
    measured = facts | _measure(gpus, layer_numel) | {"measured_s": time.perf_counter() - start}
    keep_report(cache_file(cache_dir, "links", facts), measured)
    return measured | {"cached": None}


def _median_s(call: Callable[[], None], devices: list[torch.device]) -> float:
    times = []
    for rep in range(WARMUP + REPS):
        for d in devices:
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        call()
        for d in devices:
            torch.cuda.synchronize(d)
        if rep >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(gpus: int, layer_numel: int) -> dict[str, Any]:
    from torch.cuda import nccl  # noqa: PLC0415  CUDA builds only

    devices = [torch.device("cuda", i) for i in range(gpus)]
    share = -(-layer_numel // gpus)  # the sharded route's share, the layer padded to gpus x it
    numel = share * gpus
    # layers: [numel] per device (the reduce's inputs, the all-gather's outputs)
    layers = [torch.zeros(numel, dtype=DTYPE, device=d) for d in devices]
    summed = torch.empty(numel, dtype=DTYPE, device=devices[0])  # [numel] on the owner
    shares = [torch.zeros(share, dtype=DTYPE, device=d) for d in devices]  # [share] per device
    reduce_s = _median_s(lambda: nccl.reduce(layers, output=summed, root=0), devices)
    gather_s = _median_s(lambda: nccl.all_gather(shares, layers), devices)
    layer_bytes = numel * torch.finfo(DTYPE).bits // 8
    return {
        "numel": numel,
        "bytes": layer_bytes,
        "reduce_s": reduce_s,
        "gather_s": gather_s,
        "reduce_gbps": layer_bytes / reduce_s / 1e9,
        "gather_gbps": layer_bytes / gather_s / 1e9,
        "warmup": WARMUP,
        "reps": REPS,
    }
