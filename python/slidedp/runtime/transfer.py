"""Activation offload: each layer's saved input to pinned host memory and back (ratio r = 1).

On CUDA the copies run on their own stream, ordered after the compute that produced the input
by an event; the device tensor is kept alive by ``record_stream`` until its copy is done. The
backward prefetches across layers: ``prefetch(l - 1)`` issues the next input's H2D while layer
``l`` recomputes, and ``reload(l - 1)`` then only makes the compute stream wait for it (one
extra ``[B, S, H]`` input on the device). The
host side is ONE arena of exactly ``layers * B * S * H`` elements, allocated pageable and pinned
with ``cudaHostRegister`` (torch's pinned caching allocator would round every buffer up to a
power of two), reallocated only when the batch shape changes. On CPU the "offload" is a copy.
"""

from __future__ import annotations

import torch

from slidedp.errors import HostIOError
from slidedp.runtime.lanes import LaneClock, new_event, new_stream, on_stream


def pin(t: torch.Tensor, what: str) -> None:
    """Page-lock ``t``'s memory for async DMA (cudaHostRegister), or raise HostIOError."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise HostIOError(
            f"cudaHostRegister of {what} ({t.numel() * t.element_size()} B) failed ({err}): "
            "check `ulimit -l` and free host memory"
        )


def unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())  # type: ignore[no-untyped-call]


class ActivationOffload:
    def __init__(self, device: torch.device, layers: int, clock: LaneClock) -> None:
        self.device, self.layers, self.clock = device, layers, clock
        self.stream = new_stream(device) if device.type == "cuda" else None
        self._arena: torch.Tensor | None = None  # [layers, B, S, H], pinned (CUDA)
        # prefetched inputs by layer: the device copy and the event of its H2D (None on CPU)
        self._ahead: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def _slot(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        shape = (self.layers, *like.shape)
        if self._arena is None or self._arena.shape != shape or self._arena.dtype != like.dtype:
            self.close()
            self._arena = torch.empty(shape, dtype=like.dtype)
            pin(self._arena, "the activation offload arena")
        return self._arena[layer]

    def offload(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Copy layer ``layer``'s saved input ([B, S, H]) to host memory."""
        if self.stream is None:
            with self.clock.host("offload"):
                return x.clone()
        host = self._slot(layer, x)
        self.stream.wait_stream(torch.cuda.current_stream())
        with on_stream(self.stream), self.clock.stream("offload", self.stream):
            host.copy_(x, non_blocking=True)
            x.record_stream(self.stream)
        return host

    def prefetch(self, layer: int, host: torch.Tensor) -> None:
        """Issue the copy of layer ``layer``'s offloaded input back to the device (returns at
        once on CUDA); ``reload(layer, host)`` takes it."""
        if self.stream is None:
            with self.clock.host("offload"):
                self._ahead[layer] = (host.clone(), None)
            return
        with on_stream(self.stream), self.clock.stream("offload", self.stream):
            x = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            x.copy_(host, non_blocking=True)
        done = new_event()
        done.record(self.stream)
        self._ahead[layer] = (x, done)

    def reload(self, layer: int, host: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s offloaded input on the device (prefetched, else copied now); the
        compute stream waits for its copy."""
        if layer not in self._ahead:
            self.prefetch(layer, host)
        x, done = self._ahead.pop(layer)
        if done is None:
            return x
        compute = torch.cuda.current_stream()
        with self.clock.stream("wait_offload", compute):
            compute.wait_event(done)
        x.record_stream(compute)
        return x

    def discard_prefetched(self) -> None:
        """Forget inputs prefetched for a step that ended early (a non-finite loss)."""
        self._ahead.clear()

    def pinned_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel() * self._arena.element_size()

    def close(self) -> None:
        if self._arena is not None:
            torch.cuda.synchronize(self.device)  # no copy may still target it
            unpin(self._arena)
            self._arena = None
