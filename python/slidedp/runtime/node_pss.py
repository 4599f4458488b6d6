"""The host memory of this node's ranks for the training log: their PSS, summed, read by a thread.

PSS splits each shared page (the store in /dev/shm) between the processes that map it, so the
sum over a node's ranks counts the store once, as ``slidedp estimate``'s host RAM does. Several
nodes: this node's ranks only. Reading ``/proc/PID/smaps_rollup`` walks the process's page
tables (~20 ms per GiB mapped in 4 KiB pages: seconds per rank of a 14B store), so the training
thread never does: a thread samples, resting ``REST`` times a sample's duration (at least
``MIN_INTERVAL_S``) between two, and ``latest()`` returns the last sample at once (the first
call waits for the first).

Example::

    pss = NodePss([os.getpid(), peer_pid])
    sample = pss.latest()   # PssSample(node_bytes=..., own_bytes=..., ranks=2)
    pss.close()
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

REST = 9  # rest / sample duration: the thread keeps at most a tenth of one core busy
MIN_INTERVAL_S = 1.0


def proc_kib(path: str, key: str) -> int | None:
    """``key:   N kB`` of a /proc file in bytes; None where /proc does not have it (or the
    process is gone, or not ours to read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pss_bytes(pid: int) -> int | None:
    """Process ``pid``'s proportional set size; None when it is gone or cannot be read."""
    return proc_kib(f"/proc/{pid}/smaps_rollup", "Pss")


@dataclass(frozen=True)
class PssSample:
    node_bytes: int | None  # the sum over the node's ranks (None: one of them was unreadable)
    own_bytes: int | None  # this process's (rank 0's, in a training log)
    ranks: int  # how many processes ``node_bytes`` sums


class NodePss:
    """Samples the PSS of ``pids`` (this node's ranks) and of this process, on a thread."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = tuple(pids)
        self._latest: PssSample | None = None
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_closed,
                                        name="slidedp-node-pss", daemon=True)  # fmt: skip
        self._thread.start()

    def _sample_until_closed(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                self._latest = self._sample()
            finally:  # never a waiter left waiting
                self._first.set()
            self._stop.wait(max(MIN_INTERVAL_S, REST * (time.monotonic() - start)))

    def _sample(self) -> PssSample:
        own = os.getpid()
        read = {pid: pss_bytes(pid) for pid in self.pids}
        own_bytes = read[own] if own in read else pss_bytes(own)
        known = [v for v in read.values() if v is not None]
        node = sum(known) if len(known) == len(read) else None
        return PssSample(node, own_bytes, len(read))

    def latest(self) -> PssSample:
        """The last complete sample (the first call waits for the first one)."""
        self._first.wait()
        return self._latest or PssSample(None, None, len(self.pids))

    def close(self) -> None:
        """Stops the thread (after the sample it may be taking)."""
        self._stop.set()
        self._thread.join()
