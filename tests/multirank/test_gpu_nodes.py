"""Two simulated nodes of one GPU each against one node of two GPUs, on one 2-GPU host (issue 21):
every node a real ``slidedp train`` launch (``slidedp.bench.node_runs``, as ``slidedp bench nodes
--device cuda`` starts them) with its own host store and its own GPU (``CUDA_VISIBLE_DEVICES``);
the owners' cross-node all-reduce is NCCL, on the transport NCCL picks on one host (NVLink) or
on its socket transport (``NCCL_NET_ENV``), as between machines.

Run on a 2-GPU machine (NVLink multicast off, as always there)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        pytest -m multi_gpu tests/multirank/test_gpu_nodes.py -s

Checked: max |Δloss| over 100 bf16 steps <= 1e-3, the engine's bf16 bound of
tests/multirank/test_gpu_ranks.py (the FSDP2 comparison's measure): both runs compute in bf16
with GPU kernels that do not repeat bit for bit, and sum the two halves of the batch in another
place (on the node vs across nodes); the two nodes' host states (FP32 master and both Adam
moments) equal bit for bit, as on CPU (tests/multirank/test_nodes.py): every node applies the
same AdamW to the same all-reduced gradient; both runs wrote their last checkpoint.

The two nodes' launches run on CPU in CI (gloo, f32, a few steps: ``test_real_node_launches_...``),
so the machinery meets the GPU machine tested, against one node of two forked ranks; there the
bounds are test_nodes.py's (losses 1e-5 relative, parameters 1e-5 absolute) and the two runs'
final parameters are compared too.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.node_dump import DUMP, MODULE
from multirank.ranks import REGIONS, latest_step, run_ranks
from slidedp.bench.node_runs import (
    Device,
    NodeShape,
    nccl_transports,
    node_launches,
    run_nodes,
    visible_gpus,
)
from slidedp.runtime.launch import free_port

pytestmark = pytest.mark.e2e  # every test here trains end to end

GPU_STEPS = 100
TIMEOUT_S = 300  # one run of 100 small steps; a hang fails the test instead of blocking it
TESTS = Path(__file__).resolve().parents[1]  # on PYTHONPATH of the nodes (multirank.node_dump)


@dataclass
class Run:
    out: Path
    losses: torch.Tensor  # [steps], float64
    states: list[dict[str, torch.Tensor]]  # each node's REGIONS at the end
    transports: list[str]  # NCCL's, from its log (CUDA)


def _run(
    tmp_path: Path, config: Path, name: str, nodes: int, ranks: int, device: Device, nccl_net: bool
) -> Run:
    out, dump = tmp_path / name, tmp_path / f"{name}.dump"
    dump.mkdir()
    nccl_log = tmp_path / f"{name}.nccl" if device == "cuda" else None
    launches = node_launches(
        config,
        out,
        NodeShape(nodes, ranks, device, visible_gpus() if device == "cuda" else ()),
        port=free_port(),
        cores=os.cpu_count() or 1,
        nccl_net=nccl_net,
        nccl_log=nccl_log,
        module=MODULE,
    )
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    extra = {"PYTHONPATH": path, DUMP: str(dump)}
    run_nodes([dataclasses.replace(x, env=x.env | extra) for x in launches], TIMEOUT_S)
    losses = torch.tensor([m["loss"] for m in read_metrics(out)], dtype=torch.float64)
    states = [torch.load(dump / f"node{n}.pt") for n in range(nodes)]
    transports = [] if nccl_log is None else nccl_transports(nccl_log)
    return Run(out, losses, states, transports)


def _forked_one_node(tmp_path: Path, config: Path) -> Run:
    """1 node x 2 CPU ranks as ``run_ranks`` forks them, with the same dump as ``_run``."""
    out, dump = tmp_path / "one", tmp_path / "one.dump"
    dump.mkdir()
    assert run_ranks(config, 2, [f"output.dir={out}"], dump=dump) == [0, 0]
    losses = torch.tensor([m["loss"] for m in read_metrics(out)], dtype=torch.float64)
    return Run(out, losses, [torch.load(dump / "node0.pt")], [])


def _one_node_and_two(
    tmp_path: Path, device: Device, steps: int, nccl_net: bool = False
) -> tuple[Run, Run]:
    """The same seeded model, data and global batch as 1 node x 2 and as 2 nodes x 1."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=4)
    data = write_data(tmp_path / "data.jsonl", steps * 8, min_len=32, max_len=64)
    train = {"max_steps": steps, "global_batch_size": 8, "learning_rate": 1e-4,
             "max_grad_norm": 1.0}  # fmt: skip
    # the layer compute is not under test: transformers' modules uncompiled (no compile per rank)
    runtime = {"kernels": "eager", "compile": False, "version_timeout_s": 120}
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "unused", train=train,
                          runtime=runtime, output={"tensorboard": False})  # fmt: skip
    # On CPU the one node's ranks are forked: three fewer processes that import torch (a launched
    # node of two CPU ranks is tests/bench/test_nodes.py's measurement).
    if device == "cuda":
        one = _run(tmp_path, config, "one", 1, 2, device, nccl_net=False)
    else:
        one = _forked_one_node(tmp_path, config)
    two = _run(tmp_path, config, "two", 2, 1, device, nccl_net=nccl_net)
    for run in (one, two):
        assert latest_step(run.out) == steps  # rank 0 wrote the last checkpoint
        assert len(run.losses) == steps
    node0, node1 = two.states
    for region in REGIONS:  # replicated host state: both nodes applied the same updates
        assert torch.equal(node0[region], node1[region]), region
    assert not torch.equal(node0["exp_avg"], torch.zeros_like(node0["exp_avg"]))
    return one, two


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("nccl_net", [False, True], ids=["nccl-own-choice", "nccl-net"])
def test_two_nodes_of_one_gpu_track_one_node_of_two(tmp_path: Path, nccl_net: bool) -> None:
    one, two = _one_node_and_two(tmp_path, "cuda", GPU_STEPS, nccl_net)
    delta = (one.losses - two.losses).abs().max().item()
    master = max((one.states[0][r] - two.states[0][r]).abs().max().item() for r in REGIONS)
    print(
        f"2 nodes x 1 GPU (NCCL {'+'.join(two.transports)}) vs 1 node x 2 GPUs (NCCL "
        f"{'+'.join(one.transports)}): max |dloss| {delta:.2e} over {GPU_STEPS} steps, "
        f"max |d state| {master:.2e}"
    )
    if nccl_net:  # the nodes' NCCL connected over its network transport only
        assert two.transports, "NCCL logged no connection"
        assert all(t.startswith("NET/") for t in two.transports), two.transports
    assert delta <= 1e-3


def test_real_node_launches_on_cpu_track_one_node(tmp_path: Path) -> None:
    """The GPU test's launches, dumps and checks on CPU (gloo, f32): 2 nodes x 1 rank against
    1 node x 2 ranks within test_nodes.py's bounds."""
    steps = 3
    one, two = _one_node_and_two(tmp_path, "cpu", steps)
    torch.testing.assert_close(two.losses, one.losses, rtol=1e-5, atol=0)
    for region in REGIONS:
        assert (one.states[0][region] - two.states[0][region]).abs().max().item() <= 1e-5
    pa = load_file(one.out / f"checkpoint-{steps}" / "model.safetensors")
    pb = load_file(two.out / f"checkpoint-{steps}" / "model.safetensors")
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) <= 1e-5
