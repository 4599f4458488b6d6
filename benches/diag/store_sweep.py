"""The engine's own host update, driven as a clipped step's forward drives it (diagnostic):
``--layers`` groups of ``--numel`` elements (Qwen3-4B: 36 x ~101M) in a real ``HostStore``
(shared memory, BF16 gradient slots of a layer each, the BF16 mirror), the slots and the mirror
page-locked as the engine pins them (on CUDA), AdamW on the real ``UpdateWorker`` (its own
pool of ``--threads``). ``benches/diag/adamw_sweep.py`` runs the kernel alone on anonymous and
torch-pinned memory; this runs what a step runs on what a step runs it on.

Each sweep goes through the layers in forward order as the engine's ``send_ready`` does: the
gradients of the next ``slots`` layers copied into their slots (the slot's previous update
waited for), each layer's update submitted once its copy is done, then the "training thread"
waits for the layer's version. Modes (per-layer ms of the worker's spans, median):

- ``host``: no GPU work at all (the gradient written into its slot by the CPU);
- ``gpu-idle``: as the clipped forward: each gradient a D2H copy from the device, each layer's
  mirror copied to the device once its version is out, the GPU otherwise idle;
- ``gpu-busy``: the same with the compute stream kept busy (``torch.cuda._sleep``) beside it,
  as during the backward of a step without clipping.

    python benches/diag/store_sweep.py --layers 36 --numel 101000000 --threads 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slidedp.kernels import default_threads
from slidedp.runtime.transfer import pin, unpin
from slidedp.store import GroupSpec, HostStore, ParamSpec
from slidedp.update import UpdateWorker

HIDDEN = 2560


def sweep(store: HostStore, worker: UpdateWorker, mode: str, step: int, sent: list[int]) -> float:
    """One forward-order sweep in ``mode``; returns the median per-layer update span, ms.
    ``sent``: the worker's request count so far (one per layer, updated)."""
    layers, slots = store.num_groups, store.layout.grad_slots
    cuda = mode != "host"
    grad = torch.randn(store.layout.slot_len, device="cuda" if cuda else "cpu").to(torch.bfloat16)
    grad.mul_(1e-4)
    copy = torch.cuda.Stream() if cuda else None
    device_layer = (
        torch.empty(store.layout.slot_len, dtype=torch.bfloat16, device="cuda") if cuda else None
    )
    worker.take_spans()

    def submit(group: int, done: torch.cuda.Event | None) -> None:
        """The group's update (clipped: a gradient scale of 0.5) once its copy is done."""
        if done is not None:
            done.synchronize()
        n = store.group_state(group, "master").numel()
        worker.submit(group, 0, n, group % slots, step=step, lr=1e-5, betas=(0.9, 0.999),
                      eps=1e-8, weight_decay=0.01, grad_scale=0.5, publish=step)  # fmt: skip

    queued: list[tuple[int, torch.cuda.Event | None]] = []
    next_send = 0
    for layer in range(layers):
        while next_send < layers and next_send <= layer + slots - 1:
            slot = next_send % slots
            if next_send >= slots:  # the slot's previous update must be done before it is reused
                worker.wait_completed(sent[0] + next_send - slots + 1, 600.0)
            n = store.group_state(next_send, "master").numel()
            dst = store.grad_slot(slot)[:n]
            if copy is None:
                dst.copy_(grad[:n])
                queued.append((next_send, None))
            else:
                with torch.cuda.stream(copy):
                    dst.copy_(grad[:n], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(copy)
                queued.append((next_send, done))
            next_send += 1
        while queued and queued[0][0] <= layer:  # submit what has landed
            submit(*queued.pop(0))
        store.wait_version(layer, step, 600.0)
        if device_layer is not None:
            n = store.group_state(layer, "master").numel()
            device_layer[:n].copy_(store.mirror_group(layer)[:n], non_blocking=True)
            if mode == "gpu-busy":
                torch.cuda._sleep(50_000_000)  # ~25 ms of a busy compute stream
    for group, done in queued:
        submit(group, done)
    worker.drain(600.0)
    sent[0] += layers
    if cuda:
        torch.cuda.synchronize()
    spans = worker.take_spans()
    return statistics.median((end - start) * 1e3 for _, start, end in spans)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--numel", type=int, default=101_000_000)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--sweeps", type=int, default=2)
    args = parser.parse_args()
    rows = max(args.numel // HIDDEN, 1)
    groups = [GroupSpec(f"layers.{i}", [ParamSpec(f"layers.{i}.w", (rows, HIDDEN))])
              for i in range(args.layers)]  # fmt: skip
    t0 = time.perf_counter()
    store = HostStore.create(groups, staging_slots=0, grad_dtype="bf16", grad_slots=4,
                             bf16_mirror=True)  # fmt: skip
    cuda = torch.cuda.is_available()
    pinned = [store.region("mirror"), store.region("grad")] if cuda else []
    for view in pinned:
        pin(view, "diagnostic")
    threads = args.threads or default_threads()
    worker = UpdateWorker(store, threads)
    print(
        f"store {store.total_bytes / 1e9:.1f} GB in {time.perf_counter() - t0:.1f} s; "
        f"{threads} update threads; pinned: {bool(pinned)}",
        flush=True,
    )
    modes = ["host", "gpu-idle", "gpu-busy"] if cuda else ["host"]
    sent, step = [0], 0
    step += 1
    sweep(store, worker, "host", step, sent)  # first touch of the moments
    for _ in range(args.sweeps):
        for mode in modes:
            step += 1
            ms = sweep(store, worker, mode, step, sent)
            print(f"{mode:>9}: {ms:6.1f} ms a layer", flush=True)
    for view in pinned:
        unpin(view)


if __name__ == "__main__":
    main()
