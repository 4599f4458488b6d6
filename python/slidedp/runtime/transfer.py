"""Device ↔ host copies of the step: gradients to the store (D2H) and activation offload.

On CUDA both use the window's copy stream, ordered after the compute that produced the data by
an event; the device tensors are kept alive by ``record_stream`` until the copy is done. On CPU
they are plain copies. Host memory: the store's ``grad`` region (owned by the store, registered
as pinned by the engine), and per-step pinned buffers for offloaded layer inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slidedp.runtime.lanes import LaneClock, new_event
from slidedp.store import HostStore


@dataclass
class GradTicket:
    """One group's gradient on its way to the host store."""

    group: int
    norms: list[torch.Tensor]  # per-parameter L2 norms, 0-dim f32 on device
    done: torch.cuda.Event | None = None  # D2H finished (CUDA)
    keep: list[torch.Tensor] = field(default_factory=list)

    def wait(self, clock: LaneClock) -> None:
        if self.done is not None:
            with clock.host("wait_d2h"):
                self.done.synchronize()
        self.keep = []


class Transfers:
    def __init__(self, store: HostStore, clock: LaneClock, copy_stream: torch.cuda.Stream | None):
        self.store, self.clock, self.copy_stream = store, clock, copy_stream

    def _after_compute(self) -> torch.cuda.Stream | None:
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        return stream

    def grads_to_host(self, group: int, grads: dict[str, torch.Tensor]) -> GradTicket:
        """Issue the D2H of a group's gradients into ``store.param(name, "grad")``."""
        norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads.values()]
        ticket = GradTicket(group, norms)
        stream = self._after_compute()
        if stream is None:
            with self.clock.host("d2h"):
                for name, g in grads.items():
                    self.store.param(name, "grad").copy_(g)
            return ticket
        with torch.cuda.stream(stream), self.clock.stream("d2h", stream):
            for name, g in grads.items():
                self.store.param(name, "grad").copy_(g, non_blocking=True)
                g.record_stream(stream)
        ticket.done = new_event()
        ticket.done.record(stream)
        ticket.keep = list(grads.values())
        return ticket

    def offload(self, x: torch.Tensor) -> torch.Tensor:
        """Copy a saved layer input ([B, S, H]) to host memory (ordered before any reload)."""
        stream = self._after_compute()
        if stream is None:
            with self.clock.host("offload"):
                return x.clone()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        with torch.cuda.stream(stream), self.clock.stream("offload", stream):
            host.copy_(x, non_blocking=True)
            x.record_stream(stream)
        return host

    def reload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Bring an offloaded layer input back; the compute stream waits for it."""
        stream = self.copy_stream
        if stream is None:
            with self.clock.host("offload"):
                return host.clone()
        with torch.cuda.stream(stream), self.clock.stream("offload", stream):
            x = torch.empty(host.shape, dtype=host.dtype, device=device)
            x.copy_(host, non_blocking=True)
        done = new_event()
        done.record(stream)
        compute = torch.cuda.current_stream()
        with self.clock.stream("wait_offload", compute):
            compute.wait_event(done)
        x.record_stream(compute)
        return x
