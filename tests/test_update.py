"""The update worker: host AdamW per group chunk from a gradient-slot ring, HF decay grouping,
versions, failures."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest
import torch

from slidedp import errors
from slidedp.runtime.routes import signal_args
from slidedp.store import GroupSpec, HostStore, ParamSpec
from slidedp.update import ChunkSum, HostSumRing, UpdateWorker

SHAPES = {"w": (16, 9), "bias": (16,), "norm": (9,), "w2": (3, 5)}
HP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _store(grad_dtype: str) -> HostStore:
    groups = [
        GroupSpec(f"layers.{g}", [ParamSpec(f"{g}.{n}", s) for n, s in SHAPES.items()])
        for g in range(2)
    ]
    return HostStore.create(
        groups,
        staging_slots=1,
        grad_dtype=grad_dtype,  # type: ignore[arg-type]
        grad_slots=2,
        chunk_elems=64,  # each group (144 + 16 + 16 + 16 state elements) takes three chunks
    )


def _submit_group(
    store: HostStore, worker: UpdateWorker, group: int, grads: dict[str, torch.Tensor], step: int
) -> None:
    """Feed one group's gradient through the two-slot ring, chunk by chunk."""
    g = store.layout.groups[group]
    flat = torch.full((g.state_len,), float("nan"))  # padding must never be read
    for p in store.layout.params[g.params.start : g.params.end]:
        at = p.state_offset - g.state_offset
        flat[at : at + p.numel] = grads[p.name].view(-1).float()
    n, start = store.layout.slot_len, 0
    while start < g.state_len:
        length = min(n, g.state_len - start)
        k = (start // n) % 2
        worker.drain(timeout_s=30)  # the ring's slot k is free (simplest backpressure)
        store.grad_slot(k)[:length].copy_(flat[start : start + length])
        last = start + length == g.state_len
        worker.submit(
            group,
            start,
            length,
            k,
            step=step,
            grad_scale=0.5,
            publish=step if last else None,
            **HP,  # type: ignore[arg-type]
        )
        start += length


@pytest.mark.parametrize("grad_dtype", ["f32", "bf16"])
def test_worker_equals_torch_adamw_with_hf_decay_groups(grad_dtype: str) -> None:
    store = _store(grad_dtype)
    gen = torch.Generator().manual_seed(0)
    names = [p.name for p in store.layout.params]
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
    grads: dict[str, torch.Tensor] = {}
    for step in range(1, 6):
        for name in names:
            g = torch.randn(store.master(name).shape, generator=gen).to(store.region("grad").dtype)
            grads[name] = g
            ref[name].grad = g.float() * 0.5
        opt.step()
        for group in range(2):
            _submit_group(store, worker, group, grads, step)
        assert store.wait_version(1, step, timeout_s=30) == step
        worker.drain(timeout_s=30)
    assert worker.stats()[0] == 5 * 2 * 3
    for name in names:
        # Same tolerance argument as tests/test_kernels_parity.py (5 steps, lr 1e-2).
        torch.testing.assert_close(store.master(name), ref[name].detach(), rtol=1e-5, atol=1e-6)


def test_failures_surface_in_drain_and_poison_the_store() -> None:
    store = _store("f32")
    worker = UpdateWorker(store, threads=1)
    with pytest.raises(errors.LayerOutOfRangeError):
        worker.submit(5, 0, 1, 0, step=1, **HP)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="does not fit"):
        worker.submit(0, 0, 65, 0, step=1, **HP)  # type: ignore[arg-type]
    worker.submit(0, 0, 8, 0, step=0, publish=1, **HP)  # type: ignore[arg-type]
    with pytest.raises(errors.UpdateFailedError, match="group 0 step 0"):
        worker.drain(timeout_s=30)
    with pytest.raises(errors.StorePoisonedError):
        store.wait_version(1, 1, timeout_s=5)
    with pytest.raises(errors.InvalidArgumentError, match="gradient slots"):
        UpdateWorker(HostStore.create([GroupSpec("g", [ParamSpec("w", (2,))])], 1))


def test_a_forked_child_can_drop_its_copy_of_a_worker() -> None:
    """A fork copies the worker but not its thread (multiprocessing 'fork', DataLoader
    workers): dropping the copy must not wait for that thread (it hung or panicked)."""
    worker = UpdateWorker(_store("f32"), threads=1)
    pid = os.fork()
    if pid == 0:  # the child: drop the copy, report by exit code (a panic or a hang: not 0)
        code = 1
        try:
            unraisable: list[object] = []  # a panic in a destructor lands here
            sys.unraisablehook = unraisable.append
            del worker
            gc.collect()
            code = 3 if unraisable else 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid, "the child hung dropping its copy of the worker"
    assert os.waitstatus_to_exitcode(done[1]) == 0
    worker.drain(timeout_s=30)  # the parent's worker is untouched


def test_the_cpu_routes_sum_runs_on_the_owners_worker_with_the_gil_released() -> None:
    """Two ranks in one process. The owner announces its chunk and submits; its worker waits
    for the peer's copy while Python threads run on (a peer waiting for its slot, GIL
    released, overlaps this thread's work); once the peer lands, the worker sums the two
    bf16 copies (landed in the signal store) into its f32 slot, counts Σ g² and runs AdamW on
    the sum (torch.optim.AdamW, one step)."""
    store = HostStore.create(
        [GroupSpec("layers.0", [ParamSpec("w", (6, 5))])], 0, grad_dtype="f32", grad_slots=2
    )
    signals = HostStore.create(**signal_args(2, 1, "bf16", store.layout.slot_len))
    owner, peer = (
        UpdateWorker(store, 1, HostSumRing(signals, rank, 2, 1, timeout_s=30)) for rank in (0, 1)
    )
    gen = torch.Generator().manual_seed(0)
    g0, g1 = (torch.randn(30, generator=gen).bfloat16() for _ in range(2))
    signals.grad_slot(0)[:30].copy_(g0)
    signals.grad_slot(1)[:30].copy_(g1)
    owner.landed(0)
    both = ChunkSum(gather_seq=0, norm=True, apply=True)
    seq = owner.submit(0, 0, 30, 0, step=1, publish=1, host_sum=both, **HP)  # type: ignore[arg-type]
    with pytest.raises(errors.UpdateTimeoutError):
        owner.wait_completed(seq + 1, timeout_s=0.2)  # waiting for the peer, on the worker

    spans: dict[str, tuple[float, float]] = {}

    def peer_waits_for_its_slot() -> None:
        start = time.monotonic()
        peer.wait_consumed(0, 0)
        spans["wait"] = (start, time.monotonic())

    waiter = threading.Thread(target=peer_waits_for_its_slot)
    waiter.start()
    busy_start = time.monotonic()
    while time.monotonic() - busy_start < 0.3:  # Python work while the peer's thread waits
        sum(range(1000))
    spans["busy"] = (busy_start, time.monotonic())
    peer.landed(0)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    (w0, w1), (b0, b1) = spans["wait"], spans["busy"]
    assert w0 < b1, "the wait released the GIL: the two threads overlapped"
    assert b0 < w1
    owner.wait_completed(seq + 1, timeout_s=30)
    summed = g0.float() + g1.float()
    assert torch.equal(store.grad_slot(0)[:30], summed)  # the f32 sum of the widened copies
    # f32 squares are exact in f64; only the order of the f64 additions differs from torch's
    want = float(summed.double().square().sum())
    assert owner.take_sum_squares(timeout_s=30) == pytest.approx(want, rel=1e-12)
    assert owner.take_sum_squares(timeout_s=30) == 0.0  # taken: the total starts again
    w = torch.nn.Parameter(torch.zeros(6, 5))
    w.grad = summed.view(6, 5)
    torch.optim.AdamW([w], **HP).step()  # type: ignore[arg-type]
    # one AdamW step from zero: the kernel's float32 against torch's (tests/test_kernels_parity.py)
    torch.testing.assert_close(store.master("w"), w.detach(), rtol=1e-5, atol=1e-6)
    assert store.version(0) == 1
