"""The ``slidedp`` command.

Run: ``slidedp env``, ``slidedp bench kernels [--numel N --threads 1,2,4]``,
``slidedp train CONFIG.yaml`` (the training engine is being built: it says so and exits 2).
"""

from __future__ import annotations

import argparse
import os
import sys

from slidedp import __version__
from slidedp.bench import kernels as bench_kernels
from slidedp.kernels import Kernels, default_threads

NOT_YET = (
    "slidedp train: the layer-streaming training engine is not built yet (issue #3); "
    "the host engine (store, kernels) is: try `slidedp env` or `slidedp bench kernels`."
)


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
    train.add_argument("config")
    train.add_argument("overrides", nargs="*")
    bench = verbs.add_parser("bench", help="benchmarks against in-run baselines")
    which = bench.add_subparsers(dest="bench", required=True)
    bench_kernels.add_arguments(which.add_parser("kernels", help="AdamW and cast vs torch"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb == "env":
        return _env()
    if args.verb == "train":
        print(NOT_YET, file=sys.stderr)
        return 2
    return bench_kernels.main(args)


if __name__ == "__main__":
    sys.exit(main())
