"""How the host AdamW's speed depends on the values it updates (diagnostic): ``Kernels.adamw``
over ``--numel`` elements (a Qwen3-4B layer's ~101M by default) of BF16 gradient with the BF16
mirror written, for value sets that do or do not make f32 denormals (subnormal products cost
microcode assists on x86 unless the thread flushes them). Prints ms per update and GB/s at the
engine's 28 bytes per parameter (BF16 gradient in, f32 master and moments read and written, BF16
weights out)."""

from __future__ import annotations

import argparse
import time

import torch

from slidedp.kernels import Kernels


def state(numel: int, g_std: float, v_scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "param": torch.randn(numel, generator=gen) * 0.02,
        "exp_avg": torch.randn(numel, generator=gen) * g_std * 0.1,
        "exp_avg_sq": (torch.randn(numel, generator=gen) * g_std).square() * v_scale,
        "grad": (torch.randn(numel, generator=gen) * g_std).to(torch.bfloat16),
        "bf16_out": torch.empty(numel, dtype=torch.bfloat16),
    }


def subnormal(t: torch.Tensor) -> float:
    """The share of ``t``'s elements that are subnormal."""
    return float(((t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=101_000_000)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = Kernels(args.threads or torch.get_num_threads())
    cases = {  # name: (gradient std, v scale, grad_scale)
        "typical, scale 1": (1e-4, 1.0, 1.0),
        "typical, scale 0.05": (1e-4, 1.0, 0.05),
        "tiny gradients (g^2 subnormal)": (1e-21, 1.0, 1.0),
        "subnormal second moments": (1e-4, 1e-32, 1.0),
    }
    for name, (g_std, v_scale, grad_scale) in cases.items():
        s = state(args.numel, g_std, v_scale)
        times = []
        for step in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            kernels.adamw(
                s["param"],
                s["exp_avg"],
                s["exp_avg_sq"],
                s["grad"],
                lr=1e-5,
                betas=(0.9, 0.999),
                eps=1e-8,
                weight_decay=0.01,
                step=step,
                grad_scale=grad_scale,
                bf16_out=s["bf16_out"],
            )
            times.append(time.perf_counter() - t0)
        best = min(times[1:] or times)
        print(
            f"{name:34} {best * 1e3:7.1f} ms  {28 * args.numel / best / 1e9:6.1f} GB/s  "
            f"subnormal m {subnormal(s['exp_avg']):.3f} v {subnormal(s['exp_avg_sq']):.3f}  "
            f"threads {kernels.threads}",
            flush=True,
        )


if __name__ == "__main__":
    main()
