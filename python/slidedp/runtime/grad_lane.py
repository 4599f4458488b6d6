"""The gradient lane: device gradients → the store's gradient slots (a ring) → the update worker.

``send`` cuts a group's gradient into chunks (one slot each), issues each D2H on the D2H stream
and queues it; ``flush`` waits for each copy in order, checks the group's gradient is finite and
submits its AdamW (the last chunk publishes the version). Invariants: a slot is reused only after
the worker read it (the backpressure); host memory is ``grad_slots`` chunks, never a gradient per
parameter; a chunk's source stays referenced until its copy is done. Several ranks: each rank
its own slot range; on the cpu route (``host_sum``) every rank sends into its landing slots
(``HostSum.landing``), only the owner submits, with a chunk ``role`` of ``both`` (norm and
update), ``norm`` (during the backward, with clipping) or ``update`` (after the coefficient);
``take_sum_squares`` returns the Σ g². A copy never rounds: a gradient wider than the slots
it lands in is an error.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from slidedp.errors import InvalidArgumentError, NonFiniteError
from slidedp.runtime.chunking import chunks, pieces
from slidedp.runtime.lanes import LaneClock, new_event, on_stream
from slidedp.store import HostStore
from slidedp.update import UpdateWorker

if TYPE_CHECKING:
    from slidedp.runtime.routes import HostSum


Role = Literal["both", "norm", "update"]  # what a host-summed chunk is for (module docstring)


@dataclass(frozen=True)
class AdamArgs:
    """What one group's update needs besides its gradient."""

    step: int  # Adam's step count (bias correction), 1-based
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_scale: float
    version: int  # published for the group after its last chunk


@dataclass
class GradTicket:
    """One group's gradient on the device, with its per-parameter L2 norms (0-dim, f32)."""

    group: int
    grads: dict[str, torch.Tensor]
    norms: list[torch.Tensor]


@dataclass
class _Chunk:
    ticket: GradTicket
    start: int
    length: int
    slot: int
    first: bool
    last: bool
    adam: AdamArgs
    check_finite: bool
    done: torch.cuda.Event | None
    seq: int  # chunks sent before this one by this lane (the same on every rank)
    role: Role
    keep: list[torch.Tensor] = field(default_factory=list)
    # with check_finite, on the first chunk: the group's gradient norm in host memory, copied
    # on the gradient stream before ``done`` (reading it then needs no device sync)
    norm: torch.Tensor | None = None


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a store shared by several: its range of the gradient slots (None:
    all of them), the cpu route's host sum, and the groups whose updates it runs."""

    slot_base: int = 0
    slot_count: int | None = None
    host_sum: HostSum | None = None
    owns: Callable[[int], bool] = lambda group: True


class GradLane:
    def __init__(
        self,
        store: HostStore,
        worker: UpdateWorker,
        clock: LaneClock,
        stream: torch.cuda.Stream | None,
        timeout_s: float,
        group_name: Any,
        share: RankShare = RankShare(),  # frozen: one shared default is safe
    ) -> None:
        self.store, self.worker, self.clock, self.stream = store, worker, clock, stream
        self.timeout_s, self.group_name = timeout_s, group_name
        self.host_sum, self.owns = share.host_sum, share.owns
        # where this rank's copies land: the store's gradient slots, or the cpu route's landing
        self.landing = store if share.host_sum is None else share.host_sum.landing
        layout = store.layout
        self._slot_len = int(layout.slot_len)
        self._groups = layout.groups
        self._params = layout.params
        self._queue: deque[_Chunk] = deque()
        self._queued_slots: set[int] = set()
        self._slot_base = share.slot_base
        count = int(layout.grad_slots) if share.slot_count is None else share.slot_count
        self.slot_count = count  # this rank's gradient slots
        # per local slot: ("update", worker seq) or ("sum", chunk seq) of its last reader (on
        # the cpu route the owner's update also frees its f32 slot k, which only it writes)
        self._slot_reader: list[tuple[str, int] | None] = [None] * count
        self._next_slot = 0
        self._sent = 0

    @staticmethod
    def ticket(group: int, grads: dict[str, torch.Tensor]) -> GradTicket:
        norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads.values()]
        return GradTicket(group, grads, norms)

    def _acquire_slot(self) -> int:
        k = self._next_slot
        self._next_slot = (k + 1) % len(self._slot_reader)
        while k in self._queued_slots:  # its chunk is not even submitted yet: submit it
            self._flush_one()
        reader = self._slot_reader[k]
        if reader is not None:
            with self.clock.host("wait_update"):
                if reader[0] == "update":
                    self.worker.wait_completed(reader[1] + 1, self.timeout_s)
                else:
                    assert self.host_sum is not None
                    self.host_sum.wait_consumed(k, reader[1])
        return k

    def send(
        self, ticket: GradTicket, adam: AdamArgs, *, check_finite: bool, role: Role = "both"
    ) -> None:
        """Issue the D2H of ``ticket``'s gradient (its trained parameters'), chunk by chunk, and
        queue the updates."""
        g = self._groups[ticket.group]
        params = self._params[g.params.start : g.params.end]
        parts = chunks(int(g.trained_len), self._slot_len)  # frozen parameters lie past it
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # after the backward
        norm = self._norm_to_host(ticket) if check_finite else None
        self._check_exact(ticket)
        for i, (start, length) in enumerate(parts):
            k = self._acquire_slot()
            slot = self.landing.grad_slot(self._slot_base + k)
            chunk = _Chunk(ticket, start, length, k, i == 0, i == len(parts) - 1, adam,
                           check_finite, None, self._sent, role,
                           norm=norm if i == 0 else None)  # fmt: skip
            self._sent += 1
            with on_stream(self.stream), self.clock.stream("d2h", self.stream):
                # the gaps (alignment padding after a parameter whose size is not a multiple
                # of 16) are zeroed: the cpu route sums and squares whole chunks, and a slot's
                # gaps hold values of the chunk it carried before
                end = 0
                for p, lo, hi in pieces(params, "state_offset", g.state_offset, start, length):
                    src = ticket.grads[p.name].view(-1)[lo:hi]
                    at = p.state_offset - g.state_offset + lo - start
                    slot[end:at].zero_()
                    slot[at : at + hi - lo].copy_(src, non_blocking=self.stream is not None)
                    chunk.keep.append(src)
                    end = at + hi - lo
                slot[end:length].zero_()
                if self.stream is not None:
                    chunk.done = new_event()
                    chunk.done.record(self.stream)
            self._queue.append(chunk)
            self._queued_slots.add(k)

    def _check_exact(self, ticket: GradTicket) -> None:
        """Refuses a gradient the copy to the slots would round (f32 into bf16 slots)."""
        slots = self.landing.region("grad").dtype
        for name, g in ticket.grads.items():
            if torch.promote_types(g.dtype, slots) != slots:
                raise InvalidArgumentError(
                    f"the gradient of '{name}' is {g.dtype}, the gradient slots hold {slots}: "
                    "the copy would round it; train in float32 (train.dtype) or keep the "
                    "parameter in the compute dtype"
                )

    def _norm_to_host(self, ticket: GradTicket) -> torch.Tensor:
        """The group's gradient norm, copied to host memory on the gradient stream. Checking
        it with ``bool()`` on the device would make the host wait for the whole compute
        stream, the layer just issued included, before it issues the next layer's load (about
        5 ms per layer on Qwen3-4B at B=16:
        benchmarks/2026-11-22-one-gpu-engine.md)."""
        with on_stream(self.stream):
            total: torch.Tensor = torch.linalg.vector_norm(torch.stack(ticket.norms))
            if self.stream is None:
                return total
            host = torch.empty((), dtype=total.dtype, pin_memory=True)
            host.copy_(total, non_blocking=True)
        return host

    def _flush_one(self) -> None:
        chunk = self._queue.popleft()
        if chunk.done is not None:
            with self.clock.host("wait_d2h"):
                chunk.done.synchronize()
        chunk.keep.clear()
        self._queued_slots.discard(chunk.slot)
        ticket, a = chunk.ticket, chunk.adam
        host_sum = None
        if self.host_sum is not None:
            self.host_sum.landed(chunk.seq)
            if not self.owns(ticket.group):
                self._slot_reader[chunk.slot] = ("sum", chunk.seq)
                if chunk.last and chunk.role != "norm":  # a "norm" chunk is sent again
                    ticket.grads.clear()
                return
            host_sum = self.host_sum.chunk_sum(chunk.seq, chunk.slot, chunk.length, chunk.role)
        if chunk.norm is not None:
            norm = float(chunk.norm)  # in host memory, landed with the chunk's copy
            if not math.isfinite(norm):
                self._queue.clear()
                self._queued_slots.clear()
                raise NonFiniteError(
                    f"step {a.version - 1}: the gradient of '{self.group_name(ticket.group)}' "
                    f"is not finite ({norm}); its update and those of the groups after "
                    "it were not applied",
                    step=a.version - 1,
                    what="grad_norm",
                )
        updates = chunk.role != "norm"
        seq = self.worker.submit(
            ticket.group,
            chunk.start,
            chunk.length,
            self._slot_base + chunk.slot,
            step=a.step,
            lr=a.lr,
            betas=a.betas,
            eps=a.eps,
            weight_decay=a.weight_decay,
            grad_scale=a.grad_scale,
            publish=a.version if chunk.last and updates else None,
            host_sum=host_sum,
        )
        self._slot_reader[chunk.slot] = ("update", seq)
        if chunk.last and updates:
            ticket.grads.clear()  # the device gradient is no longer needed

    def take_sum_squares(self) -> float:
        """Σ g² of the chunks this rank's worker summed for the norm since the last call (cpu
        route; waits for the sums submitted so far)."""
        with self.clock.host("wait_update"):
            return self.worker.take_sum_squares(self.timeout_s)

    def flush(self, *, keep_last_group: bool = False, through_group: int | None = None) -> None:
        """Submit queued chunks in order: all of them; or all but the newest group's
        (``keep_last_group``: its copy is likely still running); or up to and including the last
        chunk of ``through_group`` (someone is about to wait for that group's version)."""
        if through_group is not None:
            if not any(c.ticket.group == through_group for c in self._queue):
                return
            while self._queue:
                head = self._queue[0]
                self._flush_one()
                if head.ticket.group == through_group and head.last:
                    return
            return
        newest = self._queue[-1].ticket if keep_last_group and self._queue else None
        while self._queue and self._queue[0].ticket is not newest:
            self._flush_one()

    def publish_only(self, group: int, version: int) -> None:
        """Advance ``group``'s version without an update (a skipped step), in lane order."""
        self.flush()
        self.publish_frozen(group, version)

    def publish_frozen(self, group: int, version: int) -> None:
        """Advance the version of ``group``, which has no gradient (frozen), on its owner."""
        if not self.owns(group):
            return
        self.worker.submit(group, 0, 0, 0, step=1, lr=0.0, betas=(0.0, 0.0), eps=1.0,
                           weight_decay=0.0, publish=version)  # fmt: skip
