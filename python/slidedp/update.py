"""Host AdamW, one parameter group at a time, on a Rust thread (the update lane).

Example::

    worker = UpdateWorker(store)                       # store made with grad_dtype="bf16"|"f32"
    store.group_state(g, "grad").copy_(flat_grad)      # the group's gradient, state layout
    worker.submit(g, step=t, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, version=t)
    store.wait_version(g, t, timeout_s=60)             # any process: g's update of step t is done
    worker.drain(timeout_s=60)                         # all submitted updates done, or the error

Weight decay applies only to parameters of two or more dimensions (HF Trainer's grouping).
While an update of group g is queued, do not write g's gradient; read g's state only after its
version is published.
"""

from __future__ import annotations

from slidedp import _native
from slidedp.kernels import default_threads
from slidedp.store import HostStore


class UpdateWorker:
    def __init__(self, store: HostStore, threads: int | None = None) -> None:
        self._native = _native.UpdateWorker(
            store._native, default_threads() if threads is None else threads
        )

    def submit(
        self,
        group: int,
        *,
        step: int,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        version: int,
        grad_scale: float = 1.0,
    ) -> None:
        """Queues AdamW on ``group`` (gradient multiplied by ``grad_scale``), then publishes
        ``version`` for it. Returns at once."""
        self._native.submit(
            group,
            step=step,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=weight_decay,
            grad_scale=grad_scale,
            version=version,
        )

    def drain(self, timeout_s: float) -> None:
        """Waits until every submitted update is done; raises the first failure."""
        self._native.drain(timeout_s)

    def stats(self) -> tuple[int, float]:
        """(updates completed, seconds the update lane was busy)."""
        return self._native.stats()
