"""Activation offload: a layer's chosen saved tensors to pinned host memory and back.

Ratio ``r`` selects the shortest prefix of the saved tensors, in save order, holding at least
``r`` of their bytes (``offload_count``). On CUDA the copies run on their own stream after the
layer's compute; the backward prefetches across layers (``prefetch(l - 1)``, then
``reload(l - 1)`` makes the compute stream wait). Invariants: each device tensor lives until its
copy is done (``record_stream``); reloaded copies are allocated on the compute stream, so no
second allocator pool grows beside it (benchmarks/2026-11-24-autopolicy-h100.md, "Reserved over
allocated, by layout"); host memory is one exactly sized pinned arena per layer
(``cudaHostRegister``), reallocated only when its bytes change. On CPU the "offload" is a copy.
"""

from __future__ import annotations

import time

import torch

from slidedp.runtime.activations.base import LayerState
from slidedp.runtime.lanes import LaneClock, new_event, new_stream, on_stream
from slidedp.runtime.transfer import pin, unpin

ALIGN_BYTES = 64


def offload_count(saved_bytes: list[int], ratio: float) -> int:
    """How many of the saved tensors (a prefix) ratio ``ratio`` offloads."""
    if ratio <= 0:
        return 0
    target = ratio * sum(saved_bytes)
    total = 0
    for k, n in enumerate(saved_bytes):
        total += n
        if total >= target * (1 - 1e-9):
            return k + 1
    return len(saved_bytes)


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class ActivationOffload:
    def __init__(self, device: torch.device, clock: LaneClock) -> None:
        self.device, self.clock = device, clock
        self.stream = new_stream(device) if device.type == "cuda" else None
        self._arenas: dict[int, torch.Tensor] = {}  # by layer: uint8, pinned on CUDA
        # per layer: the host copies of its offloaded tensors, with their device shapes
        self._host: dict[int, list[tuple[int, torch.Tensor, torch.Size, tuple[int, ...]]]] = {}
        # prefetched device copies by layer, with the event of their H2D (None on CPU)
        self._ahead: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self.arena_s = 0.0  # allocating and page-locking arenas (the first step's, mostly)

    def _arena(self, layer: int, nbytes: int) -> torch.Tensor:
        arena = self._arenas.get(layer)
        if arena is None or arena.numel() != nbytes:
            started = time.perf_counter()
            self._drop_arena(layer)
            arena = torch.empty(nbytes, dtype=torch.uint8)
            if self.stream is not None:
                pin(arena, f"the activation offload arena of layer {layer}")
            self._arenas[layer] = arena
            self.arena_s += time.perf_counter() - started
        return arena

    def offload(self, layer: int, state: LayerState, count: int) -> None:
        """Move the first ``count`` of ``state.tensors`` to the host (their entries → None)."""
        if count == 0:
            return
        chosen = [(k, state.tensor(k)) for k in range(count)]
        arena = self._arena(layer, sum(_aligned(t.numel() * t.element_size()) for _, t in chosen))
        host: list[tuple[int, torch.Tensor, torch.Size, tuple[int, ...]]] = []
        offset = 0
        for k, t in chosen:
            nbytes = t.numel() * t.element_size()
            dst = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
            host.append((k, dst, t.shape, tuple(t.stride())))
            offset += _aligned(nbytes)
        if self.stream is None:
            with self.clock.host("offload"):
                for (_, dst, _, _), (_, t) in zip(host, chosen, strict=True):
                    dst.copy_(t)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with on_stream(self.stream), self.clock.stream("offload", self.stream):
                for (_, dst, _, _), (_, t) in zip(host, chosen, strict=True):
                    dst.copy_(t, non_blocking=True)
                    t.record_stream(self.stream)
        for k, _ in chosen:
            state.tensors[k] = None
        self._host[layer] = host

    def offloaded(self, layer: int) -> bool:
        return layer in self._host

    def prefetch(self, layer: int) -> None:
        """Issue the copies of layer ``layer``'s offloaded tensors back to the device (returns
        at once on CUDA); ``reload`` takes them."""
        if layer in self._host and layer not in self._ahead:
            self._issue(layer)

    def _issue(self, layer: int) -> None:
        host = self._host[layer]
        # each tensor comes back with its device strides: views of it are rebuilt by strides
        if self.stream is None:
            with self.clock.host("offload"):
                copies = [torch.empty_strided(shape, stride, dtype=h.dtype).copy_(h)
                          for _, h, shape, stride in host]  # fmt: skip
            self._ahead[layer] = (copies, None)
            return
        copies = [torch.empty_strided(shape, stride, dtype=h.dtype, device=self.device)
                  for _, h, shape, stride in host]  # fmt: skip
        # the blocks' earlier users on the compute stream are done before the copies write them
        self.stream.wait_stream(torch.cuda.current_stream())
        with on_stream(self.stream), self.clock.stream("offload", self.stream):
            for x, (_, h, _, _) in zip(copies, host, strict=True):
                x.copy_(h, non_blocking=True)
        done = new_event()
        done.record(self.stream)
        self._ahead[layer] = (copies, done)

    def reload(self, layer: int, state: LayerState) -> None:
        """Put layer ``layer``'s offloaded tensors back into ``state`` (prefetched, else
        copied now); the compute stream waits for their copies."""
        if layer not in self._host:
            return
        if layer not in self._ahead:
            self._issue(layer)
        copies, done = self._ahead.pop(layer)
        host = self._host.pop(layer)
        if done is not None:  # the compute stream's work from here on, its frees too, follows
            compute = torch.cuda.current_stream()
            with self.clock.stream("wait_offload", compute):
                compute.wait_event(done)
        for (k, _, _, _), x in zip(host, copies, strict=True):
            state.tensors[k] = x

    def discard(self) -> None:
        """Forget what a step that ended early (a non-finite loss) offloaded or prefetched."""
        for _, done in self._ahead.values():
            if done is not None:  # no block is reused before the copy into it is done
                torch.cuda.current_stream().wait_event(done)
        self._ahead.clear()
        self._host.clear()

    def pinned_bytes(self) -> int:
        return sum(a.numel() for a in self._arenas.values()) if self.stream is not None else 0

    def _drop_arena(self, layer: int) -> None:
        arena = self._arenas.pop(layer, None)
        if arena is not None and self.stream is not None:
            torch.cuda.synchronize(self.device)  # no copy may still target it
            unpin(arena)

    def close(self) -> None:
        for layer in list(self._arenas):
            self._drop_arena(layer)
