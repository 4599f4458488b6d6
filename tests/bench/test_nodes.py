"""``slidedp bench nodes``: the prediction's shape (the reduction grows with the nodes, blocking
costs more than its own stream) and its refusals; the measurement on CPU with its loss parity;
what the simulated nodes run on CUDA (``node_runs.node_launches``: each node its GPUs, bf16,
NCCL's network transport with ``--nccl-net``), checked as data here and run on a GPU machine by
tests/multirank/test_gpu_nodes.py (tests/multirank/test_node_launch.py tests the launches)."""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

import pytest

from cli.util import one_error_line, run
from slidedp.bench.node_runs import (
    NCCL_NET_ENV,
    NodeLaunch,
    NodeShape,
    nccl_transports,
    node_launches,
    run_nodes,
    visible_gpus,
)
from slidedp.errors import ConfigError

# test_nodes.py's bound on losses (1e-5 relative): the runs do the same math and may differ
# only in the order of the gradient sums; a node that missed the other's half moves the losses
# by >= 1e-3 relative. (A two-way sum is the same in either order: here it is exact.)
LOSS_RTOL = 1e-5


def test_the_prediction_grows_with_the_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "nodes.json"
    code, out, _ = run(
        capsys,
        "bench",
        "nodes",
        "--predict",
        "qwen3-1.7b",
        "--batch",
        "4",
        "--seq-len",
        "512",
        "--json",
        str(report),
    )
    assert code == 0
    assert "PREDICTION" in out
    written = json.loads(report.read_text())
    assert written["provenance"]["argv"]  # bench.provenance
    rows = written["rows"]
    assert [r["nodes"] for r in rows] == [1, 2, 4, 8]
    for a, b in itertools.pairwise(rows):
        assert b["reduce_layer_s"] > a["reduce_layer_s"]
        assert b["blocking_s"] > a["blocking_s"]
        assert b["overlapped_s"] >= a["overlapped_s"]
    for r in rows:  # the engine's synchronous collective can only cost more
        assert r["blocking_s"] >= r["overlapped_s"]
    # blocking: each of the 28 layers' backward waits for its reduction, so a second node adds
    # about one cross-node all-reduce per layer to the step
    assert rows[1]["blocking_s"] - rows[0]["blocking_s"] > 10 * rows[1]["reduce_layer_s"]


@pytest.mark.e2e
def test_the_cpu_measurement_reports_loss_parity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 nodes x 1 rank against 1 node x 2 ranks (f32, gloo): both step times, the lane, and
    the two runs' losses, every step, equal within test_nodes.py's bound."""
    report = tmp_path / "nodes.json"
    argv = ["--hidden", "128", "--layers", "2", "--seq-len", "32", "--steps", "3"]
    code, out, _ = run(capsys, "bench", "nodes", *argv, "--json", str(report))
    assert code == 0
    assert "loss parity: max |dloss|" in out
    result = json.loads(report.read_text())
    assert (result["device"], result["dtype"], result["steps"]) == ("cpu", "float32", 3)
    for key in ("one_node_step_s", "nodes_step_s", "ratio", "all_reduce_s", "share"):
        assert result[key] > 0, key
    one, many = result["one_node_losses"], result["nodes_losses"]
    assert len(one) == len(many) == 3
    assert result["max_abs_dloss"] == max(abs(a - b) for a, b in zip(one, many, strict=True))
    assert result["max_abs_dloss"] <= LOSS_RTOL * max(one)


def test_cuda_nodes_each_get_their_gpus_bf16_and_the_nccl_net(tmp_path: Path) -> None:
    config, out = tmp_path / "run.yaml", tmp_path / "many"
    launches = functools.partial(
        node_launches, config, out, port=29600, cores=32, nccl_log=tmp_path / "nccl"
    )
    two = launches(NodeShape(2, 1, "cuda", ["0", "1"]), nccl_net=True)
    assert [x.env["CUDA_VISIBLE_DEVICES"] for x in two] == ["0", "1"]
    for n, x in enumerate(two):
        assert x.argv[-1] == f"runtime.node_rank={n}"
        for override in ("runtime.device=cuda", "runtime.gpus=1", "train.dtype=bfloat16",
                         "runtime.nodes=2", "runtime.master_port=29600",
                         "runtime.update_threads=16", f"output.dir={out}"):  # fmt: skip
            assert override in x.argv, override
        assert not any(a.startswith("runtime.ranks=") for a in x.argv)
        assert x.env.items() >= NCCL_NET_ENV.items()
        assert x.env["NCCL_P2P_DISABLE"] == x.env["NCCL_SHM_DISABLE"] == "1"
        assert x.env["OMP_NUM_THREADS"] == "16"  # cores / nodes
        assert x.env["NCCL_DEBUG_FILE"].startswith(str(tmp_path / "nccl"))
    # one node of both GPUs (the reference run): NCCL left to its own transport
    (one,) = launches(NodeShape(1, 2, "cuda", ["0", "1"]))
    assert one.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "runtime.gpus=2" in one.argv
    assert "runtime.update_threads=16" in one.argv  # the same per rank in both runs
    assert not one.env.keys() & NCCL_NET_ENV.keys()
    # of the GPUs this process sees, node n takes its ranks' share
    four = launches(NodeShape(2, 2, "cuda", ["4", "5", "6", "7"]))
    assert [x.env["CUDA_VISIBLE_DEVICES"] for x in four] == ["4,5", "6,7"]
    with pytest.raises(ConfigError, match="need 4 GPUs, this process sees 2"):
        launches(NodeShape(2, 2, "cuda", ["0", "1"]))


def test_cpu_nodes_keep_f32_the_thread_split_and_no_gpu(tmp_path: Path) -> None:
    config, out = tmp_path / "run.yaml", tmp_path / "many"
    launches = node_launches(config, out, NodeShape(2, 2, "cpu"), port=1, cores=16)
    for x in launches:
        assert "runtime.ranks=2" in x.argv
        assert "runtime.update_threads=2" in x.argv  # cores / (2 x all ranks)
        assert x.env == {"OMP_NUM_THREADS": "8"}
        assert not any(a.startswith(("runtime.device=", "train.dtype=")) for a in x.argv)
    with pytest.raises(ConfigError, match="needs CUDA"):
        node_launches(config, out, NodeShape(2, 1, "cpu"), port=1, cores=2, nccl_net=True)


def test_the_transports_come_from_nccls_log(tmp_path: Path) -> None:
    (tmp_path / "nccl.host.11.log").write_text(
        "host:11:12 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0\n"
        "host:11:12 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] [receive] via NET/Socket/0\n"
    )
    (tmp_path / "nccl.host.12.log").write_text(
        "host:12:13 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM/read\n"
        "host:12:13 [0] NCCL INFO comm 0x1 rank 1 nRanks 2 - Init COMPLETE\n"
    )
    assert nccl_transports(tmp_path) == ["NET/Socket", "P2P/CUMEM"]
    assert nccl_transports(tmp_path / "none") == []


def test_a_failed_node_run_says_what_each_node_and_nccl_said(tmp_path: Path) -> None:
    nccl = tmp_path / "nccl"
    nccl.mkdir()
    (nccl / "nccl.host.7.log").write_text(
        "host:7:8 [0] NCCL INFO Bootstrap\nhost:7:8 [0] NCCL WARN No transport found for rank 1\n"
    )
    quiet = NodeLaunch([sys.executable, "-c", "pass"], {}, tmp_path / "n0.stderr")
    env = {"NCCL_DEBUG_FILE": str(nccl / "nccl.%h.%p.log")}
    failing = NodeLaunch([sys.executable, "-c", "exit('boom')"], env, tmp_path / "n1.stderr")
    with pytest.raises(ConfigError) as failed:
        run_nodes([quiet, failing], 60)
    message = str(failed.value)
    assert "the 2-node run failed [0, 1]" in message
    assert "node 0: (nothing on stderr)" in message
    assert "node 1: boom [host:7:8 [0] NCCL WARN No transport found for rank 1]" in message
    hung = NodeLaunch([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "h")
    with pytest.raises(ConfigError, match=r"did not finish in 0\.5 s: a node hung"):
        run_nodes([hung], 0.5)


def test_the_visible_gpus_follow_cuda_visible_devices() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize("argv", [["--nodes", "1"], ["--steps", "2"], ["--ranks", "0"]])
def test_bad_measurement_settings_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, _, err = run(capsys, "bench", "nodes", *argv)
    assert code == 2
    one_error_line(err, "bench", "--nodes must be >= 2")


def test_the_nccl_net_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "bench", "nodes", "--nccl-net")
    assert code == 2
    one_error_line(err, "bench", "--nccl-net needs --device cuda")
