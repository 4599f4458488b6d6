"""Model FLOPs of a training step and the measured bf16 GEMM peak of a device (for MFU).

``FLOPS_FORMULA``, training FLOPs per token at sequence length ``S`` (forward + backward)::

    6 * N_matmul + 6 * sum over layers of S_eff * d_attn        ("causal half")

``N_matmul``: the active matmul weights (every ``nn.Linear``, the LM head even when tied, and
``top_k / experts`` of a mixture's experts); ``d_attn = heads * head_dim`` per layer (0 for
linear attention), ``S_eff = min(S, sliding_window)``. Not counted: recomputation, optimizer,
transfers, elementwise work, so recomputation lowers MFU (model FLOP/s / measured peak).

Example::

    flops = model_flops_per_token(AutoConfig.from_pretrained(path), seq_len=1024)
"""

from __future__ import annotations

import functools

import torch
from transformers import PretrainedConfig

from slidedp.errors import InvalidArgumentError
from slidedp.models.shape import layer_shapes

FLOPS_FORMULA = (
    "6*N_matmul(active) + 6*L*S*d_attn (causal half; MoE: top_k of the experts' weights; "
    "LM head counted, embedding not)"
)


def matmul_params(config: PretrainedConfig) -> int:
    """``N_matmul`` of the model ``config`` describes: its layers' active matmul weights
    (``models.shape``) plus the LM head."""
    layers = sum(s.matmul_params for s in layer_shapes(config, seq_len=1))
    return layers + int(config.vocab_size) * int(config.hidden_size)


def model_flops_per_token(config: PretrainedConfig, seq_len: int) -> float:
    """Training model FLOPs per token at ``seq_len`` by ``FLOPS_FORMULA``, from the layers'
    shapes (``models.shape``) plus the LM head."""
    if seq_len < 1:
        raise InvalidArgumentError(f"seq_len must be >= 1, got {seq_len}")
    attention = 6 * sum(s.q_dim * s.attended for s in layer_shapes(config, seq_len))
    return float(6 * matmul_params(config) + attention)  # the LM head counted even when tied


def device_peak_flops(device: torch.device) -> float | None:
    """Measured dense bf16 GEMM FLOP/s of a CUDA ``device`` (cached per process); None on CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _measure_gemm_peak(index)


@functools.cache
def _measure_gemm_peak(index: int, n: int = 8192, repeats: int = 5, burst: int = 4) -> float:
    """Best of ``repeats`` timed bursts of ``burst`` back-to-back ``n³`` bf16 matmuls (CUDA
    events around each burst), after a warm-up."""
    with torch.cuda.device(index):
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):  # warm-up: cuBLAS heuristics, clocks up
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize()
        best_ms = float("inf")
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(burst):
                torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            best_ms = min(best_ms, start.elapsed_time(end) / burst)
        del a, b, out
        torch.cuda.empty_cache()
    return 2.0 * n**3 / (best_ms / 1000.0)
