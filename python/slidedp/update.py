"""Host AdamW, one chunk of a parameter group at a time, on a Rust thread (the update lane).

Copy a chunk of group ``g``'s gradient (its state layout) into gradient slot ``k``, submit, and
reuse slot ``k`` only after ``wait_completed(seq + 1)``. Invariants: weight decay only on
parameters of two or more dimensions; while an update of ``g`` is queued neither its slot nor its
state is written, and its state is read only after its version is published. The cpu route
(``HostSumRing``): the owner's worker first sums the ranks' copies of a chunk (landed in the
signal store) into its gradient slot.

Example::

    worker = UpdateWorker(store)                # store made with grad_slots >= 1
    store.grad_slot(0)[:n].copy_(flat_grad)     # n: the group's state_len
    seq = worker.submit(g, 0, n, 0, step=t, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.01, publish=t)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slidedp import _native
from slidedp.kernels import AdamWStep, Kernels, default_threads
from slidedp.store import HostStore

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclass(frozen=True)
class HostSumRing:
    """Rank ``rank`` of ``ranks`` in the cpu route's ring: ``slots_per_rank`` slots each (rank
    ``r``'s are ``[r * slots_per_rank, (r + 1) * slots_per_rank)``) of the store's f32
    gradient slots, where the sums land, and of the landing slots of ``signals``, where the
    copies land, with its counters (``runtime.routes.signal_args``); waits give up after
    ``timeout_s``."""

    signals: HostStore
    rank: int
    ranks: int
    slots_per_rank: int
    timeout_s: float


@dataclass(frozen=True)
class ChunkSum:
    """What the cpu route's owner does with a chunk before its AdamW: add the other ranks'
    copies of chunk ``gather_seq`` first (None: the slot holds the sum already), count its
    ``Σ g²`` (``norm``), then update (``apply``; False: the sum only feeds the norm)."""

    gather_seq: int | None
    norm: bool
    apply: bool


class SubmitArgs(AdamWStep, total=False):
    """``UpdateWorker.submit``'s keywords: the AdamW step, the gradient's scale (the clipping
    coefficient, 1.0 unless given), the version to publish after it (None: none) and the cpu
    route's sum first (None: none)."""

    grad_scale: float
    publish: int | None
    host_sum: ChunkSum | None


class UpdateWorker:
    def __init__(
        self, store: HostStore, threads: int | None = None, ring: HostSumRing | None = None
    ) -> None:
        native_ring = None
        if ring is not None:
            native_ring = (ring.signals._native, ring.rank, ring.ranks, ring.slots_per_rank,
                           ring.timeout_s)  # fmt: skip
        self._native = _native.UpdateWorker(
            store._native, default_threads() if threads is None else threads, native_ring
        )

    def submit(
        self, group: int, start: int, length: int, grad_slot: int, **request: Unpack[SubmitArgs]
    ) -> int:
        """Queues AdamW on elements ``[start, start + length)`` of ``group`` (gradient from slot
        ``grad_slot``, multiplied by ``grad_scale``), then publishes ``publish`` for the group if
        given (``length`` 0: publish only); ``host_sum`` first. Returns the request's sequence
        number at once. ``request``: ``SubmitArgs``."""
        host_sum = request.get("host_sum")
        beta1, beta2 = request["betas"]
        return self._native.submit(
            group,
            start,
            length,
            grad_slot,
            step=request["step"],
            lr=request["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=request["eps"],
            weight_decay=request["weight_decay"],
            grad_scale=request.get("grad_scale", 1.0),
            publish=request.get("publish"),
            host_sum=None
            if host_sum is None
            else (host_sum.gather_seq, host_sum.norm, host_sum.apply),
        )

    def prefault(self, groups: list[int]) -> None:
        """Faults the host state of ``groups`` (those this worker will update, in the order of
        their first updates) into this process while no update is queued, so that the first
        ones do not page-fault the store's untouched memory (its Adam moments); returns at once,
        changes no value. A group whose state an update wrote first is skipped; an update that
        arrives meanwhile goes first."""
        self._native.prefault(groups)

    def prefaulted_bytes(self) -> int:
        """Bytes faulted in ahead of their groups' first updates so far (``prefault``)."""
        return self._native.prefaulted_bytes()

    def wait_completed(self, count: int, timeout_s: float) -> None:
        """Waits until the first ``count`` requests are done; raises the first failure."""
        self._native.wait_completed(count, timeout_s)

    def take_sum_squares(self, timeout_s: float) -> float:
        """Waits until every request submitted so far is past its host sum; returns the
        ``Σ g²`` the sums with ``norm`` added since the last call (f64, request order)."""
        return self._native.take_sum_squares(timeout_s)

    def landed(self, seq: int) -> None:
        """This rank's gradient chunks up to ``seq`` are in its landing slots (ring workers
        only)."""
        self._native.landed(seq)

    def wait_consumed(self, slot: int, seq: int) -> None:
        """Waits until chunk ``seq`` was summed out of this rank's slot ``slot`` (ring index)."""
        self._native.wait_consumed(slot, seq)

    def gather(self, kernels: Kernels, seq: int, slot: int, length: int) -> None:
        """Owner, on this thread: sums every rank's landed chunk ``seq`` into this rank's f32
        slot ``slot`` (ring index) with ``kernels`` and frees the others' landing slots."""
        self._native.gather(kernels._native, seq, slot, length)

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
