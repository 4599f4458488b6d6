"""The gradient lane's copies never round: a gradient wider than the slots it lands in is
refused before anything is copied; a narrower one widens exactly."""

from __future__ import annotations

import pytest
import torch

from slidedp.errors import InvalidArgumentError
from slidedp.runtime.grad_lane import AdamArgs, GradLane
from slidedp.runtime.lanes import LaneClock
from slidedp.store import GroupSpec, HostStore, ParamSpec
from slidedp.update import UpdateWorker

CPU = torch.device("cpu")
ADAM = AdamArgs(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                grad_scale=1.0, version=1)  # fmt: skip


def _lane(grad_dtype: str) -> tuple[HostStore, UpdateWorker, GradLane]:
    groups = [GroupSpec("layers.0", [ParamSpec("w", (4, 5)), ParamSpec("b", (3,))])]
    store = HostStore.create(groups, 0, grad_dtype=grad_dtype, grad_slots=2)  # type: ignore[arg-type]
    worker = UpdateWorker(store, 1)
    return store, worker, GradLane(store, worker, LaneClock(CPU), None, 30.0, lambda g: "layers.0")


def test_an_f32_gradient_is_not_rounded_into_bf16_slots() -> None:
    store, worker, lane = _lane("bf16")
    grads = {"w": torch.randn(4, 5, dtype=torch.bfloat16), "b": torch.randn(3)}
    with pytest.raises(InvalidArgumentError, match=r"gradient of 'b' is torch\.float32"):
        lane.send(GradLane.ticket(0, grads), ADAM, check_finite=False)
    assert not store.grad_slot(0).any()  # refused before any copy
    worker.drain(timeout_s=30)


def test_a_bf16_gradient_widens_exactly_into_f32_slots() -> None:
    store, worker, lane = _lane("f32")
    w, b = torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(3, dtype=torch.bfloat16)
    lane.send(GradLane.ticket(0, {"w": w, "b": b}), ADAM, check_finite=False)
    lane.flush()
    worker.drain(timeout_s=30)
    at = int(store.layout.params[1].state_offset)  # "b" after "w" and its padding
    assert torch.equal(store.grad_slot(0)[:20], w.float().view(-1))
    assert torch.equal(store.grad_slot(0)[at : at + 3], b.float())
