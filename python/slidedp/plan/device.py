"""The device and compute dtype a config resolves to (``runtime.device``, ``train.dtype``), and
the CUDA caching allocator's settings our engine runs with."""

from __future__ import annotations

import os

import torch

from slidedp.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "runtime.device=cuda but no CUDA device is available; "
            "set runtime.device=cpu (or auto), or run on a machine with a GPU"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


# The allocator's settings when the user gave none: expandable segments grow one mapping per stream
# instead of caching fixed blocks, so a layout that fills the card (GPU-resident layers beside
# offload arenas) does not fragment it. On the H100, Qwen3-8B B=16 with 20 resident layers reserved
# 78.3 GiB for 72.7 GiB allocated either way, but its compute lane took 3.38 s per step with fixed
# segments and 1.66 s with expandable ones (benchmarks/2026-11-24-autopolicy-h100.md, section
# "...: the allocator at the card's edge").
ALLOCATOR_DEFAULT = "expandable_segments:True"
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings() -> str:
    """The allocator settings of this process's environment ("" when none is set)."""
    return next((os.environ[v] for v in ALLOCATOR_VARIABLES if os.environ.get(v)), "")


def prefer_expandable_segments() -> None:
    """``ALLOCATOR_DEFAULT`` for this process and the ones it starts (ranks, validation
    trials), unless the user set the allocator's settings. The allocator reads them when CUDA
    initializes: call this first; after that it changes nothing here."""
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if not allocator_settings() and not initialized:
        os.environ[ALLOCATOR_VARIABLES[0]] = ALLOCATOR_DEFAULT
