"""Nodes that would train apart refuse at the meeting, before any collective, with one line on
every node and exit 2: another config, another launch, a node late or never there, a port
taken by someone else; identical data copies at another path do train."""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cli.util import one_error_line
from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import reaped, training
from slidedp.config import load_config
from slidedp.errors import ConfigError
from slidedp.runtime import node_meet
from slidedp.runtime.dist import LAUNCHER_PID, Dist
from slidedp.runtime.launch import free_port
from slidedp.runtime.node_meet import PER_NODE, config_facts, join

TIMEOUT_S = 120  # one launch of two nodes: a hang fails the test instead of blocking it


def _config(tmp_path: Path, steps: int = 2, timeout_s: float = 60) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 30)
    return write_config(
        tmp_path / "c.yaml",
        model,
        data,
        tmp_path / "out",
        train={"max_steps": steps, "global_batch_size": 4, "learning_rate": 1e-3},
        runtime={"version_timeout_s": timeout_s},
        output={"tensorboard": False},
    )


def _node(config: Path, node_rank: int, port: int, *overrides: str) -> subprocess.Popen[str]:
    """``slidedp train`` on node ``node_rank`` of 2 (one rank each), node 0 at ``port``."""
    command = [sys.executable, "-m", "slidedp", "train", str(config), "runtime.nodes=2",
               f"runtime.node_rank={node_rank}", "runtime.master_addr=127.0.0.1",
               f"runtime.master_port={port}", *overrides]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _two_nodes(config: Path, node0: list[str], node1: list[str]) -> list[tuple[int, str]]:
    """Each node's exit code and stderr."""
    port = free_port()
    procs = [_node(config, 0, port, *node0), _node(config, 1, port, *node1)]
    with reaped(*procs):
        errs = [p.communicate(timeout=TIMEOUT_S)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def test_the_config_facts_leave_out_only_what_each_node_sets_its_own_way(
    tmp_path: Path,
) -> None:
    nodes = ["runtime.nodes=2", "runtime.master_addr=127.0.0.1"]
    node1 = ["runtime.node_rank=1", "output.dir=/elsewhere", "data.path=/copy/data.jsonl"]
    facts = config_facts(load_config(_config(tmp_path), nodes + node1))
    assert facts["train.learning_rate"] == "0.001"
    assert {"train.seed", "train.max_steps", "data.shuffle", "runtime.grad_route"} <= set(facts)
    assert not PER_NODE & set(facts)
    # node 1's own node_rank, output.dir and data copy: nothing compared differs
    assert config_facts(load_config(_config(tmp_path), nodes)) == facts


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("node1", "line"),
    [
        (["train.learning_rate=0.5"], "node 1's train.learning_rate is 0.5, node 0's 0.001: "
         "start every node with the same config"),
        (["train.max_steps=5"], "node 1's train.max_steps is 5, node 0's 2"),
        (["runtime.nodes=4"], "node 1's runtime.nodes is 4, node 0's 2"),
    ],
)  # fmt: skip
def test_nodes_started_with_another_config_refuse_on_every_node(
    tmp_path: Path, node1: list[str], line: str
) -> None:
    config = _config(tmp_path)
    for code, err in _two_nodes(config, [], node1):
        assert code == 2, err
        one_error_line(err, "train", line)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_another_number_of_ranks_per_node_refuses_at_once(tmp_path: Path) -> None:
    """Node 0 runs 2 ranks, node 1 one (before: each waited runtime.version_timeout_s, then
    c10d's store timeout)."""
    config = _config(tmp_path, timeout_s=600)
    start = time.monotonic()
    for code, err in _two_nodes(config, ["runtime.ranks=2"], []):
        assert code == 2, err
        one_error_line(err, "train", "node 1's ranks per node is 1, node 0's 2: start every node")
    assert time.monotonic() - start < TIMEOUT_S


@pytest.mark.e2e
def test_a_node_that_never_comes_is_named_by_node_0(tmp_path: Path) -> None:
    node0 = _node(_config(tmp_path, timeout_s=3), 0, free_port())
    with reaped(node0):
        _, err = node0.communicate(timeout=TIMEOUT_S)
    assert node0.returncode == 2
    assert err.splitlines() == [
        "slidedp train: error: waited 3 s (runtime.version_timeout_s), 1 of 2 nodes joined: "
        "start node 1 (runtime.node_rank=1) and check that its runtime.master_addr/master_port "
        "reach node 0"
    ]


@pytest.mark.e2e
def test_a_port_another_program_holds_is_named_on_both_nodes(tmp_path: Path) -> None:
    """Node 0 cannot listen; node 1 reaches a listener that never answers as a store (before:
    it waited forever)."""
    config = _config(tmp_path, timeout_s=3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        procs = [_node(config, 0, port), _node(config, 1, port)]
        with reaped(*procs):
            errs = [p.communicate(timeout=TIMEOUT_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert errs[0].splitlines() == [
        f"slidedp train: error: runtime.master_port {port} is in use on node 0 (another run, or "
        "node 0 started twice): choose another port"
    ]
    one_error_line(errs[1], "train", "it did not answer as node 0's store")


@pytest.mark.e2e
def test_identical_data_at_another_path_trains(tmp_path: Path) -> None:
    config = _config(tmp_path)
    copy = tmp_path / "copy" / "data.jsonl"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "data.jsonl", copy)
    for code, err in _two_nodes(config, [], [f"data.path={copy}"]):
        assert code == 0, err
    assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1, 2]


@pytest.mark.e2e
def test_other_held_out_data_on_a_node_refuses(tmp_path: Path) -> None:
    """data.eval_path is a node's own path (copies elsewhere are fine), but its samples must be
    node 0's: each node's loss would be of another set, summed as one."""
    config = _config(tmp_path)
    held = [write_data(tmp_path / f"held{n}.jsonl", 4 + 4 * n, seed=7 + n) for n in (0, 1)]
    (code0, err0), (code1, err1) = _two_nodes(
        config, [f"data.eval_path={held[0]}"], [f"data.eval_path={held[1]}"]
    )
    assert code0 == 2, err0  # node 0 compares what the nodes loaded; node 1 stops as its peer
    one_error_line(err0, "train", "node 1's held-out data records is 8, node 0's 4: every node "
                   "must see the same model.path, data files")  # fmt: skip
    assert code1 != 0
    assert "a rank of another node failed (its node says which)" in err1
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_ctrl_c_on_node_1_tells_its_operator_node_0_saved(tmp_path: Path) -> None:
    config = _config(tmp_path, steps=10_000)
    port = free_port()
    node0, node1 = _node(config, 0, port), _node(config, 1, port)
    with reaped(node0, node1):
        training(tmp_path / "out" / "metrics.jsonl", node0, node1, timeout_s=TIMEOUT_S)
        node1.send_signal(signal.SIGINT)
        errs = [p.communicate(timeout=TIMEOUT_S)[1] for p in (node0, node1)]
    assert [node0.returncode, node1.returncode] == [2, 2], errs
    one_error_line(errs[0], "train", "stopped by a signal to another rank", "saved")
    assert errs[1].splitlines() == [
        "slidedp train: stopped with every node by a signal: node 0 saved a checkpoint (its log "
        "says which); continue with train.resume=auto on every node"
    ]


def test_the_node_s_processes_include_its_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logged node PSS counts the launcher too (the ranks' parent)."""
    monkeypatch.setenv(LAUNCHER_PID, str(os.getppid()))
    store = dist.HashStore()  # type: ignore[attr-defined]  # public, not in its stubs
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    try:
        pids = Dist(0, 1, 0, 1).node_pids()
    finally:
        dist.destroy_process_group()
    assert pids == [os.getpid(), os.getppid()]


def _meet(port: int, ranks: list[Dist], timeouts: list[float]) -> list[object]:
    """``join`` of each rank on a thread of this process (node 0's rank 0 hosts the store):
    each one's store, or the error it raised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    results: list[object] = [None] * len(ranks)

    def one(i: int) -> None:
        try:
            results[i] = join(ranks[i], timeouts[i], {"train.seed": "1"})
        except Exception as e:  # the rank's refusal, compared below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return results


def test_a_node_started_again_after_the_meeting_refuses_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The review's repro: node 1 started a second time while the run trains hung in the
    process group's start; it now says it joined after every rank had met."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    port = free_port()
    met = _meet(port, [Dist(0, 2, 0, 1), Dist(1, 2, 0, 1)], [20, 20])
    assert not any(isinstance(met_one, Exception) for met_one in met), met
    (again,) = _meet(port, [Dist(1, 2, 0, 1)], [5])
    assert isinstance(again, ConfigError)
    assert str(again) == (
        "rank 1 joined after all 2 ranks had met (node 1 started twice?): start each node "
        "once, with its own runtime.node_rank"
    )
    assert met[1].timeout == datetime.timedelta(seconds=20)  # type: ignore[attr-defined]


def test_a_rank_that_leaves_the_meeting_stops_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's repro: node 1 gave up waiting (a shorter version_timeout_s, or a signal)
    after node 0 counted it; node 0 went on to the process group with a rank missing."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(node_meet, "VERDICT_GRACE_S", 0.0)  # node 1 leaves before node 2 comes
    port = free_port()
    ranks = [Dist(0, 3, 0, 1), Dist(1, 3, 0, 1)]
    early = _meet(port, ranks, [8, 1])  # node 2 never comes within node 1's 1 s
    assert isinstance(early[1], ConfigError)
    assert "did not say within 1 s" in str(early[1])
    assert isinstance(early[0], ConfigError)
    assert str(early[0]).startswith("a rank left while the nodes met")
