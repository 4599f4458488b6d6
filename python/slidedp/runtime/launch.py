"""``slidedp train`` with ``runtime.ranks``/``runtime.gpus`` > 1: one process per rank, watched.

Each rank is ``python -m slidedp train CONFIG ...`` with the environment ``torchrun`` would set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); stdout and stderr
pass through (only rank 0 logs). When a rank fails, the others are woken by the poisoned store
or a failed collective and exit; any rank still running ``GRACE_S`` later is killed. The exit
code is the first failing rank's (a rank killed by a signal: 1), with one line naming it.

Example::

    sys.exit(launch(2, ["train", "run.yaml", "train.max_steps=5"]))
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from slidedp.runtime.dist import EXIT_PEER_FAILED

GRACE_S = 10.0  # survivors of a failure get this long to exit on their own


def free_port() -> int:
    """A TCP port free on localhost now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


def launch(
    world: int, argv: list[str], *, module: str = "slidedp", name: str = "slidedp train"
) -> int:
    """Run ``python -m MODULE ARGV`` as ``world`` ranks (``name`` heads the failure line);
    0 when every rank succeeded."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = os.environ | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env))
    first: tuple[int, int] | None = None  # (rank, exit code) of the first failure
    deadline = None
    try:
        while True:
            codes = [p.poll() for p in procs]  # one snapshot: a rank that exits between the
            for rank, code in enumerate(codes):  # loop test and a poll is never missed
                if code not in (None, 0) and (first is None or first[1] == EXIT_PEER_FAILED):
                    if first is None or code != EXIT_PEER_FAILED:
                        first = (rank, code)
                    deadline = deadline or time.monotonic() + GRACE_S
            if None not in codes:
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
    finally:
        for p in procs:  # Ctrl-C, or an error here: no rank outlives the launcher
            if p.poll() is None:
                p.kill()
            p.wait()
    if first is None:
        return 0
    rank, code = first
    others = [r for r in range(world) if r != rank]
    print(
        f"{name}: rank {rank} {_describe(code)}; stopped ranks {others}",
        file=sys.stderr,
        flush=True,
    )
    return 1 if code < 0 else code
