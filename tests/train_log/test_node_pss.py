"""``runtime.node_pss``: the PSS of a node's processes, summed on a thread of its own."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from slidedp.runtime.node_pss import NodePss, pss_bytes
from slidedp.runtime.train_log import LogMemory, LogSteps, StepLog

BALLAST_MIB = 64
HOLDER = (
    f"import sys; b = b'x' * ({BALLAST_MIB} << 20); print('ready', flush=True); sys.stdin.read()"
)


def _holder() -> subprocess.Popen[str]:
    """A process holding ``BALLAST_MIB`` MiB of its own, once it printed ready."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_the_node_s_pss_sums_its_processes_and_is_unknown_when_one_is_unreadable() -> None:
    peer = _holder()
    try:
        pss = NodePss([os.getpid(), peer.pid])
        sample = pss.latest()
        pss.close()
        assert sample.ranks == 2
        assert sample.own_bytes is not None
        assert sample.node_bytes is not None
        assert sample.node_bytes - sample.own_bytes >= BALLAST_MIB << 20
    finally:
        peer.communicate("")
    gone = NodePss([os.getpid(), peer.pid])  # exited and reaped: not a figure
    assert gone.latest().node_bytes is None
    gone.close()
    assert pss_bytes(peer.pid) is None


def test_the_line_says_it_is_the_node_s_and_gives_rank_0_s(tmp_path: Path) -> None:
    peer = _holder()
    out = io.StringIO()
    try:
        log = StepLog(tmp_path, flops_per_token=lambda s: 1.0, stream=out,
                      steps=LogSteps(total=1, start=0, every=1),
                      memory=LogMemory(node_pids=(os.getpid(), peer.pid)))  # fmt: skip
        log.step({"step": 1, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 10,
                  "seq_len": 10, "step_time_s": 0.1})  # fmt: skip
        log.close()
    finally:
        peer.communicate("")
    line = out.getvalue().splitlines()[-1]
    assert " (2 processes of this node; rank 0 " in line, line  # its ranks and the launcher
