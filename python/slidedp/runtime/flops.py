"""Model FLOPs of a training step and the measured bf16 GEMM peak of a device (for MFU).

Formula (``FLOPS_FORMULA``), training FLOPs per token of a dense decoder-only causal LM at
sequence length ``S``, two FLOPs per multiply-accumulate, forward + backward (backward = 2x
forward)::

    6 * N_matmul + 6 * sum over layers of S_eff * d_attn        ("causal half")

- ``N_matmul``: the *active* matmul weights, those one token multiplies by: every ``nn.Linear``
  of the model (q/k/v/o, gate/up/down, and the LM head, counted even when tied to the
  embedding) and, in a mixture-of-experts layer, ``top_k / experts`` of its experts' stacked
  weights (``models.shape.LayerShape``); MFU of an MoE is thus over active parameters. The
  embedding lookup, norms, biases and the router are not counted.
- attention: per layer and token, ``Q·Kᵀ`` and ``P·V`` are each ``2 * S * d_attn`` forward FLOPs
  over the full ``S x S`` score matrix (``d_attn = num_attention_heads * head_dim``), so
  ``12 * S * d_attn`` for training; a causal mask needs half of it, and we count that half
  (``6 * S * d_attn``). A sliding-window layer uses ``S_eff = min(S, sliding_window)``;
  each layer its own head dimension (Gemma 4's full-attention layers are wider), and a
  linear-attention layer (Qwen3.5's Gated DeltaNet) none: ``d_attn = 0``, its cost is linear
  in ``S`` through its matmuls, counted in ``N_matmul``.
- not counted: checkpoint recomputation (a second forward), the optimizer, transfers, softmax
  and elementwise work. MFU = model FLOP/s / measured peak, so recomputation lowers MFU.

Example::

    flops = model_flops_per_token(AutoConfig.from_pretrained(path), seq_len=1024)
    tflops = tokens_per_s * flops / 1e12
    peak = device_peak_flops(torch.device("cuda"))  # None on CPU
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
