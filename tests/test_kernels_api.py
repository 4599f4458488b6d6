"""Kernel entry points: argument checks, typed errors, ISA selection, GIL release."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slidedp import _native, errors
from slidedp.kernels import Kernels

HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def test_bad_arguments_are_typed_errors() -> None:
    k = Kernels(threads=1)
    p, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(errors.InvalidArgumentError, match="grad has 7 elements"):
        k.adamw(p, m, v, torch.zeros(7), step=1, **HP)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match=r"must be torch\.float32"):
        k.adamw(p, m, v.double(), torch.zeros(8), step=1, **HP)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="contiguous"):
        k.cast_f32_to_bf16(torch.zeros(4, 4).t())
    with pytest.raises(errors.InvalidArgumentError, match="step"):
        k.adamw(p, m, v, torch.zeros(8), step=0, **HP)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError):
        Kernels(threads=0)
    assert issubclass(errors.InvalidArgumentError, ValueError)


def test_the_native_layer_rejects_overlapping_outputs() -> None:
    k = _native.Kernels(1)
    buf = torch.zeros(64)
    ptr = buf.data_ptr()
    with pytest.raises(errors.InvalidArgumentError, match="overlaps"):
        k.adamw(
            ptr,
            ptr + 64,
            ptr + 128,
            ptr + 192,
            "float32",
            32,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            step=1,
        )
    with pytest.raises(errors.InvalidArgumentError, match="aligned"):
        k.cast_f32_to_bf16(ptr + 1, ptr + 128, 4)


def test_isa_selection_and_unsupported_paths() -> None:
    best = Kernels.detect_isa()
    assert best in Kernels.supported_isas()
    assert "scalar" in Kernels.supported_isas()
    assert Kernels(threads=2, isa="scalar").isa == "scalar"
    assert Kernels(threads=3).threads == 3
    with pytest.raises(errors.InvalidArgumentError, match="unknown ISA"):
        Kernels(isa="sse9")
    unsupported = {"avx2", "avx512"} - set(Kernels.supported_isas())
    for name in unsupported:
        with pytest.raises(errors.IsaUnsupportedError):
            Kernels(isa=name)


def test_kernel_calls_release_the_gil() -> None:
    """Two Python threads' kernel calls overlap in time only if the GIL is released."""
    n = 8 * 2**20
    spans: list[tuple[float, float]] = []

    def work() -> None:
        k = Kernels(threads=1, isa="scalar")
        p, m, v, g = (torch.full((n,), 0.5) for _ in range(4))
        start = time.perf_counter()
        for step in range(1, 4):
            k.adamw(p, m, v, g, step=step, **HP)  # type: ignore[arg-type]
        spans.append((start, time.perf_counter()))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a0, a1), (b0, b1) = spans
    overlap = min(a1, b1) - max(a0, b0)
    assert overlap > 0.3 * min(a1 - a0, b1 - b0), spans
