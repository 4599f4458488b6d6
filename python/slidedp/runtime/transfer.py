"""Page-locking host memory for asynchronous DMA (the store's slots, the offload arenas)."""

from __future__ import annotations

import torch

from slidedp.errors import HostIOError


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
