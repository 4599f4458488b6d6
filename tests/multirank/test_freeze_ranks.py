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

from engine.tiny import final_param_delta, make_model, write_data
from multirank.ranks import assert_same_series, one_and_two_ranks

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
    one, two = one_and_two_ranks(tmp_path, model, data, train, runtime)
    assert_same_series(one, two, ("loss", "grad_norm"), LOSS_RTOL)
    p1 = load_file(one / "final" / "model.safetensors")
    p2 = load_file(two / "final" / "model.safetensors")
    start = load_file(model / "model.safetensors")
    frozen = [n for n in p1 if n == "model.embed_tokens.weight" or ".layers.0." in n
              or ".mlp.up_proj." in n]  # fmt: skip
    for name in frozen:
        assert torch.equal(p1[name], start[name]), name
        assert torch.equal(p2[name], start[name]), name
    assert final_param_delta(one, two) <= PARAM_ATOL
    trained = [n for n in p1 if n not in frozen]
    assert all(not torch.equal(p2[n], start[n]) for n in trained), "the others train"
