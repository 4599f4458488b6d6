"""A host probe report written into the cache as ``slidedp profile host`` would leave it, with
a rate no machine has, so a test sees whether a caller took it."""

from __future__ import annotations

from pathlib import Path

from slidedp.profile.cache import cache_file, write_report
from slidedp.profile.host import host_facts


def cache_rate(
    threads: int,
    gpu: str | None,
    gbps: float,
    joint_gbps: float | None = None,
    cast_gbps: float = 50.0,
    pools: tuple[int, float | None] | None = None,
) -> Path:
    """Cache ``gbps`` (and ``joint_gbps``, ``cast_gbps``; ``pools``: R ranks and the rate of
    one of their pools) as this machine's probe at ``threads`` beside ``gpu``, in the default
    cache directory (``$XDG_CACHE_HOME``); returns the file."""
    ranks, pool_gbps = pools or (1, None)
    facts = host_facts(threads, gpu, ranks)
    path = cache_file(None, "host", facts)
    joint = {"joint_adamw_gbps": joint_gbps}
    if joint_gbps is not None:
        joint |= {"joint_h2d_gbps": 50.0, "joint_d2h_gbps": 50.0, "joint_cast_gbps": cast_gbps}
    numbers = {"params": 1, "passes": 1, "isa": "avx2", "state_bytes": 12, "measured_s": 0.1}
    if pool_gbps is not None:
        numbers |= {"pool_adamw_gbps": pool_gbps, "pools_adamw_gbps": ranks * pool_gbps,
                    "pool_threads": max(1, threads // ranks)}  # fmt: skip
    write_report(path, facts | {"adamw_gbps": gbps} | joint | numbers)
    return path


def cache_chunks(threads: int, gpu: str, layer_numel: int, mirror: bool,
                 step_s: dict[int, float]) -> Path:  # fmt: skip
    """Cache a chunk probe of this machine with ``step_s`` by ``chunk_elems`` (0, the whole
    layer, first), in the default cache directory; returns the file."""
    from slidedp.profile.chunks import chunk_facts, ring_slots

    facts = chunk_facts(threads, gpu, layer_numel, mirror)
    rows = [{"chunk_elems": c, "grad_slots": ring_slots(c, layer_numel, 4), "chunks": 1,
             "step_s": t} for c, t in step_s.items()]  # fmt: skip
    path = cache_file(None, "chunks", facts)
    write_report(path, facts | {"candidates": rows, "measured_s": 0.1})
    return path
