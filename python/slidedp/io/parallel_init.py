"""The normal draws of a model's ``_init_weights``, made on every core and seeded per chunk.

torch draws ``normal_`` on CPU from one serial stream (~150M values/s: ~100 s for the 14.8B
weights of Qwen3-14B). Inside ``ParallelNormal(seed, threads)``, each ``Tensor.normal_`` of a
contiguous tensor is split into chunks of ``CHUNK`` values; chunk ``k`` of the ``n``-th draw
under the same ``scope`` gets its own generator, seeded from (seed, scope, n, k), and the
chunks are drawn on a pool of threads (torch releases the GIL in the draw; a mode is per
thread, so the pool's own draws do not reach it). Draws stay in flight until the next other
torch call (a layer's q/k/v/o projections, then its three MLP matrices, are drawn together: one
matrix alone has fewer chunks than a large host has cores), so what ``_init_weights`` does
besides the draws (zeroed biases, unit norms, a zeroed padding row after its draw) runs as
written, in its order, on drawn values; a draw over memory still being drawn waits for it. The
values depend on the seed, the scope names and the order of the draws alone, never on the
thread count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NORMALS = (torch.Tensor.normal_, torch.nn.init.normal_)
CHUNK = 1 << 20  # values per generator: 4 MiB of FP32, ~10 ms of one core's draws


def chunk_seed(seed: int, scope: str, draw: int, chunk: int) -> int:
    """The 63-bit seed of ``chunk`` of the ``draw``-th normal draw under ``scope``."""
    key = f"{seed}/{scope}/{draw}/{chunk}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class ParallelNormal(TorchFunctionMode):
    """A torch function mode that draws each ``Tensor.normal_`` by chunks on ``threads``
    threads; ``scope(name)`` names the module whose draws follow (its draws count from 0)."""

    def __init__(self, seed: int, threads: int) -> None:
        super().__init__()
        self.seed = seed
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="init")
        self._scope = ""
        self._draws = 0
        self._pending: list[Future[None]] = []
        self._drawing: list[tuple[int, int]] = []  # the pending draws' byte ranges

    def scope(self, name: str) -> None:
        self._scope, self._draws = name, 0

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        try:
            self.wait()  # a draw's error is raised as itself, unless one is raised already
        except BaseException:
            if error is None:
                raise
        finally:
            super().__exit__(kind, error, trace)  # type: ignore[no-untyped-call]
            self.pool.shutdown(cancel_futures=error is not None)

    def wait(self) -> None:
        """Until every draw in flight is done; a worker's error is raised here, as itself."""
        pending, self._pending, self._drawing = self._pending, [], []
        futures.wait(pending)  # all of them: none still writing once this returns or raises
        for done in pending:
            done.result()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        # torch.nn.init.normal_ (what _init_weights calls) reaches a mode as itself, its tensor
        # by keyword; Tensor.normal_ as a method, its arguments by position
        if func not in _NORMALS or kwargs.get("generator") is not None:
            self.wait()  # anything else sees the values drawn before it
            return func(*args, **kwargs)
        named = dict(zip(("tensor", "mean", "std"), args, strict=False)) | kwargs
        tensor: torch.Tensor = named["tensor"] if "tensor" in named else named["self"]
        span = _span(tensor)
        if any(span[0] < end and start < span[1] for start, end in self._drawing):
            self.wait()  # the same memory drawn again: in order
        self._drawing.append(span)
        self._draw(tensor, float(named.get("mean", 0.0)), float(named.get("std", 1.0)))
        return tensor

    def _draw(self, tensor: torch.Tensor, mean: float, std: float) -> None:
        scope, draw, self._draws = self._scope, self._draws, self._draws + 1
        # a strided view has no flat chunks: one generator for the whole tensor, still seeded
        flat = tensor.view(-1) if tensor.is_contiguous() else None
        starts = range(0, tensor.numel(), CHUNK) if flat is not None else range(1)

        def chunk(k: int, start: int) -> None:
            g = torch.Generator().manual_seed(chunk_seed(self.seed, scope, draw, k))
            with torch.no_grad():  # grad mode is per thread; the tensor may be a parameter
                part = tensor if flat is None else flat[start : start + CHUNK]
                part.normal_(mean, std, generator=g)

        self._pending += [self.pool.submit(chunk, k, s) for k, s in enumerate(starts)]


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``tensor``'s elements lie in, from its first to its last (non-negative
    strides, as every parameter has); an empty tensor's overlaps nothing."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()
