"""Several nodes, one host store each (CPU, gloo, loopback): 2 simulated nodes x 2 ranks against
1 node x 4 ranks and 1 rank at the same global batch; the nodes' states bit for bit equal;
checkpoints resumed on another node count; a failure or a signal on one node stops every node.

Tolerance: the tests/multirank/test_parity.py bounds (1e-5 relative on losses and norms, 1e-5
absolute on parameters), for the same reason: the runs do the same math and differ only in the
order of the gradient sums (two node sums, then the sum over nodes; or one 4-way reduce; or one
rank's whole batch), f32 rounding amplified by AdamW's m/sqrt(v). A node whose gradient missed
the other node's half moves the losses by >= 1e-3 relative. The nodes of one run sum the same
bits in the same order, so their states must be *equal*, not close.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import REGIONS, latest_step, run_ranks
from slidedp.cli import main
from slidedp.runtime.dist import EXIT_PEER_FAILED, EXIT_STOPPED_WITH_PEERS

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

TRAIN = {"max_steps": 6, "global_batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 2}
OUTPUT = {"tensorboard": False}


def _series(out: Path, key: str, steps: slice = slice(None)) -> torch.Tensor:
    return torch.tensor([m[key] for m in read_metrics(out)[steps]], dtype=torch.float64)


def _assert_same_run(a: Path, b: Path, first_step: int = 0) -> None:
    """``b``'s losses, norms and final parameters match ``a``'s within the tolerance (``b``
    resumed after ``first_step`` steps)."""
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            _series(b, key), _series(a, key, slice(first_step, None)), rtol=LOSS_RTOL, atol=0
        )
    pa, pb = (
        load_file(a / "final" / "model.safetensors"),
        load_file(b / "final" / "model.safetensors"),
    )
    assert set(pa) == set(pb)
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= PARAM_ATOL


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("grad_route", "param_route", "max_grad_norm"),
    [("gpu", "replicated", 2.4), ("cpu", "sharded", 2.4), ("gpu", "sharded", 0.0)],
)
def test_two_nodes_of_two_ranks_match_one_node_of_four_and_one_rank(
    tmp_path: Path, grad_route: str, param_route: str, max_grad_norm: float
) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = TRAIN | {"max_grad_norm": max_grad_norm}
    runtime = {
        "grad_route": grad_route,
        "param_route": param_route,
        "chunk_elems": 1000,
        "version_timeout_s": 60,
    }
    outs = {name: tmp_path / name for name in ("one", "four", "nodes")}
    configs = {
        name: write_config(
            tmp_path / f"{name}.yaml",
            model,
            data,
            out,
            train=train,
            runtime=runtime | ({} if name == "one" else {"ranks": 2 if name == "nodes" else 4}),
            output=OUTPUT,
        )
        for name, out in outs.items()
    }
    assert main(["train", str(configs["one"])]) == 0
    assert run_ranks(configs["four"], 4) == [0] * 4
    dump = tmp_path / "dump"
    dump.mkdir()
    assert run_ranks(configs["nodes"], 4, nodes=2, dump=dump) == [0] * 4

    _assert_same_run(outs["one"], outs["nodes"])
    _assert_same_run(outs["four"], outs["nodes"])
    if max_grad_norm > 0:
        clipped = [m["clip_coef"] < 1.0 for m in read_metrics(outs["nodes"])]
        assert any(clipped), "clipping must bind in some steps"
        assert not all(clipped), "and leave others unclipped"
    first = load_file(next(model.glob("*.safetensors")))
    final = load_file(outs["nodes"] / "final" / "model.safetensors")
    assert max((final[n] - first[n]).abs().max().item() for n in final) > 100 * PARAM_ATOL
    node0, node1 = torch.load(dump / "node0.pt"), torch.load(dump / "node1.pt")
    for region in REGIONS:  # replicated host state: every node applied the same updates
        assert torch.equal(node0[region], node1[region]), region
    assert not torch.equal(node0["exp_avg"], torch.zeros_like(node0["exp_avg"]))


@pytest.mark.e2e
def test_checkpoints_resume_across_a_change_of_node_count(tmp_path: Path) -> None:
    """1 rank writes checkpoint-3; 2 nodes x 1 rank resume it (each node loads it into its own
    store) and write checkpoints 4..6; 1 rank resumes checkpoint-4: both follow the
    uninterrupted run."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = TRAIN | {"max_grad_norm": 2.4}
    one, nodes, back = tmp_path / "one", tmp_path / "nodes", tmp_path / "back"
    c1 = write_config(
        tmp_path / "1.yaml", model, data, one, train=train, output=OUTPUT | {"save_steps": 3}
    )
    assert main(["train", str(c1)]) == 0
    c2 = write_config(
        tmp_path / "2.yaml",
        model,
        data,
        nodes,
        train=train | {"resume": str(one / "checkpoint-3")},
        runtime={"version_timeout_s": 60},
        output=OUTPUT | {"save_steps": 1},
    )
    assert run_ranks(c2, 2, nodes=2) == [0, 0]
    assert [m["step"] for m in read_metrics(nodes)] == [4, 5, 6]
    _assert_same_run(one, nodes, 3)
    c3 = write_config(
        tmp_path / "3.yaml",
        model,
        data,
        back,
        train=train | {"resume": str(nodes / "checkpoint-4")},
        output=OUTPUT,
    )
    assert main(["train", str(c3)]) == 0
    assert [m["step"] for m in read_metrics(back)] == [5, 6]
    _assert_same_run(one, back, 4)


def _nodes_config(tmp_path: Path, steps: int) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {
        "max_steps": steps,
        "global_batch_size": 4,
        "max_grad_norm": 1.0,
        "lr_scheduler": "constant",
    }
    runtime = {"ranks": 2, "version_timeout_s": 60}  # a hang would outlast the test's bound
    return write_config(
        tmp_path / "c.yaml",
        model,
        data,
        tmp_path / "out",
        train=train,
        runtime=runtime,
        output=OUTPUT,
    )


@pytest.mark.e2e
def test_a_rank_that_raises_on_one_node_stops_every_node(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    codes = run_ranks(_nodes_config(tmp_path, 6), 4, nodes=2, fail=(3, 2))
    assert codes == [EXIT_PEER_FAILED] * 3 + [1]
    err = capfd.readouterr().err
    assert err.count("injected failure on rank 3") == 1, err


@pytest.mark.e2e
def test_a_signal_to_one_node_stops_every_node_after_the_same_step(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Rank 3 (node 1) alone gets SIGTERM in step 2: all four stop after step 2, rank 0 (node
    0) saves once, and a resume on 2 nodes continues bit for bit."""
    config = _nodes_config(tmp_path, 4)
    out = tmp_path / "out"
    assert run_ranks(config, 4, nodes=2, term=(3, 1)) == [2] + [EXIT_STOPPED_WITH_PEERS] * 3
    err = capfd.readouterr().err
    assert err.count("stopped by a signal to another rank after step 2: saved") == 1, err
    assert latest_step(out) == 2
    assert run_ranks(config, 4, ["train.resume=auto"], nodes=2) == [0] * 4
    resumed = [(m["loss"], m["grad_norm"]) for m in read_metrics(out)]
    straight = tmp_path / "straight"
    assert run_ranks(config, 4, [f"output.dir={straight}"], nodes=2) == [0] * 4
    assert resumed[-2:] == [(m["loss"], m["grad_norm"]) for m in read_metrics(straight)][-2:]


def test_nodes_that_would_start_apart_refuse_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Node 1 sees another checkpoint than node 0 (as without a shared output.dir): rank 0
    names the difference once and exits 2, the others stop as its peers."""
    from slidedp.runtime import node_meet, trainer
    from slidedp.runtime.trainer import Trainer

    facts, computed = node_meet.start_facts, tmp_path / "facts.log"

    def other_step_on_node_1(self: Trainer) -> dict[str, str]:
        with computed.open("a") as f:  # one short line per write: never interleaved
            f.write(f"{os.environ['RANK']}\n")
        mine = facts(self)
        return mine | {"start step": "3"} if os.environ["RANK"] == "2" else mine

    monkeypatch.setattr(trainer, "start_facts", other_step_on_node_1)
    codes = run_ranks(_nodes_config(tmp_path, 4), 4, nodes=2)
    assert codes == [2] + [EXIT_PEER_FAILED] * 3
    # each node's local rank 0 alone checksums the master (the others' would go unused)
    assert sorted(computed.read_text().split()) == ["0", "2"]
    err = capfd.readouterr().err
    assert err.count("error:") == 1, err
    assert "node 1's start step is 3, node 0's 0: every node must see the same" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_one_node_computes_no_start_facts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of one node: there is nothing to compare, so no rank computes the facts (a
    pass over the whole master for its checksum)."""
    from slidedp.runtime import trainer
    from slidedp.runtime.trainer import Trainer

    def computed(self: Trainer) -> dict[str, str]:
        raise AssertionError("start facts computed on one node")

    monkeypatch.setattr(trainer, "start_facts", computed)
    assert run_ranks(_nodes_config(tmp_path, 1), 2) == [0, 0]


@pytest.mark.e2e
def test_a_non_finite_gradient_on_one_node_skips_the_step_on_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 3 (node 1) alone gets an infinite layer gradient in step 2: the global norm is
    infinite on every node, every node skips the step (``on_nonfinite: skip``), and the nodes'
    states stay equal."""
    from slidedp.runtime.activations.full import FullExecutor

    backward, calls = FullExecutor.backward, [0]

    def poisoned(self: FullExecutor, run: Any, *args: Any, **kwargs: Any) -> Any:
        g_x, grads = backward(self, run, *args, **kwargs)
        if run.layer == 0 and os.environ["RANK"] == "3":
            calls[0] += 1  # this process's count: one per step
            if calls[0] == 2:
                grads = {n: torch.full_like(g, float("inf")) for n, g in grads.items()}
        return g_x, grads

    monkeypatch.setattr(FullExecutor, "backward", poisoned)
    dump = tmp_path / "dump"
    dump.mkdir()
    config = _nodes_config(tmp_path, 4)
    assert run_ranks(config, 4, ["train.on_nonfinite=skip"], nodes=2, dump=dump) == [0] * 4
    metrics = read_metrics(tmp_path / "out")
    assert [m.get("skipped", False) for m in metrics] == [False, True, False, False]
    node0, node1 = torch.load(dump / "node0.pt"), torch.load(dump / "node1.pt")
    for region in REGIONS:
        assert torch.equal(node0[region], node1[region]), region


def test_the_cross_node_groups_follow_the_policy_files_gradient_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cpu route sums host memory across nodes: gloo groups, even when only a policy file
    (not the config) chooses it; NCCL would refuse host tensors."""

    import torch

    from slidedp.config import ModelSection, OutputSection, TrainConfig, TrainSection
    from slidedp.config_runtime import RuntimeSection
    from slidedp.data.config import DataSection
    from slidedp.runtime import dist as rdist

    policy = tmp_path / "policy.yaml"
    policy.write_text("grad_route: cpu\n")
    seen: dict[str, bool] = {}

    def init(self: rdist.Dist, device: torch.device, timeout_s: float, *, host_sum: bool) -> None:
        seen["host_sum"] = host_sum

    monkeypatch.setattr(rdist.Dist, "init", init)
    ctx = rdist.Dist(rank=0, world=2, local_rank=0, local_world=1)
    train = TrainSection(max_steps=1, global_batch_size=2)
    cases = ((RuntimeSection.from_keys(policy=str(policy)), True), (RuntimeSection(), False))
    for runtime, expected in cases:
        runtime = runtime.with_keys(nodes=2, master_addr="127.0.0.1")
        cfg = TrainConfig(model=ModelSection(path="m"), data=DataSection(path="d"), train=train,
                          output=OutputSection(dir="o"), runtime=runtime)  # fmt: skip
        rdist.start(ctx, torch.device("cpu"), cfg)
        assert seen["host_sum"] is expected
