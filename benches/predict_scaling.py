"""Predictions (not measurements) of the step-time model for 1-8 GPUs of one H200 host, each route,
weak scaling (16 rows per GPU) and strong scaling (64 rows in all), for a 4- and 8-GPU machine not
yet measured (benchmarks/2026-11-24-predictions-4-8-gpus.md).

    .venv/bin/python benches/predict_scaling.py

Assumptions, from the 2xH200 machine (benchmarks/2026-11-22-two-gpus-h200.md and
benchmarks/2026-11-24-two-gpus-step-model-h200.md): copies 55 GB/s H2D and 54 GB/s D2H per GPU,
each GPU on its own PCIe link with no shared bottleneck (seen at 2 GPUs only); the layer-sized
reduce and all-gather at 250 and 260 GB/s (measured at 2 GPUs; NCCL's algorithm bandwidth falls
little with more GPUs on NVSwitch, not checked); host AdamW 185 GB/s (the x2 host's update lanes),
shared by all ranks: one update per layer and step; layer compute from FLOPs at
``plan.timing.LAYER_EFFICIENCY`` of the H200's dense bf16 peak; clipping 1.0, BF16 mirror, all
layers F."""

from __future__ import annotations

import torch

from slidedp.config_runtime import RuntimeSection
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.plan.policy import resolve_policy
from slidedp.plan.step_spec import predict_step
from slidedp.plan.timing import Links, Ranks, Rates, spec_from_shapes

PEAK = 989e12
LINKS = Links(h2d_gbps=55, d2h_gbps=54, reduce_gbps=250, gather_gbps=260, source="assumed")
HOST_GBPS = 185.0
ROUTES = (("replicated", "gpu"), ("sharded", "gpu"), ("replicated", "cpu"), ("sharded", "cpu"))


def step(adapter: HFAdapter, gpus: int, route: tuple[str, str], batch: int) -> float:
    param, grad = route
    runtime = RuntimeSection.from_keys(gpus=gpus, param_route=param, grad_route=grad)
    policy = resolve_policy(runtime, adapter, mirror=True, device=torch.device("cuda"))
    spec = spec_from_shapes(
        adapter, policy, batch=batch, seq_len=1024, rates=Rates(PEAK, HOST_GBPS, links=LINKS),
        clipping=True, offloaded_bytes=[0] * adapter.num_layers, ranks=Ranks(gpus, grad, param),
    )  # fmt: skip
    return float(predict_step(spec).step_s)


def main() -> None:
    print("PREDICTIONS of the step-time model (assumptions: benches/predict_scaling.py)")
    for shape in ("qwen3-8b", "qwen3-14b"):
        adapter = HFAdapter(resolve_shape(shape))
        for scaling, rows in (("weak, 16 rows per GPU", None), ("strong, 64 rows in all", 64)):
            print(f"{shape}, S=1024, {scaling}: tokens/s (efficiency vs 1 GPU)")
            for route in ROUTES:
                cells = []
                base = None
                for gpus in (1, 2, 4, 8):
                    batch = 16 if rows is None else rows // gpus
                    tokens = batch * gpus * 1024 / step(adapter, gpus, route, batch)
                    base = base or tokens
                    gain = tokens / base / gpus if rows is None else tokens / base
                    cells.append(f"{gpus}: {tokens:8,.0f} ({gain:.0%})" if rows is None
                                 else f"{gpus}: {tokens:8,.0f} ({gain:.2f}x)")  # fmt: skip
                print(f"  {'/'.join(route):<15} " + "  ".join(cells))


if __name__ == "__main__":
    main()
