"""The update worker: host AdamW per group, HF decay grouping, versions, failures."""

from __future__ import annotations

import pytest
import torch

from slidedp import errors
from slidedp.store import GroupSpec, HostStore, ParamSpec
from slidedp.update import UpdateWorker

SHAPES = {"w": (16, 9), "bias": (16,), "norm": (9,), "w2": (3, 5)}
HP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _store(grad_dtype: str) -> HostStore:
    groups = [
        GroupSpec(f"layers.{g}", [ParamSpec(f"{g}.{n}", s) for n, s in SHAPES.items()])
        for g in range(2)
    ]
    return HostStore.create(groups, staging_slots=1, grad_dtype=grad_dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("grad_dtype", ["f32", "bf16"])
def test_worker_equals_torch_adamw_with_hf_decay_groups(grad_dtype: str) -> None:
    store = _store(grad_dtype)
    gen = torch.Generator().manual_seed(0)
    names = [p["name"] for p in store.layout["params"]]
    for name in names:
        store.master(name).copy_(torch.randn(store.master(name).shape, generator=gen))
    ref = {n: torch.nn.Parameter(store.master(n).clone()) for n in names}
    decay = [p for n, p in ref.items() if p.dim() >= 2]
    no_decay = [p for n, p in ref.items() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        foreach=False,
    )
    worker = UpdateWorker(store, threads=2)
    for step in range(1, 6):
        for name in names:
            g = torch.randn(store.master(name).shape, generator=gen).to(store.region("grad").dtype)
            store.param(name, "grad").copy_(g)
            ref[name].grad = g.float() * 0.5
        opt.step()
        for group in range(2):
            worker.submit(group, step=step, grad_scale=0.5, version=step, **HP)  # type: ignore[arg-type]
        assert store.wait_version(1, step, timeout_s=30) == step
        worker.drain(timeout_s=30)
    assert worker.stats()[0] == 10
    for name in names:
        # Same tolerance argument as tests/test_kernels_parity.py (5 steps, lr 1e-2).
        torch.testing.assert_close(store.master(name), ref[name].detach(), rtol=1e-5, atol=1e-6)


def test_failures_surface_in_drain_and_poison_the_store() -> None:
    store = _store("f32")
    worker = UpdateWorker(store, threads=1)
    with pytest.raises(errors.LayerOutOfRangeError):
        worker.submit(5, step=1, version=1, **HP)  # type: ignore[arg-type]
    worker.submit(0, step=0, version=1, **HP)  # type: ignore[arg-type]
    with pytest.raises(errors.UpdateFailedError, match="group 0 step 0"):
        worker.drain(timeout_s=30)
    with pytest.raises(errors.StorePoisonedError):
        store.wait_version(1, 1, timeout_s=5)
    with pytest.raises(errors.InvalidArgumentError, match="gradient region"):
        UpdateWorker(HostStore.create([GroupSpec("g", [ParamSpec("w", (2,))])], 1))
