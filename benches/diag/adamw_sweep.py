"""The host AdamW over a whole model's state, layer by layer, as a step sweeps it (diagnostic):
``--layers`` groups of ``--numel`` elements (Qwen3-4B: 36 x ~101M), f32 master and moments,
BF16 gradients from a ring of 4 slots, the BF16 mirror written (pinned). Per-layer ms of the
engine's kernel for each sweep: forward order and backward order, alone, and with the GPU
copying one layer's mirror to the device beside each update, the layer just updated (the
clipped step's forward) or the next one (not yet updated this sweep; the backward's)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slidedp.kernels import Kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--numel", type=int, default=101_000_000)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--sweeps", type=int, default=2)
    args = parser.parse_args()
    n, layers = args.numel, args.layers
    kernels = Kernels(args.threads or torch.get_num_threads())
    t0 = time.perf_counter()
    state = {k: torch.full((layers * n,), 1e-3) for k in ("param", "exp_avg", "exp_avg_sq")}
    grads = (torch.randn(4, n) * 1e-4).to(torch.bfloat16)
    cuda = torch.cuda.is_available()
    mirror = torch.zeros(layers * n, dtype=torch.bfloat16, pin_memory=cuda)
    device = torch.empty(n, dtype=torch.bfloat16, device="cuda") if cuda else None
    stream = torch.cuda.Stream() if cuda else None
    print(
        f"allocated {sum(t.numel() * t.element_size() for t in state.values()) / 1e9:.1f} GB "
        f"of state in {time.perf_counter() - t0:.1f} s; threads {kernels.threads}",
        flush=True,
    )
    step = 0

    def sweep(order: list[int], copy: str) -> list[float]:
        nonlocal step
        step += 1
        times = []
        for i, layer in enumerate(order):
            other = {
                "just updated": order[i - 1] if i else None,
                "next": order[i + 1] if i + 1 < len(order) else None,
            }.get(copy)
            if other is not None and device is not None and stream is not None:
                with torch.cuda.stream(stream):
                    device.copy_(mirror[other * n : (other + 1) * n], non_blocking=True)
            lo, hi = layer * n, (layer + 1) * n
            start = time.perf_counter()
            kernels.adamw(
                state["param"][lo:hi],
                state["exp_avg"][lo:hi],
                state["exp_avg_sq"][lo:hi],
                grads[i % 4],
                lr=1e-5,
                betas=(0.9, 0.999),
                eps=1e-8,
                weight_decay=0.01,
                step=step,
                bf16_out=mirror[lo:hi],
            )
            times.append(time.perf_counter() - start)
            if stream is not None:
                stream.synchronize()
        return times

    forward, backward = list(range(layers)), list(reversed(range(layers)))
    sweep(forward, "")  # first touch
    for name, order, copy in (
        ("forward, alone", forward, ""),
        ("backward, alone", backward, ""),
        ("forward, H2D of the layer just updated", forward, "just updated"),
        ("backward, H2D of the next layer", backward, "next"),
    ):
        ms = [t * 1e3 for _ in range(args.sweeps) for t in sweep(order, copy)]
        print(
            f"{name:42} median {statistics.median(ms):6.1f} ms/layer  "
            f"max {max(ms):6.1f}  ({28 * n / statistics.median(ms) / 1e6:.0f} GB/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
