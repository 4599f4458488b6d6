"""Host AdamW, one chunk of a parameter group at a time, on a Rust thread (the update lane).

The gradient reaches the worker through the store's gradient slots (a ring): copy a chunk of
group ``g``'s gradient (its state layout, offsets relative to the group's ``state_offset``) into
slot ``k``, submit, and reuse slot ``k`` only after ``wait_completed(seq + 1)``.

Example::

    worker = UpdateWorker(store)                # store made with grad_slots >= 1
    n = store.layout["groups"][g]["state_len"]  # here the whole group fits one slot
    store.grad_slot(0)[:n].copy_(flat_grad)
    seq = worker.submit(g, 0, n, 0, step=t, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.01, publish=t)
    worker.wait_completed(seq + 1, timeout_s=60)  # slot 0 is free again
    store.wait_version(g, t, timeout_s=60)        # any process: g's update of step t is done

Weight decay applies only to parameters of two or more dimensions (HF Trainer's grouping).
While an update of group g is queued, do not write its slot nor g's state; read g's state only
after its version is published.
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
        start: int,
        length: int,
        grad_slot: int,
        *,
        step: int,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_scale: float = 1.0,
        publish: int | None = None,
    ) -> int:
        """Queues AdamW on elements ``[start, start + length)`` of ``group`` (gradient from slot
        ``grad_slot``, multiplied by ``grad_scale``), then publishes ``publish`` for the group if
        given (``length`` 0: publish only). Returns the request's sequence number at once."""
        return self._native.submit(
            group,
            start,
            length,
            grad_slot,
            step=step,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=weight_decay,
            grad_scale=grad_scale,
            publish=publish,
        )

    def wait_completed(self, count: int, timeout_s: float) -> None:
        """Waits until the first ``count`` requests are done; raises the first failure."""
        self._native.wait_completed(count, timeout_s)

    def drain(self, timeout_s: float) -> None:
        """Waits until every submitted update is done; raises the first failure."""
        self._native.drain(timeout_s)

    def raise_failure(self) -> None:
        """Raises the first update failure (``UpdateFailedError``), if one happened, at once:
        the cause of the poisoned store a waiter of this process woke with."""
        self._native.raise_failure()

    def take_spans(self) -> list[tuple[int, float, float]]:
        """``(group, start_s, end_s)`` of each update request completed since the last call,
        in ``time.monotonic()`` seconds (for traces)."""
        return self._native.take_spans()

    def stats(self) -> tuple[int, float]:
        """(requests completed, seconds the update lane was busy)."""
        return self._native.stats()
