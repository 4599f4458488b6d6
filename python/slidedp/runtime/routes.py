"""Gradient routes across ranks (``runtime.grad_route``): how one gradient per group reaches AdamW.

- ``gpu``: ``GpuReduce`` sums each group's gradient across the node's ranks on the devices
  with one ``reduce`` to the group's owner (``Dist.owner``), which all-reduces it with the
  owners of the other nodes (``Dist.across_nodes``, several nodes only); only the owner copies
  it to the host and updates, so ONE gradient per group crosses each node's host link.
  Non-owners drop theirs.
- ``cpu``: every rank copies its own gradient into its own gradient slots; ``HostSum`` lets the
  owner sum the ranks' slots of a chunk (Rust ``sum_into``, shared memory) into its slot and
  submit the update. Signals are version counters of a tiny second store (``signal_specs``):
  ``landed[r]`` counts the chunks rank ``r`` has copied, ``consumed[r][k]`` the last chunk
  summed out of rank ``r``'s slot ``k``. Every rank sends the same chunks in the same order
  with the same slot round-robin, so a chunk's sequence number names it on every rank. No
  barrier: a rank waits only for the counters of the chunks it needs. With several nodes the
  owner all-reduces the summed chunk (f32, host memory, gloo) with the other nodes' owners
  before its norm and update.

Either way exactly one AdamW runs per group per step and node, on the owner, with the same
gradient on every node; other ranks only wait for the group's version.

Example::

    route = GpuReduce(ctx, clock)
    owned = route.reduce(ticket)   # the summed gradient on the owner, None elsewhere
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slidedp.kernels import Kernels
from slidedp.runtime.dist import Dist, collective
from slidedp.runtime.grad_lane import GradLane, GradTicket
from slidedp.runtime.lanes import LaneClock
from slidedp.store import GroupSpec, HostStore, ParamSpec


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


class HostSum:
    """The cpu route's cross-rank sum of gradient chunks in the shared gradient slots."""

    def __init__(
        self,
        ctx: Dist,
        store: HostStore,
        signals: HostStore,
        kernels: Kernels,
        slots_per_rank: int,
        timeout_s: float,
        clock: LaneClock,
    ) -> None:
        self.ctx, self.store, self.signals, self.kernels = ctx, store, signals, kernels
        self.slots, self.timeout_s, self.clock = slots_per_rank, timeout_s, clock

    def _consumed(self, rank: int, slot: int) -> int:
        return self.ctx.local_world + rank * self.slots + slot

    def landed(self, seq: int) -> None:
        """This rank's chunks up to ``seq`` are in its slots."""
        self.signals.publish(self.ctx.local_rank, seq + 1)

    def wait_consumed(self, slot: int, seq: int) -> None:
        """This rank's slot ``slot`` may be rewritten: chunk ``seq`` was summed out of it."""
        wait = self._consumed(self.ctx.local_rank, slot)
        self.signals.wait_version(wait, seq + 1, self.timeout_s)

    def gather(self, seq: int, slot: int, length: int, *, norm: bool = True) -> float:
        """Owner: add every other local rank's chunk ``seq`` (their slot ``slot``) into its own
        slot; frees their slots; sums it with the other nodes' owners; returns Σ g² of the
        summed chunk (for the global norm; 0.0 unless ``norm``)."""
        ctx = self.ctx
        dst = self.store.grad_slot(ctx.local_rank * self.slots + slot)[:length]
        others = [r for r in range(ctx.local_world) if r != ctx.local_rank]
        for r in others:
            self.signals.wait_version(r, seq + 1, self.timeout_s)
        if others:
            srcs = [self.store.grad_slot(r * self.slots + slot)[:length] for r in others]
            self.kernels.sum_into(dst, srcs, accumulate=True)
        for r in others:
            self.signals.publish(self._consumed(r, slot), seq + 1)
        with self.clock.host("nodes"):
            ctx.across_nodes(dst)
        return self.kernels.sum_squares(dst) if norm else 0.0
