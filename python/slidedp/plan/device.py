"""The device and compute dtype a config resolves to (``runtime.device``, ``train.dtype``)."""

from __future__ import annotations

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
