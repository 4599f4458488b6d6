"""A mixture of experts with its load-balancing loss on several ranks and nodes (CPU, gloo,
float32): 2 ranks x B/2 (and 2 simulated nodes x 1 rank) against 1 rank x B.

Each rank sums its routed counts, router probabilities and rows; one all-reduce gives the
global batch's, from which every rank takes the same aux_loss and the gradient of its own
router logits (``models.router_loss``). The one-rank run calls transformers' function on the
whole batch (tests/engine/test_parity.py pins it against transformers' model).

Tolerance: tests/multirank/test_parity.py's (1e-5 relative on losses, aux_loss and norms, 1e-5
absolute on parameters), for its reason: the runs do the same math and differ in the order of
f32 sums (the gradients' halves, the probability sums' halves), amplified by AdamW's
m/sqrt(v). Measured over 8 steps: aux_loss <= 1.2e-7 relative, losses <= 2e-7, parameters
<= 2.1e-7. Errors, measured: each rank's statistics alone (no all-reduce) move the losses by
>= 3.9e-4 relative; the right aux_loss with each rank's gradient taken over its own rows
(twice the term) by >= 1.9e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.tiny import final_param_delta, make_model, read_metrics, write_config, write_data
from multirank.ranks import REGIONS, run_ranks
from slidedp.cli import main

pytestmark = pytest.mark.e2e  # every test here trains end to end

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
OUTPUT = {"tensorboard": False}


def _series(out: Path, key: str) -> torch.Tensor:
    return torch.tensor([m[key] for m in read_metrics(out)], dtype=torch.float64)


def _assert_same_run(one: Path, other: Path) -> None:
    """``other``'s losses, aux_loss, norms and final parameters match ``one``'s, and clipping
    bound in some of its steps."""
    for key in ("loss", "aux_loss", "grad_norm"):
        torch.testing.assert_close(_series(other, key), _series(one, key), rtol=LOSS_RTOL, atol=0)
    clipped = [m["clip_coef"] < 1.0 for m in read_metrics(other)]
    assert any(clipped), "clipping must bind in some steps"
    assert not all(clipped), "and leave others unclipped"
    worst = final_param_delta(one, other)
    rel = {
        key: ((_series(other, key) - _series(one, key)).abs() / _series(one, key)).max().item()
        for key in ("loss", "aux_loss")
    }
    print(f"max rel |d| {rel}, max |dparam| {worst:.1e}, norms {_series(other, 'grad_norm')}")
    assert worst <= PARAM_ATOL


# (architecture, grad_route, param_route, packed rows, max_grad_norm): the padding mask weights
# the statistics, or (packed) every row counts, as transformers' function does without a mask;
# each max_grad_norm binds in some of the steps (measured norms 1.9 .. 3.2 and 1.5 .. 2.4)
CASES = [
    ("qwen3_moe", "gpu", "replicated", False, 2.4),
    ("mixtral", "cpu", "sharded", True, 1.6),
]


@pytest.mark.parametrize(("arch", "grad_route", "param_route", "packed", "max_grad_norm"), CASES)
def test_two_ranks_match_one_with_the_load_balancing_loss(
    tmp_path: Path, arch: str, grad_route: str, param_route: str, packed: bool,
    max_grad_norm: float,
) -> None:  # fmt: skip
    model = make_model(tmp_path, arch, tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 40)
    train = _train(max_grad_norm=max_grad_norm)
    runtime = {"grad_route": grad_route, "param_route": param_route, "chunk_elems": 4000}
    sections: dict[str, Any] = {"train": train, "output": OUTPUT, "data": {"packing": packed}}
    one, two = tmp_path / "one", tmp_path / "two"
    c1 = write_config(tmp_path / "1.yaml", model, data, one, runtime=runtime, **sections)
    c2 = write_config(tmp_path / "2.yaml", model, data, two, runtime=runtime | {"ranks": 2},
                      **sections)  # fmt: skip
    assert main(["train", str(c1)]) == 0
    assert run_ranks(c2, 2) == [0, 0]
    _assert_same_run(one, two)
    assert len(read_metrics(two)) == train["max_steps"]


def test_two_nodes_of_one_rank_match_one_rank_with_the_load_balancing_loss(
    tmp_path: Path,
) -> None:
    """The statistics are summed over every rank of every node; the nodes' states stay equal."""
    model = make_model(tmp_path, "qwen3_moe", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 40)
    sections: dict[str, Any] = {"train": _train(max_grad_norm=2.4), "output": OUTPUT}
    one, nodes = tmp_path / "one", tmp_path / "nodes"
    runtime = {"version_timeout_s": 60}
    c1 = write_config(tmp_path / "1.yaml", model, data, one, runtime=runtime, **sections)
    c2 = write_config(tmp_path / "2.yaml", model, data, nodes, runtime=runtime, **sections)
    assert main(["train", str(c1)]) == 0
    dump = tmp_path / "dump"
    dump.mkdir()
    assert run_ranks(c2, 2, nodes=2, dump=dump) == [0, 0]
    _assert_same_run(one, nodes)
    node0, node1 = torch.load(dump / "node0.pt"), torch.load(dump / "node1.pt")
    for region in REGIONS:
        assert torch.equal(node0[region], node1[region]), region


def _train(*, max_grad_norm: float) -> dict[str, Any]:
    return {
        "max_steps": 8,
        "global_batch_size": 4,
        "learning_rate": 3e-3,
        "max_grad_norm": max_grad_norm,
        "warmup_steps": 2,
    }
