"""``train.freeze`` on 2 CPU ranks x B/2 against 1 rank x B, on both gradient routes.

Tolerances: tests/multirank/test_parity.py's (the same math, each gradient summed from two
halves of the batch), 1e-5 relative on losses and norms, 1e-5 absolute on parameters. Every
rank skips the same frozen groups (no reduce, no host sum for them): a rank that sent one
would hang its peers' collectives or shift the host sum's chunk numbers, which this catches.
The frozen parameters leave both runs bit for bit as they came in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import run_ranks
from slidedp.cli import main

pytestmark = pytest.mark.e2e  # every test here trains end to end

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


@pytest.mark.parametrize(("grad_route", "param_route"), [("gpu", "sharded"), ("cpu", "replicated")])
def test_two_frozen_ranks_match_one(tmp_path: Path, grad_route: str, param_route: str) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": 5, "global_batch_size": 4, "learning_rate": 3e-3, "max_grad_norm": 1.0,
             "freeze": ["embed_tokens", "layers.0", "*.mlp.up_proj.*"]}  # fmt: skip
    runtime = {"grad_route": grad_route, "param_route": param_route, "chunk_elems": 1000}
    output = {"tensorboard": False}
    one, two = tmp_path / "one", tmp_path / "two"
    c1 = write_config(tmp_path / "1.yaml", model, data, one, train=train, runtime=runtime,
                      output=output)  # fmt: skip
    c2 = write_config(tmp_path / "2.yaml", model, data, two, train=train,
                      runtime=runtime | {"ranks": 2}, output=output)  # fmt: skip
    assert main(["train", str(c1)]) == 0
    assert run_ranks(c2, 2) == [0, 0]

    m1, m2 = read_metrics(one), read_metrics(two)
    for key in ("loss", "grad_norm"):
        got = torch.tensor([m[key] for m in m2], dtype=torch.float64)
        want = torch.tensor([m[key] for m in m1], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0)
    p1 = load_file(one / "final" / "model.safetensors")
    p2 = load_file(two / "final" / "model.safetensors")
    start = load_file(model / "model.safetensors")
    frozen = [n for n in p1 if n == "model.embed_tokens.weight" or ".layers.0." in n
              or ".mlp.up_proj." in n]  # fmt: skip
    for name in frozen:
        assert torch.equal(p1[name], start[name]), name
        assert torch.equal(p2[name], start[name]), name
    worst = max((p1[n] - p2[n]).abs().max().item() for n in p1)
    assert worst <= PARAM_ATOL
    trained = [n for n in p1 if n not in frozen]
    assert all(not torch.equal(p2[n], start[n]) for n in trained), "the others train"
