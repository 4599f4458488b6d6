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

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import final_param_delta, make_model, read_metrics, write_config, write_data
from multirank.ranks import assert_same_series, one_and_two_ranks, run_ranks
from slidedp.cli import main
from slidedp.kernels import Kernels
from slidedp.models.hf import HFAdapter
from slidedp.runtime.engine import Engine
from slidedp.runtime.grad_lane import AdamArgs, GradLane, GradTicket
from slidedp.store import HostStore

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


def test_two_bf16_ranks_on_the_cpu_route_update_with_the_f32_sum_of_their_bf16_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank copies its BF16 gradient as it is (landing slots); the owner sums the two
    copies in f32 and runs AdamW on the sum. Reference, bit for bit: every gradient each rank
    sent (recorded as it left), widened and added in f32 (the owner's first), then the host
    AdamW kernel (whose parity with torch.optim.AdamW is tests/test_kernels_parity.py's) from
    the initial master weights. A bf16 sum, or a lost copy, moves the weights by far more."""
    model = make_model(tmp_path, "qwen3", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 24)
    sent, dump = tmp_path / "sent", tmp_path / "dump"
    sent.mkdir()
    dump.mkdir()
    send, step = GradLane.send, Engine.step

    def recording(self: GradLane, ticket: GradTicket, adam: AdamArgs, **kw: Any) -> None:
        grads = {n: g.clone() for n, g in ticket.grads.items()}
        name = f"{os.environ['RANK']}-{adam.version}-{ticket.group}.pt"
        torch.save({"grads": grads, "adam": asdict(adam)}, sent / name)
        send(self, ticket, adam, **kw)

    def first_step(self: Engine, t: int, *args: Any, **kwargs: Any) -> Any:
        start = dump / "start.pt"
        if os.environ["RANK"] == "0" and not start.exists():
            torch.save(self.store.region("master").clone(), start)
        return step(self, t, *args, **kwargs)

    monkeypatch.setattr(GradLane, "send", recording)  # the forked ranks inherit both
    monkeypatch.setattr(Engine, "step", first_step)
    train = {"max_steps": 3, "global_batch_size": 4, "max_grad_norm": 0.0, "dtype": "bfloat16",
             "learning_rate": 3e-3}  # fmt: skip
    runtime = {"ranks": 2, "grad_route": "cpu", "chunk_elems": 1000}
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out", train=train,
                          runtime=runtime, output={"tensorboard": False})  # fmt: skip
    assert run_ranks(config, 2, dump=dump) == [0, 0]
    want = _reference_updates(torch.load(dump / "start.pt"), sent, model)
    got = torch.load(dump / "node0.pt")["master"]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(want, torch.load(dump / "start.pt"))  # the weights moved


def _reference_updates(master: torch.Tensor, sent: Path, model: Path) -> torch.Tensor:
    """``master`` after AdamW on every recorded step's f32 sum of the two ranks' gradients of
    each group (owner: group % 2, its copy first), parameter by parameter."""
    adapter = HFAdapter.from_dir(model)
    layout = HostStore.plan(adapter.group_specs(), 0)
    offsets = {p.name: (int(p.state_offset), int(p.numel)) for p in layout.params}
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    kernels = Kernels(1, isa="scalar")
    for path in sorted(sent.glob("0-*.pt"), key=lambda p: [int(x) for x in p.stem.split("-")]):
        _, version, group = path.stem.split("-")
        mine, theirs = torch.load(path), torch.load(sent / f"1-{version}-{group}.pt")
        own, other = (mine, theirs) if int(group) % 2 == 0 else (theirs, mine)
        adam = AdamArgs(**own["adam"])
        for name, g in own["grads"].items():
            summed = g.float().reshape(-1) + other["grads"][name].float().reshape(-1)
            at, n = offsets[name]
            m, v = moments.setdefault(name, (torch.zeros(n), torch.zeros(n)))
            decay = adam.weight_decay if g.dim() >= 2 else 0.0
            kernels.adamw(master[at : at + n], m, v, summed, step=adam.step, lr=adam.lr,
                          betas=adam.betas, eps=adam.eps, weight_decay=decay)  # fmt: skip
    return master
