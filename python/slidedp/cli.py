"""The ``slidedp`` command.

Run: ``slidedp env``, ``slidedp bench kernels [--numel N --threads 1,2,4]``,
``slidedp train CONFIG.yaml [section.key=value ...]`` (e.g. ``train.max_steps=5``).
"""

from __future__ import annotations

import argparse
import os
import sys

from slidedp import __version__
from slidedp.bench import kernels as bench_kernels
from slidedp.kernels import Kernels, default_threads


def _train(config: str, overrides: list[str]) -> int:
    """``slidedp train CONFIG.yaml [section.key=value ...]``: one clear line on bad input."""
    from slidedp.config import load_config
    from slidedp.errors import SlidedpError
    from slidedp.runtime.trainer import train

    try:
        train(load_config(config, overrides))
    except SlidedpError as e:
        print(f"slidedp train: error: {e}", file=sys.stderr)
        return 2
    return 0


def _env() -> int:
    import torch

    shm = os.statvfs("/dev/shm")
    print(f"slidedp {__version__}, torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(
        f"host kernels: best ISA {Kernels.detect_isa()} (supported: "
        f"{', '.join(Kernels.supported_isas())}), {default_threads()} threads available"
    )
    print(f"/dev/shm: {shm.f_bavail * shm.f_frsize / 2**30:.1f} GiB free")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"GPUs: {gpus}" + (f" ({', '.join(names)})" if names else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slidedp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"slidedp {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("env", help="versions, ISA path, GPUs, shm size")
    train = verbs.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config", help="YAML with model, data, train, output (and runtime)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=5")
    bench = verbs.add_parser("bench", help="benchmarks against in-run baselines")
    which = bench.add_subparsers(dest="bench", required=True)
    bench_kernels.add_arguments(which.add_parser("kernels", help="AdamW and cast vs torch"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb == "env":
        return _env()
    if args.verb == "train":
        return _train(args.config, args.overrides)
    return bench_kernels.main(args)


if __name__ == "__main__":
    sys.exit(main())
