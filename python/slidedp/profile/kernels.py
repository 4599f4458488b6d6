"""``slidedp profile layer --kernels eager,liger,compiled,liger+compiled --shape qwen3-8b
--batch 16 --seq-len 1024 --json F``: one decoder layer's forward + backward (no replay: the
``N`` executor, the engine's own) under each layer-compute variant (``models.fast``), with its
model TFLOP/s (the bench's formula for one layer: ``6 * matmul weights + 6 * S_eff * d_attn``
per token, ``runtime.flops``) and its kernels with their share of the time.

A variant is ``eager``, ``liger``, ``compiled`` or ``liger+compiled``; one that cannot run here
(Liger on CPU, or not installed; ``liger+compiled`` on CUDA, refused since it failed the GPU
parity test) is reported as skipped with the reason. Times are the median
of ``--steps`` after ``--warmup`` (a compiled variant compiles in its warm-up). The breakdown
is one more step under ``torch.profiler``: on CUDA its GPU kernels by self device time (which
attention kernel SDPA picked shows there: flash, cuDNN or memory-efficient), on CPU the aten
operators by self CPU time; ``--top`` rows, each with its share of the total.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import PretrainedConfig

from slidedp.errors import ConfigError
from slidedp.models.fast import Compute, apply_compute, resolve_compute
from slidedp.models.hf import HFAdapter
from slidedp.models.shape import layer_shapes
from slidedp.models.shapes import resolve_shape
from slidedp.plan.device import pick_device, pick_dtype
from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations import LayerRun, executor_for
from slidedp.runtime.lanes import synchronize

VARIANTS = ("eager", "liger", "compiled", "liger+compiled")


def layer_flops(config: PretrainedConfig, batch: int, seq_len: int) -> float:
    """Model FLOPs of one decoder layer's forward + backward (the first layer's shape)."""
    shape = layer_shapes(config, seq_len)[0]
    return batch * seq_len * 6.0 * (shape.matmul_params + shape.q_dim * shape.attended)


def _compute(variant: str, device: torch.device, adapter: HFAdapter, backend: str) -> Compute:
    if variant not in VARIANTS:
        raise ConfigError(f"--kernels: unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    kernels = "liger" if variant.startswith("liger") else "eager"
    compute = resolve_compute(kernels, "compiled" in variant, device, adapter)
    return Compute(compute.kernels, backend if compute.compile else "")


def breakdown(step: Any, device: torch.device, top: int) -> list[dict[str, Any]]:
    """The kernels (CUDA) or aten operators (CPU) of one ``step()``, by self time, ``top``
    rows with their share of the total."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type.name == "CUDA":
            rows.append((e.key, e.self_device_time_total, e.count))
        elif not cuda and e.key.startswith("aten::") and e.self_cpu_time_total > 0:
            rows.append((e.key, e.self_cpu_time_total, e.count))
    total = sum(us for _, us, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    return [
        {"kernel": name, "time_ms": us / 1e3, "share": us / total, "calls": count}
        for name, us, count in rows[:top]
    ]


def layer_inputs(
    adapter: HFAdapter,
    batch: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    layer: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
    gen = torch.Generator(device).manual_seed(0)
    group = adapter.groups[adapter.layer_group(layer)]
    shapes = adapter.shapes()
    params = {}
    for full, local in group.params:
        t = torch.empty(shapes[full], device=device, dtype=dtype)
        params[local] = t.normal_(0.0, 0.02, generator=gen) if t.dim() > 1 else t.fill_(1.0)
    x = torch.randn(batch, seq_len, adapter.hidden_size, device=device, dtype=dtype, generator=gen)
    position_ids = torch.arange(seq_len, device=device).unsqueeze(0)
    rotary = adapter.position_embeddings(adapter.make_rotary(device), x, position_ids)
    ctx = {
        "position_ids": position_ids,
        "position_embeddings": [(cos.to(dtype), sin.to(dtype)) for cos, sin in rotary],
        "masks": adapter.layer_masks(x, None, position_ids),
    }
    return params, x, ctx


def measure_variant(
    config: PretrainedConfig,
    variant: str,
    batch: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One variant on a fresh adapter (Liger patches the modules it is given)."""

    adapter = HFAdapter(config)
    try:
        compute = _compute(variant, device, adapter, args.backend)
    except ConfigError as e:
        return {"variant": variant, "skipped": str(e)}
    apply_compute(adapter, compute)
    params, x, ctx = layer_inputs(adapter, batch, seq_len, device, dtype)
    executor = executor_for(LayerPolicy("N"))
    g = torch.ones_like(x)

    def step() -> None:
        _, state = executor.forward(LayerRun(adapter, 0, params, ctx), x)
        executor.backward(LayerRun(adapter, 0, params, ctx), state, g)

    times = []
    for i in range(args.warmup + args.steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    kernels = breakdown(step, device, args.top)
    step_s = statistics.median(times)
    return {
        "variant": variant,
        "compute": compute.describe(),
        "step_ms": step_s * 1e3,
        "tflops": layer_flops(config, batch, seq_len) / step_s / 1e12,
        "kernels": kernels,
    }


def profile_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant of ``args.kernels`` on ``args.shape``'s first layer."""

    config = resolve_shape(args.shape)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    variants = [v.strip() for v in args.kernels.split(",") if v.strip()]
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "layer_flops": layer_flops(config, args.batch, args.seq_len),
        "variants": [
            measure_variant(config, v, args.batch, args.seq_len, device, dtype, args)
            for v in variants
        ],
    }


def format_kernels(report: dict[str, Any]) -> str:
    lines = [
        f"slidedp profile layer --kernels: B={report['batch']} x S={report['seq_len']}, "
        f"{report['dtype']} on {report['gpu']}, one layer fwd+bwd (no replay), "
        f"{report['layer_flops'] / 1e12:.2f} TFLOP per step"
    ]
    for v in report["variants"]:
        if "skipped" in v:
            lines.append(f"  {v['variant']:<15} skipped: {v['skipped']}")
            continue
        lines.append(
            f"  {v['variant']:<15} {v['step_ms']:8.2f} ms {v['tflops']:8.1f} TFLOP/s  "
            f"({v['compute']})"
        )
        for k in v["kernels"]:
            lines.append(f"      {k['share']:6.1%} {k['time_ms']:8.2f} ms x{k['calls']:<4} "
                         f"{k['kernel'][:90]}")  # fmt: skip
    return "\n".join(lines)
