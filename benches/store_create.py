"""How fast the host store is created (its pages faulted in), at 1 thread and at all of them.

    python benches/store_create.py 60      # a 60 GB store, each way, in one process each

Each way runs in its own process (rayon's pool is sized once per process); prints GB/s and the
ratio of all threads over one. ``/dev/shm`` and the host's RAM must hold the store once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from slidedp.store import GroupSpec, HostStore, ParamSpec


def create_s(gigabytes: float) -> tuple[float, int]:
    """Seconds to create a store of about ``gigabytes`` (FP32 master and two moments)."""
    params = int(gigabytes * 1e9 / 12 / 64)  # 12 B a parameter, 64 groups
    groups = [GroupSpec(f"g{i}", [ParamSpec(f"g{i}.w", (params,), "f32")]) for i in range(64)]
    started = time.perf_counter()
    store = HostStore.create(groups, 2)
    return time.perf_counter() - started, store.total_bytes


def main() -> None:
    if len(sys.argv) == 3:  # one way, in this process
        seconds, size = create_s(float(sys.argv[1]))
        print(f"{sys.argv[2]:>5} threads: {size / 1e9:.1f} GB in {seconds:.2f} s, "
              f"{size / 1e9 / seconds:.1f} GB/s", flush=True)  # fmt: skip
        return
    for threads in ("1", str(len(os.sched_getaffinity(0)))):
        env = {**os.environ, "RAYON_NUM_THREADS": threads}
        subprocess.run([sys.executable, __file__, sys.argv[1], threads], env=env, check=True)


if __name__ == "__main__":
    main()
