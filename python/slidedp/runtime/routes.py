"""Gradient routes across ranks (``runtime.grad_route``): how one gradient per group reaches AdamW.

- ``gpu``: ``GpuReduce`` reduces each group's gradient onto its owner (``Dist.owner``), then
  across nodes; only the owner copies it to the host (one gradient per group per node).
- ``cpu``: every rank copies its own gradient, as the device holds it, to its landing slots
  in a small second store (``signal_args``); the owner's update worker (``update.HostSumRing``,
  Rust) sums the ranks' copies in f32 into its gradient slot of the main store, takes Σ g² and
  runs AdamW. Signals are version counters of that second store; every rank sends the same
  chunks in the same order, so a chunk's sequence number names it everywhere; no barrier.
Invariant: exactly one AdamW per group per step and node, on the owner, with the same gradient
on every node; other ranks only wait for the group's version.

Example::

    owned = GpuReduce(ctx, clock).reduce(ticket)   # the summed gradient on the owner, else None
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slidedp.config_runtime import LayoutSpec
from slidedp.kernels import Kernels
from slidedp.plan.policy import landing_dtype
from slidedp.runtime.dist import Dist, collective
from slidedp.runtime.grad_lane import GradLane, GradTicket, Role
from slidedp.runtime.lanes import LaneClock
from slidedp.store import GroupSpec, HostStore, ParamSpec
from slidedp.store_layout import Dtype
from slidedp.update import ChunkSum, UpdateWorker


class GpuReduce:
    def __init__(self, ctx: Dist, clock: LaneClock) -> None:
        self.ctx, self.clock = ctx, clock

    def reduce(self, ticket: GradTicket) -> GradTicket | None:
        """Sum ``ticket``'s gradient onto the group's owner of this node (one collective per
        group), then over the nodes' owners (one more)."""
        grads = ticket.grads
        flat = torch.cat([g.reshape(-1) for g in grads.values()])  # [group numel]
        ctx = self.ctx
        owner = ctx.node_rank_of(ctx.owner(ticket.group))
        collective(lambda: dist.reduce(flat, dst=owner, group=ctx.node_group))
        if ctx.rank != owner:
            return None
        compute = torch.cuda.current_stream() if flat.is_cuda else None
        with self.clock.stream("nodes", compute):
            ctx.across_nodes(flat)  # with the owners on the other nodes
        views, at = {}, 0
        for name, g in grads.items():
            views[name] = flat[at : at + g.numel()].view(g.shape)
            at += g.numel()
        return GradLane.ticket(ticket.group, views)


def signal_specs(world: int, slots_per_rank: int) -> list[GroupSpec]:
    """The counters of ``HostSum`` as store groups (one element each; only versions are used):
    ``landed.r`` for each rank, then ``consumed.r.k`` for each rank and slot."""

    def counter(name: str) -> GroupSpec:
        return GroupSpec(name, [ParamSpec(name, (1,), "f32")])

    landed = [counter(f"landed.{r}") for r in range(world)]
    slots = [(r, k) for r in range(world) for k in range(slots_per_rank)]
    return landed + [counter(f"consumed.{r}.{k}") for r, k in slots]


def signal_args(
    world: int, slots_per_rank: int, landing: Dtype | None, slot_len: int
) -> dict[str, Any]:
    """``HostStore.create``'s (or ``plan``'s) arguments for the signal store: the counters
    (``signal_specs``) and, with ``landing`` (``plan.policy.landing_dtype``), every rank's
    ``slots_per_rank`` landing slots in that dtype, of the main store's ``slot_len``."""
    args: dict[str, Any] = {"groups": signal_specs(world, slots_per_rank), "staging_slots": 0}
    if landing is None:
        return args
    slots = world * slots_per_rank
    return args | {"grad_dtype": landing, "grad_slots": slots, "chunk_elems": slot_len}


def share_signals(ctx: Dist, store: HostStore, layout: LayoutSpec, bf16: bool) -> HostStore:
    """The node's signal store, which its local rank 0 creates and the others attach to: the
    counters and, on the cpu route, the landing slots of ``store``'s slot length, in the
    compute dtype (BF16 with ``bf16``)."""
    landing = landing_dtype(layout.grad_route, bf16=bf16, processes=ctx.world)
    args = signal_args(ctx.local_world, layout.grad_slots, landing, store.layout.slot_len)
    return ctx.share_store(lambda: HostStore.create(**args))


class HostSum:
    """The cpu route's cross-rank sum of gradient chunks: ``GradLane``'s calls into the ring of
    its update worker (``UpdateWorker(..., ring=HostSumRing(...))``), whose signal store holds
    the landing slots (``landing``) the lane copies into."""

    def __init__(
        self, ctx: Dist, store: HostStore, worker: UpdateWorker, kernels: Kernels, clock: LaneClock,
        landing: HostStore,
    ) -> None:  # fmt: skip
        self.ctx, self.store, self.worker, self.kernels, self.clock = (
            ctx, store, worker, kernels, clock
        )  # fmt: skip
        self.landing = landing

    def landed(self, seq: int) -> None:
        """This rank's chunks up to ``seq`` are in its landing slots."""
        self.worker.landed(seq)

    def wait_consumed(self, slot: int, seq: int) -> None:
        """This rank's slot ``slot`` may be rewritten: chunk ``seq`` was summed out of it."""
        self.worker.wait_consumed(slot, seq)

    def chunk_sum(self, seq: int, slot: int, length: int, role: Role) -> ChunkSum:
        """Owner of chunk ``seq`` (this rank's slot ``slot``): what its update request sums
        (``role``: ``GradLane``). One node: the worker sums the ranks' copies. Several: this
        thread sums them into the f32 slot and all-reduces it with the other nodes' owners
        first."""
        gather: int | None = seq
        if self.ctx.nodes > 1:
            with self.clock.host("wait_update"):  # the wait for its peers' chunks, then the sum
                self.worker.gather(self.kernels, seq, slot, length)
            ctx = self.ctx
            slots = self.store.layout.grad_slots // ctx.local_world
            dst = self.store.grad_slot(ctx.local_rank * slots + slot)[:length]
            with self.clock.host("nodes"):
                ctx.across_nodes(dst)
            gather = None
        return ChunkSum(gather_seq=gather, norm=role != "update", apply=role != "norm")
