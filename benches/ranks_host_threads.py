"""Host thread pools of several ranks on one host (the cpu route's miss): each rank process updates
its owned groups with its own AdamW pool and, on the cpu route as it was then, summed the ranks'
gradient copies on its training thread with a second pool at the same time (the owners' update
workers sum now, on the AdamW pool). Every pool was sized to all cores by default (two ranks ran
four pools on the cores) until this bench and the run beside it
(benchmarks/2026-11-27-two-gpus-routes-h200.md, "Why the cpu route missed") made each rank's share
the default (``profile.host.engine_update_threads``). This times the ranks' host work with pools on
all cores against pools sized to each rank's share, in one run.

    .venv/bin/python benches/ranks_host_threads.py [--numel 50000000] [--groups 8]

Prints the slowest rank's time per pass and the aggregate rate (AdamW 28 B/param, a sum with
its Σ g² 16 B/param)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from typing import Any

import torch

from slidedp.kernels import Kernels, default_threads

REPS = 3


def _rank(world: int, threads: int, sums: bool, numel: int, groups: int, barrier: Any,
          out: Any) -> None:  # fmt: skip
    torch.set_num_threads(1)
    update, summer = Kernels(threads), Kernels(threads)
    owned = groups // world
    states = [[torch.randn(numel), torch.zeros(numel), torch.zeros(numel), torch.randn(numel)]
              for _ in range(owned)]  # fmt: skip
    dst, src = torch.randn(numel), torch.randn(numel)

    def sum_pass() -> None:
        for _ in range(owned):
            summer.sum_into(dst, [src], accumulate=True)
            summer.sum_squares(dst)

    for _ in range(REPS):
        barrier.wait()
        start = time.perf_counter()
        side = threading.Thread(target=sum_pass) if sums else None
        if side is not None:
            side.start()
        for p, m, v, g in states:
            update.adamw(p, m, v, g, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                         step=1)  # fmt: skip
        if side is not None:
            side.join()
        out.put(time.perf_counter() - start)


def run(world: int, threads: int, sums: bool, numel: int, groups: int) -> float:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(world, threads, sums, numel, groups, barrier, out))
             for _ in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    times = [out.get() for _ in range(REPS * world)]
    for p in procs:
        p.join()
    # a pass ends when its slowest rank does; reps finish in order on every rank
    passes = [max(times[k * world : (k + 1) * world]) for k in range(REPS)]
    best = min(passes)
    moved = groups // world * world * numel * (28 + (16 if sums else 0))
    print(f"ranks {world}, {threads:>3} threads per pool, sums {'on ' if sums else 'off'}: "
          f"{best:.3f} s, {moved / best / 1e9:6.1f} GB/s", flush=True)  # fmt: skip
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="parameters per group")
    parser.add_argument("--groups", type=int, default=8, help="groups in all (split by owner)")
    args = parser.parse_args()
    cores = default_threads()
    print(f"{cores} cores")
    for sums in (False, True):
        one = run(1, cores, sums, args.numel, args.groups)
        every = run(2, cores, sums, args.numel, args.groups)
        share = run(2, max(1, cores // 2), sums, args.numel, args.groups)
        print(f"  two ranks, pools on all cores {every / one:.2f}x one rank's time, "
              f"pools on each rank's share {share / one:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
