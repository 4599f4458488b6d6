"""Host kernel benchmark: our AdamW and f32→bf16 cast against torch's, in the same process.

Run: ``make bench-kernels`` or ``slidedp bench kernels --numel 268435456 --threads 1,2,4,8,16``.

For each thread count it times, on one ``numel``-element layer (median of ``--repeats`` after a
warm-up): our AdamW with f32 gradients vs ``torch.optim.AdamW(fused=True)`` on the same tensors;
our AdamW with bf16 gradients and fused bf16 emission vs torch fused AdamW followed by
``staging.copy_(param)``; our cast vs torch's ``dst.copy_(src)`` into a preallocated bf16 tensor.
Bytes touched per element: AdamW 28 (read p, m, v, g; write p, m, v), with bf16 grads and emission
28 (26 + 2 written), torch AdamW + copy 34 (28 + 4 read + 2 written), cast 6 (read 4, write 2).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from slidedp.bench.provenance import write_report
from slidedp.cli_args import count, counts, writable
from slidedp.kernels import Kernels, default_threads

HP = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclass
class Row:
    threads: int
    isa: str
    adamw_gbps: float
    adamw_gparams: float
    torch_adamw_gbps: float
    adamw_ratio: float
    adamw_emit_gbps: float
    torch_adamw_copy_gbps: float
    adamw_emit_ratio: float
    cast_gbps: float
    torch_cast_gbps: float
    cast_ratio: float


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first touch, thread start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class _Layer:
    """One layer's tensors, shared by our kernels and torch's optimizer."""

    param: torch.Tensor
    grad: torch.Tensor
    grad_bf16: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    staging: torch.Tensor
    torch_param: torch.nn.Parameter
    torch_opt: torch.optim.Optimizer

    @classmethod
    def make(cls, numel: int) -> _Layer:
        gen = torch.Generator().manual_seed(0)
        param = torch.randn(numel, generator=gen)
        grad = torch.randn(numel, generator=gen) * 1e-3
        torch_param = torch.nn.Parameter(param.clone())
        torch_param.grad = grad
        return cls(
            param=param,
            grad=grad,
            grad_bf16=grad.to(torch.bfloat16),
            exp_avg=torch.zeros(numel),
            exp_avg_sq=torch.zeros(numel),
            staging=torch.empty(numel, dtype=torch.bfloat16),
            torch_param=torch_param,
            torch_opt=torch.optim.AdamW([torch_param], fused=True, **HP),  # type: ignore[arg-type]
        )


def _measure(layer: _Layer, threads: int, repeats: int, isa: str | None) -> Row:
    torch.set_num_threads(threads)
    kernels = Kernels(threads=threads, isa=isa)
    step = 0

    def ours(grad: torch.Tensor, out: torch.Tensor | None = None) -> None:
        nonlocal step
        step += 1
        kernels.adamw(
            layer.param,
            layer.exp_avg,
            layer.exp_avg_sq,
            grad,
            step=step,
            bf16_out=out,
            **HP,  # type: ignore[arg-type]
        )

    def torch_adamw_copy() -> None:
        layer.torch_opt.step()
        layer.staging.copy_(layer.torch_param.detach())

    s_adamw = _median_seconds(lambda: ours(layer.grad), repeats)
    s_torch = _median_seconds(layer.torch_opt.step, repeats)
    s_emit = _median_seconds(lambda: ours(layer.grad_bf16, layer.staging), repeats)
    s_torch_copy = _median_seconds(torch_adamw_copy, repeats)
    s_cast = _median_seconds(lambda: kernels.cast_f32_to_bf16(layer.param, layer.staging), repeats)
    s_torch_cast = _median_seconds(lambda: layer.staging.copy_(layer.param), repeats)
    gb = layer.param.numel() / 1e9
    return Row(
        threads=threads,
        isa=kernels.isa,
        adamw_gbps=28 * gb / s_adamw,
        adamw_gparams=gb / s_adamw,
        torch_adamw_gbps=28 * gb / s_torch,
        adamw_ratio=s_torch / s_adamw,
        adamw_emit_gbps=28 * gb / s_emit,
        torch_adamw_copy_gbps=34 * gb / s_torch_copy,
        adamw_emit_ratio=s_torch_copy / s_emit,
        cast_gbps=6 * gb / s_cast,
        torch_cast_gbps=6 * gb / s_torch_cast,
        cast_ratio=s_torch_cast / s_cast,
    )


def run(numel: int, threads: list[int], repeats: int, isa: str | None) -> list[Row]:
    layer = _Layer.make(numel)
    rows = []
    for t in threads:
        rows.append(_measure(layer, t, repeats, isa))
        print(_format(rows[-1]), flush=True)
    return rows


HEADER = (
    "threads isa    | AdamW GB/s Gparam/s | torch fused GB/s  ratio | AdamW+bf16 emit GB/s | "
    "torch AdamW+copy GB/s  ratio | cast GB/s | torch cast GB/s  ratio"
)


def _format(r: Row) -> str:
    return (
        f"{r.threads:7d} {r.isa:6s} | {r.adamw_gbps:10.1f} {r.adamw_gparams:8.2f} | "
        f"{r.torch_adamw_gbps:16.1f} {r.adamw_ratio:6.2f}x | {r.adamw_emit_gbps:20.1f} | "
        f"{r.torch_adamw_copy_gbps:21.1f} {r.adamw_emit_ratio:6.2f}x | {r.cast_gbps:9.1f} | "
        f"{r.torch_cast_gbps:15.1f} {r.cast_ratio:6.2f}x"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    n = default_threads()
    default = ",".join(map(str, sorted({1, 2, 4, 8, 16, n} & set(range(1, n + 1)))))
    arg = parser.add_argument
    arg("--numel", type=count(1), default=256 * 2**20, help="elements per layer")
    arg("--threads", type=counts, default=counts(default), help="e.g. 1,2,4,8,16")
    arg("--repeats", type=count(1), default=5, help="timed calls per figure (the median)")
    arg("--isa", default=None, help="force scalar|avx2|avx512 (default: best)")
    arg("--json", default=None, help="also write the rows and this run's facts to this JSON file")


def main(args: argparse.Namespace) -> int:
    writable("--json", args.json)
    print(
        f"slidedp kernel benchmark: numel={args.numel}, torch {torch.__version__}, "
        f"best ISA {Kernels.detect_isa()}, {default_threads()} cores available"
    )
    print(HEADER, flush=True)
    rows = run(args.numel, args.threads, args.repeats, args.isa)
    write_report(args.json, [asdict(r) for r in rows])
    return 0
