"""A bench worker's age (the first part of its time to the first step; the parts of a run of
ours: tests/bench/test_train.py's end-to-end bench) and its host memory, true for a worker
forked from a zygote as for a fresh interpreter (the forked age: tests/multirank/test_zygote.py)."""

from __future__ import annotations

import os
from pathlib import Path

from slidedp.bench.measure import process_pss_bytes
from slidedp.runtime.zygote import process_age_s

HELD_BYTES = 64 << 20


def test_the_process_age_counts_from_the_process_start() -> None:
    first = process_age_s()
    assert 0 < first < 24 * 3600
    assert process_age_s() >= first


def test_a_forked_copy_counts_the_memory_it_shares_copy_on_write_whole() -> None:
    """Parent and child share ``held`` copy-on-write: plain PSS gives each half of it; a fresh
    interpreter that built it would hold all of it, and so each counts it whole."""
    held = bytearray(b"\x01" * HELD_BYTES)  # written: anonymous pages, resident
    go_read, go_write = os.pipe()
    child = os.fork()
    if child == 0:  # only async-signal-safe calls: this process may have computed
        os.read(go_read, 1)
        os._exit(0)
    try:  # plain PSS splits ``held`` in two: counted whole, each gains at least half of it
        assert process_pss_bytes(child) - _plain_pss_bytes(child) >= HELD_BYTES // 2
        assert process_pss_bytes(os.getpid()) - _plain_pss_bytes(os.getpid()) >= HELD_BYTES // 2
    finally:
        os.write(go_write, b"x")
        os.waitpid(child, 0)
        os.close(go_read)
        os.close(go_write)
    assert held[-1] == 1


def _plain_pss_bytes(pid: int) -> int:
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
