"""The GPU-resident update's time on the device: what a step of a model with every layer and
the embeddings resident spends after its backward (the ~80 ms that kept AutoPolicy under the
compute-only reference at B >= 16 on the H100: benchmarks/2026-11-24-autopolicy-h100.md,
"The offload fix and the embeddings on the GPU; the resident update in one pass").

Both variants update every parameter of the shape as ``runtime.resident`` holds them (one
group per layer, the embedding and the head, in the store's layout; FP32 master and moments,
BF16 gradient and weights):
- ``engine``: ``resident.adamw_single_pass`` with its compiled pass, what the engine runs:
  BF16 gradient in, master, moments and BF16 weights out in one pass (28 B/param);
- ``torch-fused`` (the baseline, the engine's update before): torch's fused AdamW on an f32
  copy of the gradient scaled by the clip coefficient, then the weights' cast (~48 B/param).

Run on the GPU machine: ``python3 benches/resident_update.py --shape qwen3-4b``. Prints ms per
update and the engine's speed-up over the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.runtime.grad_lane import AdamArgs
from slidedp.runtime.resident import (
    REGIONS,
    _compiled_pass,
    _Group,
    adamw_single_pass,
    group_params,
    hyperparameters,
)
from slidedp.runtime.window import DeviceBuffer
from slidedp.store import HostStore

ADAM = AdamArgs(step=7, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_scale=0.5,
                version=0)  # fmt: skip
Grads = dict[str, torch.Tensor]


def model_groups(shape: str, device: torch.device) -> list[tuple[_Group, Grads]]:
    """Every group of the shape (embedding, decoder layers, head) as ``ResidentLayers`` holds
    it, in the store's layout (``HostStore.plan``), with a random BF16 gradient."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(resolve_shape(shape).to_dict()))
        specs = HFAdapter.from_dir(tmp).group_specs()
    layout = HostStore.plan(specs, 0)
    groups = []
    for i, spec in enumerate(layout.groups):
        params = group_params(layout, i)
        state = {r: torch.zeros(spec.state_len, device=device) for r in REGIONS}
        state["master"].normal_(0.0, 0.02)
        weights = DeviceBuffer(spec.slot_len, torch.bfloat16, device)
        grads = {p.name: torch.randn(p.numel, device=device).bfloat16() for p in params}
        groups.append((_Group(i, params, state, weights), grads))
    return groups


def engine(groups: list[tuple[_Group, Grads]]) -> None:
    device = groups[0][0].state["master"].device
    hyper = {d: hyperparameters(ADAM, d, device) for d in (True, False)}
    scale = torch.tensor([ADAM.grad_scale, 1.0], device=device)
    for g, grads in groups:
        adamw_single_pass(g, grads, hyper, scale, _compiled_pass())


def torch_fused(groups: list[tuple[_Group, Grads]]) -> None:
    step = torch.tensor(float(ADAM.step), device=groups[0][0].state["master"].device)
    for g, grads in groups:
        for decays in (True, False):
            params = [p for p in g.params if p.decays == decays]
            if not params:  # a group of norms alone (the tied head's)
                continue
            g32 = [grads[p.name].float() for p in params]
            torch._foreach_mul_(g32, ADAM.grad_scale)
            torch._fused_adamw_(
                [g.view("master", p) for p in params], g32,
                [g.view("exp_avg", p) for p in params], [g.view("exp_avg_sq", p) for p in params],
                [], [step] * len(params), lr=ADAM.lr, beta1=ADAM.betas[0], beta2=ADAM.betas[1],
                weight_decay=ADAM.weight_decay if decays else 0.0, eps=ADAM.eps, amsgrad=False,
                maximize=False)  # fmt: skip
        for p in g.params:
            g.weights.flat[p.slot_at : p.slot_at + p.numel].copy_(g.view("master", p))


def timed(fn: Callable[[list[tuple[_Group, Grads]]], None], groups: list[tuple[_Group, Grads]],
          reps: int) -> float:  # fmt: skip
    for _ in range(2):  # warm-up (and compilation)
        fn(groups)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(groups)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-4b")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    groups = model_groups(args.shape, torch.device("cuda"))
    numel = sum(p.numel for g, _ in groups for p in g.params)
    ms = {"torch-fused": timed(torch_fused, groups, args.reps),
          "engine": timed(engine, groups, args.reps)}  # fmt: skip
    for name, t in ms.items():
        print(f"{name:12s} {t:7.1f} ms per update of {numel * 1e-9:.2f} B params, "
              f"{28 * numel / t * 1e-9:.2f} TB/s at 28 B/param")  # fmt: skip
    print(f"engine: {ms['torch-fused'] / ms['engine']:.2f}x torch's fused AdamW and cast")
    print(json.dumps({"shape": args.shape, "params": numel, "ms": ms}))


if __name__ == "__main__":
    main()
