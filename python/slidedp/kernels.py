"""The host engine's SIMD kernels on CPU torch tensors (f32→bf16 cast, AdamW, sums, norms).

Every call releases the GIL and runs on the kernel set's own thread pool. The instruction-set
path is chosen at run time (``Kernels.detect_isa()``) or forced (``Kernels(isa="scalar")``).

Example::

    k = Kernels(threads=8)
    k.adamw(p, m, v, grad, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=1)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

from slidedp import _native
from slidedp.errors import InvalidArgumentError

if TYPE_CHECKING:
    from typing_extensions import Unpack

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class AdamWStep(TypedDict):
    """One AdamW step's hyper-parameters, as ``torch.optim.AdamW`` names them; ``step``:
    1-based, for the bias correction."""

    step: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


class AdamWArgs(AdamWStep, total=False):
    """``Kernels.adamw``'s keywords: the step, the gradient's scale (the clipping
    coefficient, 1.0 unless given) and where the updated weights also go as bfloat16."""

    grad_scale: float
    bf16_out: torch.Tensor | None


def _check(t: torch.Tensor, what: str, dtypes: Sequence[torch.dtype], numel: int) -> str:
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{what} must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise InvalidArgumentError(f"{what} must be {names}, got {t.dtype}")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what} must be contiguous")
    if t.numel() != numel:
        raise InvalidArgumentError(f"{what} has {t.numel()} elements, expected {numel}")
    return _DTYPE_NAMES[t.dtype]


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


class Kernels:
    """A kernel set bound to a thread pool of ``threads`` threads."""

    def __init__(self, threads: int | None = None, isa: str | None = None) -> None:
        self._native = _native.Kernels(default_threads() if threads is None else threads, isa)

    @staticmethod
    def detect_isa() -> str:
        return _native.Kernels.detect_isa()

    @staticmethod
    def supported_isas() -> list[str]:
        return _native.Kernels.supported_isas()

    @property
    def isa(self) -> str:
        return self._native.isa

    @property
    def threads(self) -> int:
        return self._native.threads

    def cast_f32_to_bf16(self, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Round-to-nearest-even f32→bf16, bit-exact with ``src.to(torch.bfloat16)``."""
        _check(src, "src", [torch.float32], src.numel())
        if out is None:
            out = torch.empty(src.shape, dtype=torch.bfloat16)
        _check(out, "out", [torch.bfloat16], src.numel())
        self._native.cast_f32_to_bf16(src.data_ptr(), out.data_ptr(), src.numel())
        return out

    def adamw(
        self,
        param: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        **hyper: Unpack[AdamWArgs],
    ) -> None:
        """One in-place AdamW step (``torch.optim.AdamW`` semantics) on f32 state; ``hyper``:
        the step's keywords (``AdamWArgs``).

        ``grad`` is float32 or bfloat16 and is multiplied by ``grad_scale`` first (the clipping
        coefficient); ``step`` is the 1-based step count for bias correction; with ``bf16_out``
        the updated weights are also written there as bfloat16.
        """
        n = param.numel()
        for t, what in ((param, "param"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
            _check(t, what, [torch.float32], n)
        grad_dtype = _check(grad, "grad", [torch.float32, torch.bfloat16], n)
        out_ptr = None
        bf16_out = hyper.get("bf16_out")
        if bf16_out is not None:
            _check(bf16_out, "bf16_out", [torch.bfloat16], n)
            out_ptr = bf16_out.data_ptr()
        beta1, beta2 = hyper["betas"]
        self._native.adamw(
            param.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            grad.data_ptr(),
            grad_dtype,
            n,
            lr=hyper["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=hyper["eps"],
            weight_decay=hyper["weight_decay"],
            step=hyper["step"],
            grad_scale=hyper.get("grad_scale", 1.0),
            bf16_out=out_ptr,
        )

    def sum_into(
        self, dst: torch.Tensor, srcs: Sequence[torch.Tensor], accumulate: bool = False
    ) -> torch.Tensor:
        """``dst = (dst if accumulate else 0) + srcs[0] + srcs[1] + ...`` in f32, left to right."""
        n = dst.numel()
        _check(dst, "dst", [torch.float32], n)
        pairs = [
            (s.data_ptr(), _check(s, f"srcs[{i}]", [torch.float32, torch.bfloat16], n))
            for i, s in enumerate(srcs)
        ]
        self._native.sum_into(dst.data_ptr(), pairs, n, accumulate)
        return dst

    def sum_squares(self, x: torch.Tensor) -> float:
        """Σ x² accumulated in float64 (the square of a global gradient norm, per buffer)."""
        dtype = _check(x, "x", [torch.float32, torch.bfloat16], x.numel())
        return self._native.sum_squares(x.data_ptr(), dtype, x.numel())
