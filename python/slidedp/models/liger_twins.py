"""Meta-device twins of Liger Kernel's autograd Functions: on the ``meta`` device (where a Triton
kernel cannot run) each saves for its backward the tensors Liger's Function saves, so the
cost model (``plan.cost``) counts a Liger layer's activation memory, not transformers' eager
modules' (which keep float32 copies in every RMSNorm, the SiLU output beside the gate and
rotated copies of q and k). The outputs are empty tensors of the right shape: nothing on meta
has values. What each saves (liger-kernel 0.8.5):

- ``LigerRMSNormFunction``: the input as rows [N, H], the weight, one float32 rstd per row;
- ``LigerSiLUMulFunction``: the gate and up projections (its product is down_proj's input);
- ``LigerRopeFunction``: cos and sin only (q and k are rotated into new contiguous tensors).

Example::

    norm.forward = rms_norm_twin(norm)      # x on meta -> empty_like(x), Liger's saves
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Twin(torch.autograd.Function):
    """A forward that saves what Liger's Function saves; its backward never runs (the cost
    model counts saved tensors, it does not differentiate)."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise RuntimeError("a Liger twin counts saved tensors on meta; it does not train")


class _RMSNorm(_Twin):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight, x.new_empty(rows.shape[0], dtype=torch.float32))
        return torch.empty_like(x)


class _SiLUMul(_Twin):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.empty_like(gate)


class _Rope(_Twin):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        dense = torch.contiguous_format
        return torch.empty_like(q, memory_format=dense), torch.empty_like(k, memory_format=dense)


def rms_norm_twin(norm: nn.Module) -> Any:
    """``norm``'s forward as Liger's RMSNorm saves it."""
    return lambda x: _RMSNorm.apply(x, norm.weight)


def swiglu_mlp_twin(mlp: Any) -> Any:
    """``mlp``'s forward as ``LigerSwiGLUMLP`` runs it: the projections, then one SiLU-mul."""
    return lambda x: mlp.down_proj(_SiLUMul.apply(mlp.gate_proj(x), mlp.up_proj(x)))


def rope_twin(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_: Any, **__: Any
) -> Any:
    """``apply_rotary_pos_emb`` as Liger's rotary saves it."""
    return _Rope.apply(q, k, cos, sin)
