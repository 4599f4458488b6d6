"""SDPA's causal attention on one GPU at long sequences: the rate ``plan.timing``'s
``attention_efficiency`` prices attention's quadratic term at (the share of the dense bf16
peak that its counted FLOPs reach, forward once and backward as twice the forward).

Run on a GPU (one H200 or H100; a few seconds per length)::

    python benches/attention_rate.py --shape qwen3-14b --context 4 --seq 65536 131072 262144
    python benches/attention_rate.py --shape qwen3-8b --context 4 --seq 524288 1048576

``--context R``: one Ulysses rank's heads (H/R query and Hkv/R key/value heads over the whole
sequence). The key/value heads are repeated to the query heads as transformers' SDPA path
does (``--gqa``: SDPA's ``enable_gqa`` instead, nothing repeated). ``--backends flash cudnn``
times each SDPA backend named (``default``: torch's own choice, what the layers run). Prints one
JSON line per length and backend: forward and backward ms, counted TFLOP/s and the share of
``plan.machine``'s peak, to compare with ``attention_efficiency`` at that length (fitted on
whole context-parallel steps: this times the kernel alone); a backend that refuses the shape
prints its error instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import repeat_kv

from slidedp.models.shapes import SHAPES
from slidedp.plan.attention_rate import attention_efficiency
from slidedp.plan.machine import gpu_peak


def _timed_ms(call: Callable[[], object], repeats: int) -> float:
    """Median of ``repeats`` timed calls after one warm-up (CUDA events)."""
    call()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def measure(
    shape: str, seq: int, context: int, repeats: int, *, backend: str = "default", gqa: bool = False
) -> dict[str, float | int | str | bool]:
    """Forward and forward + backward of one rank's attention at ``seq`` tokens, on SDPA's
    ``backend`` (``default``: torch's choice)."""
    config = SHAPES[shape]
    all_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // all_heads)
    heads = all_heads // context
    kv_heads = int(config.get("num_key_value_heads") or all_heads) // context
    dev = torch.device("cuda")
    q = torch.randn(1, heads, seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, device=dev, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))  # fmt: skip
    groups = heads // kv_heads

    def forward() -> torch.Tensor:
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True
        )

    chosen = sdpa_kernel(BACKENDS[backend]) if backend in BACKENDS else contextlib.nullcontext()
    with chosen:
        return _rates(forward, repeats, heads * head_dim * seq * seq) | {
            "shape": shape, "seq": seq, "context": context, "heads": heads,
            "backend": backend, "gqa": gqa, "model_share": round(attention_efficiency(seq), 4),
        }  # fmt: skip


def _rates(forward: Callable[[], torch.Tensor], repeats: int, sq_d: int) -> dict[str, float | str]:
    """Timings and rates of ``forward`` and its backward; ``sq_d`` = heads x head_dim x S x S."""
    out = forward()
    grad = torch.randn_like(out)

    def both() -> None:
        forward().backward(grad)  # type: ignore[no-untyped-call]

    forward_ms = _timed_ms(forward, repeats)
    total_ms = _timed_ms(both, repeats)
    counted = 2 * sq_d  # the model's forward: 2 d_q x S x tokens
    rate = 3 * counted / (total_ms / 1000)  # forward + backward as twice it
    device = torch.cuda.get_device_name(out.device)
    peak = gpu_peak(device)[0] or float("nan")
    return {
        "forward_ms": round(forward_ms, 2), "backward_ms": round(total_ms - forward_ms, 2),
        "counted_tflops": round(rate / 1e12, 1), "share_of_peak": round(rate / peak, 4),
        "device": device,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-14b", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, nargs="+", default=[65536, 131072, 262144])
    parser.add_argument("--context", type=int, default=1, help="Ulysses ranks (H/R heads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["default"],
                        choices=["default", *BACKENDS])  # fmt: skip
    parser.add_argument("--gqa", action="store_true", help="enable_gqa, no repeated key/values")
    args = parser.parse_args()
    for seq in args.seq:
        for backend in args.backends:
            try:
                row = measure(args.shape, seq, args.context, args.repeats, backend=backend,
                              gqa=args.gqa)  # fmt: skip
            except RuntimeError as err:  # the backend refuses this shape or this GPU
                row = {"seq": seq, "backend": backend, "error": str(err).splitlines()[0]}
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
