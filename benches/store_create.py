"""Time to create (allocate and zero-fill) a host store of a given size, by part count.

Run on the host to measure: ``python benches/store_create.py --gb 100 --parts 1,auto --reps 3``.
Each repetition creates a store of ``--gb`` GB (three FP32 arrays of one parameter) in
``--shm-dir`` from that many part files filled in parallel ("auto": one per core, each at least
1 GiB), then frees it; part counts alternate within a repetition so that they share conditions.
Prints one JSON object: cores, the load average, and per part count the seconds and GB/s of
every repetition (GB = 1e9 bytes). ``--mirror`` adds, once, a store with the BF16 mirror: the
seconds to write its master (torch's fill, every core) and then ``fill_mirror``'s (the trainer
runs it after the weights' fill, before any rank attaches).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

from slidedp.kernels import Kernels
from slidedp.runtime.window import fill_mirror
from slidedp.store import GroupSpec, HostStore, ParamSpec


def create_seconds(values: int, parts: int | None, shm_dir: str) -> tuple[float, int, int]:
    """Seconds to create the store, its bytes and its part count; the store is freed after."""
    groups = [GroupSpec("g", [ParamSpec("w", (values,))])]
    start = time.perf_counter()
    store = HostStore.create(groups, staging_slots=0, shm_dir=shm_dir, parts=parts)
    seconds = time.perf_counter() - start
    nbytes, made = store.total_bytes, len(store.name.split("-")[2].split("."))
    del store
    gc.collect()
    return seconds, nbytes, made


def mirror_seconds(values: int, shm_dir: str) -> dict[str, float]:
    """Seconds to create a store with the BF16 mirror, to fill its master, then its mirror."""
    groups = [GroupSpec("g", [ParamSpec("w", (values,))])]
    start = time.perf_counter()
    store = HostStore.create(groups, staging_slots=0, shm_dir=shm_dir, bf16_mirror=True)
    created = time.perf_counter()
    store.master("w").fill_(0.5)
    filled = time.perf_counter()
    fill_mirror(store, Kernels())
    done = time.perf_counter()
    assert store.mirror_group(0)[:values].eq(0.5).all()
    times = {"create_s": created - start, "master_fill_s": filled - created}
    times["fill_mirror_s"] = done - filled
    return {k: round(v, 3) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=4.0, help="store size in GB (1e9 bytes)")
    p.add_argument("--parts", default="1,auto", help="comma-separated part counts or 'auto'")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--mirror", action="store_true", help="also time fill_mirror, once")
    args = p.parse_args()
    values = int(args.gb * 1e9 / 12)  # master, exp_avg, exp_avg_sq: 4 bytes each
    labels = args.parts.split(",")
    counts = [None if c == "auto" else int(c) for c in labels]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for _ in range(args.reps):
        for label, count in zip(runs, counts, strict=True):
            seconds, nbytes, made = create_seconds(values, count, args.shm_dir)
            runs[label].append(
                {"s": round(seconds, 3), "gb_s": round(nbytes / seconds / 1e9, 2), "parts": made}
            )
    report: dict[str, object] = {"gb": args.gb, "cores": os.cpu_count(), "runs": runs}
    if args.mirror:  # the same FP32 bytes plus the mirror's BF16 (values * 2 bytes)
        report["mirror"] = mirror_seconds(values, args.shm_dir)
    report["loadavg"] = os.getloadavg()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
