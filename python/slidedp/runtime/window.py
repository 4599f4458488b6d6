"""The device window: a few reusable layer slots fed from the host store, plus embed/head.

Each slot is one flat device buffer in the compute dtype in the group's slot layout. Loading
group ``g``: wait for its version, then per chunk cast f32 master into a BF16 staging slot
(Rust) and copy it on the copy stream, or with the BF16 mirror one H2D straight from it. A
layer's module is bound to views of the slot just before it runs, so parameter memory is
``slots`` layers plus embed and head, whatever the depth. Sharded route: each rank loads its
``1/world`` share and an all-gather rebuilds the layer. Invariants: the store owns host
buffers, the window the device ones; a staging slot is reused only after the copy that read
it completed, a device slot only after the compute that read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slidedp.kernels import Kernels
from slidedp.runtime.chunking import chunks, pieces
from slidedp.runtime.dist import collective
from slidedp.runtime.lanes import LaneClock, new_event, new_stream, on_stream
from slidedp.store import HostStore
from slidedp.store_layout import ParamLayout


def fill_mirror(store: HostStore, kernels: Kernels) -> None:
    """Write the BF16 mirror from the master weights (after loading or initialising them; the
    update worker keeps it current from then on). Padding stays zero."""
    if not store.has_mirror:
        return
    for group, g in enumerate(store.layout.groups):
        mirror = store.mirror_group(group)
        for p in store.layout.params[g.params.start : g.params.end]:
            out = mirror[p.slot_offset : p.slot_offset + p.numel]
            kernels.cast_f32_to_bf16(store.param(p.name).view(-1), out)


class DeviceBuffer:
    """A flat device buffer holding one group at a time, staging-slot layout."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.flat = torch.empty(numel, dtype=dtype, device=device)  # [numel]
        self.group: int | None = None
        self.version: int | None = None
        self.ready: torch.cuda.Event | None = None  # H2D into it finished
        self.released: torch.cuda.Event | None = None  # last compute reading it finished
        self.in_use = False  # between acquire and release: never a load target


@dataclass(frozen=True)
class Shard:
    """The sharded route: this rank loads its ``1/world`` share of each group and an
    all-gather in ``group`` (the node's ranks; None: all) rebuilds it."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class WindowSpec:
    """What the window holds: ``slots`` buffers of the largest of ``layer_groups`` in
    ``dtype``; the staging slots ``staging_base .. + staging_count`` of the store (None: all);
    a group's version is awaited at most ``version_timeout_s``; ``shard``: None (replicated)."""

    dtype: torch.dtype
    layer_groups: list[int]
    slots: int
    version_timeout_s: float
    staging_base: int = 0
    staging_count: int | None = None
    shard: Shard | None = None


class Window:
    """Loads parameter groups from the host store into device buffers (slots, embed, head)."""

    def __init__(
        self,
        store: HostStore,
        kernels: Kernels,
        device: torch.device,
        clock: LaneClock,
        spec: WindowSpec,
        before_wait: Callable[[int], None] | None = None,
    ) -> None:
        """``before_wait(group)`` runs before waiting for a group's version (the gradient lane
        submits that group's queued update there)."""
        self.store, self.kernels, self.device, self.dtype = store, kernels, device, spec.dtype
        self.clock, self.timeout_s, self.before_wait = clock, spec.version_timeout_s, before_wait
        self.cuda = device.type == "cuda"
        self.staging_base, self.shard = spec.staging_base, spec.shard
        self.copy_stream = new_stream(device) if self.cuda else None
        groups = store.layout.groups
        self._params: dict[int, tuple[ParamLayout, ...]] = {
            gi: store.layout.group_params(g) for gi, g in enumerate(groups)
        }
        self._slot_len = {gi: int(g.slot_len) for gi, g in enumerate(groups)}
        layer_len = self._padded(max(self._slot_len[g] for g in spec.layer_groups))
        self.slots = [DeviceBuffer(layer_len, spec.dtype, device) for _ in range(spec.slots)]
        self._next_slot = 0
        count = store.layout.staging_slots if spec.staging_count is None else spec.staging_count
        self._staging_events: list[torch.cuda.Event | None] = [None] * count
        self._next_staging = 0
        self._by_group: dict[int, DeviceBuffer] = {}

    def own_buffer(self, group: int) -> DeviceBuffer:
        """A dedicated buffer for ``group`` (embedding, head): loaded like a slot, never shared."""
        buf = DeviceBuffer(self._padded(self._slot_len[group]), self.dtype, self.device)
        self._by_group[group] = buf
        return buf

    def _padded(self, numel: int) -> int:
        """Buffer length: a multiple of the ranks when sharded (equal all-gather parts)."""
        world = 1 if self.shard is None else self.shard.world
        return -(-numel // world) * world

    def share(self, group: int) -> tuple[int, int]:
        """The range of the group's slot layout this rank loads: all of it, or its shard."""
        n = self._slot_len[group]
        if self.shard is None:
            return 0, n
        rank, world = self.shard.rank, self.shard.world
        part = self._padded(n) // world
        return min(rank * part, n), min((rank + 1) * part, n)

    def staging_range(self) -> tuple[int, int]:
        """The store's staging slots this window copies through: (first, count)."""
        return self.staging_base, len(self._staging_events)

    def views(self, buf: DeviceBuffer, group: int) -> dict[str, torch.Tensor]:
        """Full parameter name → shaped view of ``buf`` (which must hold ``group``)."""
        assert buf.group == group, f"buffer holds group {buf.group}, not {group}"
        return {
            p.name: buf.flat[p.slot_offset : p.slot_offset + p.numel].view(p.shape)
            for p in self._params[group]
        }

    def _staging_slot(self) -> tuple[int, torch.Tensor]:
        """The next staging slot of the ring, once the H2D that last read it is done."""
        k = self._next_staging
        self._next_staging = (k + 1) % len(self._staging_events)
        event = self._staging_events[k]
        if event is not None:
            with self.clock.host("wait_h2d"):
                event.synchronize()
        return k, self.store.staging_slot(self.staging_base + k)

    def load(self, buf: DeviceBuffer, group: int, version: int) -> None:
        """Issue the load of ``group`` at ``version`` into ``buf`` (returns before H2D ends)."""
        if buf.group == group and buf.version == version:
            return
        if self.before_wait is not None:
            self.before_wait(group)
        with self.clock.host("wait_update"):
            self.store.wait_version(group, version, self.timeout_s)
        stream = self.copy_stream
        if stream is not None and buf.released is not None:
            stream.wait_event(buf.released)  # compute finished reading the old contents
        lo, hi = self.share(group)
        if self.dtype == torch.bfloat16 and self.store.has_mirror:
            with on_stream(stream), self.clock.stream("h2d", stream):
                buf.flat[lo:hi].copy_(self.store.mirror_group(group)[lo:hi], non_blocking=True)
        elif self.dtype == torch.bfloat16:
            self._stage_and_copy(buf, group, stream, lo, hi)
        else:  # f32 compute: straight from the master weights, no staging
            with on_stream(stream), self.clock.stream("h2d", stream):
                for p, a, b in pieces(self._params[group], "slot_offset", 0, lo, hi - lo):
                    dst = buf.flat[p.slot_offset + a : p.slot_offset + b]
                    dst.copy_(self.store.param(p.name).view(-1)[a:b], non_blocking=True)
        if self.shard is not None:
            self._all_gather(buf.flat[: self._padded(self._slot_len[group])], stream)
        if stream is not None:
            buf.ready = new_event()
            buf.ready.record(stream)
        buf.group, buf.version = group, version

    def _all_gather(self, flat: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """Every rank's share into every rank's ``flat`` (ordered after this rank's H2D)."""
        assert self.shard is not None
        rank, world, group = self.shard.rank, self.shard.world, self.shard.group
        parts = list(flat.view(world, -1).unbind(0))
        with on_stream(stream), self.clock.stream("h2d", stream):
            collective(lambda: dist.all_gather(parts, parts[rank].clone(), group=group))

    def _stage_and_copy(
        self, buf: DeviceBuffer, group: int, stream: torch.cuda.Stream | None, lo: int, hi: int
    ) -> None:
        """Per chunk of ``[lo, hi)``: cast into a staging slot (host), then H2D it."""
        params = self._params[group]
        for offset, length in chunks(hi - lo, self.store.layout.slot_len):
            start = lo + offset
            k, staging = self._staging_slot()
            with self.clock.host("prep"):
                for p, a, b in pieces(params, "slot_offset", 0, start, length):
                    at = p.slot_offset + a - start
                    src = self.store.param(p.name).view(-1)[a:b]
                    self.kernels.cast_f32_to_bf16(src, staging[at : at + b - a])
            with on_stream(stream), self.clock.stream("h2d", stream):
                buf.flat[start : start + length].copy_(staging[:length], non_blocking=True)
                if stream is not None:
                    event = new_event()
                    event.record(stream)
                    self._staging_events[k] = event

    def acquire(self, buf: DeviceBuffer) -> None:
        """Make the compute stream wait until ``buf``'s H2D is done."""
        buf.in_use = True
        if self.cuda and buf.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            with self.clock.stream("wait_h2d", compute):
                compute.wait_event(buf.ready)

    def release(self, buf: DeviceBuffer) -> None:
        """Mark the end of compute reading ``buf`` (the next load into it waits for this)."""
        buf.in_use = False
        if self.cuda:
            buf.released = new_event()
            buf.released.record(torch.cuda.current_stream(self.device))

    def fetch(self, group: int, version: int) -> DeviceBuffer | None:
        """The slot holding ``group`` at ``version``, else load it into the next free slot
        (round-robin); None when every slot is in use (the caller fetches again later)."""
        for buf in self.slots:
            if buf.group == group and buf.version == version:
                return buf
        for i in range(len(self.slots)):
            k = (self._next_slot + i) % len(self.slots)
            if not self.slots[k].in_use:
                self._next_slot = (k + 1) % len(self.slots)
                self.load(self.slots[k], group, version)
                return self.slots[k]
        return None

    def param_bytes(self) -> int:
        """Device bytes held for parameters (slots + dedicated buffers)."""
        bufs = self.slots + list(self._by_group.values())
        return sum(b.flat.numel() * b.flat.element_size() for b in bufs)
