"""The age of a bench worker's process, the first part of its time to the first step (the parts
of a run of ours: tests/bench/test_train.py's end-to-end bench)."""

from __future__ import annotations

from slidedp.bench.ours import process_age_s


def test_the_process_age_counts_from_the_process_start() -> None:
    first = process_age_s()
    assert 0 < first < 24 * 3600
    assert process_age_s() >= first
