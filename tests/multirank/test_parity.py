"""2 ranks x B/2 against 1 rank x B (CPU, gloo, float32), every gradient and parameter route.

Tolerance: both runs do the same math; the 2-rank run sums each gradient from two halves of
the batch (a different summation order) and takes the global norm as sqrt(Σ g²) over owners,
so the difference is f32 rounding amplified by AdamW's m/sqrt(v) as in tests/engine/
test_parity.py (measured there: <= 1.9e-6 absolute on parameters at lr 3e-3). We keep its
bounds, 1e-5 relative on losses and 1e-5 absolute on parameters; a real error (a rank's rows
counted twice, a missed reduce, a double update, a wrong denominator) moves the losses by
>= 1e-3 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import final_param_delta, make_model, read_metrics, write_config, write_data
from multirank.ranks import assert_same_series, one_and_two_ranks, run_ranks
from slidedp.cli import main

pytestmark = pytest.mark.e2e  # every test here trains end to end

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

# (grad_route, param_route, max_grad_norm): every route with clipping (binding in some steps),
# and each gradient route without (the updates overlap the backward).
CASES = [
    ("gpu", "replicated", 2.4),
    ("gpu", "sharded", 2.4),
    ("cpu", "replicated", 2.4),
    ("cpu", "sharded", 2.4),
    ("gpu", "replicated", 0.0),
    ("cpu", "sharded", 0.0),
]


@pytest.mark.parametrize(("grad_route", "param_route", "max_grad_norm"), CASES)
def test_two_ranks_match_one(
    tmp_path: Path, grad_route: str, param_route: str, max_grad_norm: float
) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {
        "max_steps": 6,
        "global_batch_size": 4,
        "learning_rate": 3e-3,
        "max_grad_norm": max_grad_norm,
        "warmup_steps": 2,
    }
    runtime = {"grad_route": grad_route, "param_route": param_route, "chunk_elems": 1000}
    one, two = one_and_two_ranks(tmp_path, model, data, train, runtime)
    assert_same_series(one, two, ("loss", "grad_norm"), LOSS_RTOL)
    m2 = read_metrics(two)
    if max_grad_norm > 0:
        clipped = [m["clip_coef"] < 1.0 for m in m2]
        assert any(clipped), "clipping must bind in some steps"
        assert not all(clipped), "and leave others unclipped"
    assert final_param_delta(one, two) <= PARAM_ATOL
    p1 = load_file(one / "final" / "model.safetensors")
    moved = max((p1[n] - load_file(next(model.glob("*.safetensors")))[n]).abs().max().item()
                for n in p1)  # fmt: skip
    assert moved > 100 * PARAM_ATOL, "training must move the parameters for this to mean much"


def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path: Path) -> None:
    """Changing the number of ranks at a resume continues the same run: steps after the
    checkpoint match the uninterrupted 1-rank run within the 1-vs-2-rank tolerance above (bit
    equality is impossible across rank counts: the gradient sums in another order)."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": 6, "global_batch_size": 4, "learning_rate": 3e-3, "max_grad_norm": 2.4}
    output = {"tensorboard": False, "save_steps": 3}
    one, two = tmp_path / "one", tmp_path / "two"
    c1 = write_config(tmp_path / "1.yaml", model, data, one, train=train, output=output)
    assert main(["train", str(c1)]) == 0
    resume = train | {"resume": str(one / "checkpoint-3")}
    c2 = write_config(tmp_path / "2.yaml", model, data, two, train=resume,
                      runtime={"ranks": 2}, output=output)  # fmt: skip
    assert run_ranks(c2, 2) == [0, 0]
    m1, m2 = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in m2][-3:] == [4, 5, 6]
    loss1 = torch.tensor([m["loss"] for m in m1[3:]], dtype=torch.float64)
    loss2 = torch.tensor([m["loss"] for m in m2[-3:]], dtype=torch.float64)
    torch.testing.assert_close(loss2, loss1, rtol=LOSS_RTOL, atol=0)
    assert final_param_delta(one, two) <= PARAM_ATOL


@pytest.mark.parametrize("param_route", ["replicated", "sharded"])
def test_two_bf16_ranks_with_the_mirror_train_like_casting_on_delivery(
    tmp_path: Path, param_route: str
) -> None:
    """Several ranks read the one BF16 mirror that the owners' updates write (nothing is cast on
    either route): bit for bit the run that casts each chunk on delivery. Forked ranks: what is
    under test is the ranks' reads, not their launch (tests/multirank/test_stop.py starts it)."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 24)
    train = {"max_steps": 4, "global_batch_size": 4, "max_grad_norm": 2.4, "dtype": "bfloat16"}
    losses = []
    for mirror in (False, True):
        out = tmp_path / f"m{mirror}"
        runtime = {"ranks": 2, "param_route": param_route, "bf16_mirror": mirror}
        config = write_config(tmp_path / f"{mirror}.yaml", model, data, out, train=train,
                              runtime=runtime, output={"tensorboard": False})  # fmt: skip
        assert run_ranks(config, 2) == [0, 0]
        losses.append([(m["loss"], m["grad_norm"]) for m in read_metrics(out)])
    assert losses[0] == losses[1]
    assert len(losses[0]) == 4
