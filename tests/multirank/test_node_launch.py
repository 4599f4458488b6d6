"""Several machines as real launches on loopback: torchrun's multi-node rendezvous, the nodes'
config checks, a node that cannot reach node 0, and a node killed mid-run (every other node
stops with one line, non-zero, within 30 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.util import one_error_line, run
from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import reaped, training
from slidedp.runtime.launch import free_port

TIMEOUT_S = 120  # one launch of two nodes: a hang fails the test instead of blocking it


def _config(tmp_path: Path, steps: int, **runtime: object) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": steps, "global_batch_size": 4, "max_grad_norm": 1.0}
    runtime = {"version_timeout_s": 60} | runtime  # a collective never waits longer
    return write_config(
        tmp_path / "c.yaml",
        model,
        data,
        tmp_path / "out",
        train=train,
        runtime=runtime,
        output={"tensorboard": False},
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["runtime.nodes=2"], "runtime.nodes=2 needs runtime.master_addr"),
        (
            ["runtime.nodes=2", "runtime.node_rank=2", "runtime.master_addr=127.0.0.1"],
            "runtime.node_rank must be in [0, 1]",
        ),
        (["runtime.nodes=0"], "runtime.nodes must be >= 1"),
        (
            ["runtime.nodes=2", "runtime.master_addr=no-such-host.invalid"],
            "runtime.master_addr 'no-such-host.invalid' does not resolve",
        ),
        (
            ["runtime.nodes=3", "runtime.master_addr=127.0.0.1"],
            "not divisible by the 3 ranks (3 nodes x 1)",
        ),
    ],
)
def test_bad_node_settings_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], needle: str
) -> None:
    config = _config(tmp_path, 2)
    for verb in ("validate", "train"):
        code, _, err = run(capsys, verb, str(config), *overrides)
        assert code == 2
        one_error_line(err, verb, needle)
    assert not (tmp_path / "out").exists()


def _node(config: Path, node_rank: int, port: int) -> subprocess.Popen[str]:
    """``slidedp train`` on node ``node_rank`` of 2 (one rank each), node 0 at port ``port``."""
    overrides = [
        "runtime.nodes=2",
        f"runtime.node_rank={node_rank}",
        "runtime.master_addr=127.0.0.1",
        f"runtime.master_port={port}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "slidedp", "train", str(config), *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


# Two launched nodes of one rank each training like one rank (``slidedp train CONFIG
# runtime.nodes=2 runtime.node_rank=N runtime.master_addr=... runtime.master_port=...`` per node)
# are tests/bench/test_nodes.py's CPU measurement (node_runs starts that command per node, and
# the losses match one node's within 1e-5) and tests/multirank/test_gpu_nodes.py's CPU test (with
# the nodes' host states): a third launch of the same two nodes here would prove nothing more.


@pytest.mark.e2e
def test_torchrun_multi_node_rendezvous(tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`` on each "machine"."""
    config = _config(tmp_path, 2)
    endpoint = f"127.0.0.1:{free_port()}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "-m",
        "slidedp",
        "train",
        str(config),
    ]
    nodes = [
        subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errs = [p.communicate(timeout=TIMEOUT_S)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], errs
    assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1, 2]
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # the process is gone, and its children with it
        return []


@pytest.mark.e2e
def test_a_node_that_cannot_reach_node_0_says_so_and_exits_2(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, 2, version_timeout_s=3)
    node1 = _node(config, 1, free_port())  # nobody listens there
    _, err = node1.communicate(timeout=TIMEOUT_S)
    assert node1.returncode == 2  # a bad input (where node 0 is), not an unexpected error
    assert "Traceback (most recent call last)" not in err, err  # c10d's own C++ log stays
    assert "could not join the run's ranks at 127.0.0.1:" in err, err


def _slidedp_in_shm(pids: set[int]) -> set[str]:
    """The store segments in /dev/shm that processes ``pids`` created (named slidedp-PID-...;
    other tests' stores, in parallel workers, come and go)."""
    return {p for p in os.listdir("/dev/shm") if p.startswith(tuple(f"slidedp-{i}-" for i in pids))}


@pytest.mark.e2e
def test_a_killed_node_stops_the_other_node(tmp_path: Path) -> None:
    config = _config(tmp_path, 10_000)
    port = free_port()
    node0, node1 = _node(config, 0, port), _node(config, 1, port)
    with reaped(node0, node1):
        training(tmp_path / "out" / "metrics.jsonl", node0, node1, timeout_s=TIMEOUT_S)
        ranks = Path(f"/proc/{node1.pid}/task/{node1.pid}/children").read_text().split()
        assert len(ranks) == 1
        pids = {node0.pid, node1.pid, *map(int, ranks), *map(int, _children(node0.pid))}
        for pid in [node1.pid, *map(int, ranks)]:  # the whole machine goes, mid-step
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = node0.communicate(timeout=30)
        assert time.monotonic() - killed < 30
        node1.communicate()
        assert node0.returncode not in (0, None)
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert "a rank of another node failed" in lines[0], err
        assert not _slidedp_in_shm(pids)  # named segments (stores are unlinked once mapped)
        assert not _children(node0.pid)  # no rank of node 0 outlives it
