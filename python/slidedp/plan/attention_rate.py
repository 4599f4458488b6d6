"""The rate the step-time model prices attention's quadratic term at: a share of the dense bf16
peak that depends on how many keys a query row streams (``attention_efficiency``), measured
apart from the layers' matmuls (``plan.timing.LAYER_EFFICIENCY``, a layer of 1,024-token rows).

Example::

    attention_efficiency(262_144) * 989e12  # FLOP/s of attention at 262,144 keys on an H100
"""

from __future__ import annotations

import math

# The share of the dense bf16 peak that attention's quadratic term (``LayerShape.attended``:
# its counted FLOPs, the backward as twice the forward) reaches at long sequences in SDPA's
# flash kernel (cuDNN's on Hopper), which ``plan.timing.LAYER_EFFICIENCY`` (a layer of
# 1,024-token rows, 4% of its FLOPs attention's) does not measure. From the compute-only
# reference of Qwen3-4B at 131,072 tokens on one H100, every layer F
# (benchmarks/2026-11-24-moe-long-context-h100.md, "Long sequences"): 49.55 s a step, of
# which the layers' matmuls and the head at LAYER_EFFICIENCY take 11.40 s; attention's
# 2.03e16 FLOPs (forward, replay, backward) take the other 38.15 s: 531 TFLOP/s, 53.7% of 989.
ATTENTION_EFFICIENCY = 0.537
# Beyond that row the rate falls by a share of the peak per doubling of the keys a query row
# streams (``attention_efficiency``). Four context-parallel runs on H200s, every layer F (the
# rate each one needs, their steps less the matmuls and head at LAYER_EFFICIENCY): Qwen3-8B at
# 131,072 keys 0.529, Qwen3-14B at 262,144 0.505 and 524,288 0.462, Qwen3-8B at 1,048,576 0.451
# (benchmarks/2026-11-28-context-parallel-{2,4}xh200.md); the least-squares slope through 0.537
# at the knee. One constant for all four misses one end by 6% (0.483: 131K +6%, 1M -6%); a
# likely cause, not traced: a head's keys and values (S x d x 4 B, 64 MiB at 131,072 keys)
# outgrow the GPU's 50 MB L2, so the kernel's query tiles share fewer of their reads.
ATTENTION_KNEE_KEYS = 131072
ATTENTION_EFFICIENCY_PER_DOUBLING = 0.0314


def attention_efficiency(keys: int) -> float:
    """The share of the dense bf16 peak attention's quadratic term reaches over rows of ``keys``
    keys a query sees (``LayerShape.attended``): ``ATTENTION_EFFICIENCY`` up to
    ``ATTENTION_KNEE_KEYS``, less ``ATTENTION_EFFICIENCY_PER_DOUBLING`` per doubling beyond."""
    doublings = max(0.0, math.log2(max(keys, 1) / ATTENTION_KNEE_KEYS))
    return ATTENTION_EFFICIENCY - ATTENTION_EFFICIENCY_PER_DOUBLING * doublings
