"""Golden loss curves: the CPU float32 loss, gradient norm (and a mixture of experts' aux_loss)
of every step, and a digest of the final parameters, of short trainings of the tiny test models
(tests/engine/tiny.py) on every gradient and parameter route (2 ranks), every activation family
(partly offloaded), GPU-resident state (1 and 2 ranks) and a mixture of experts; compared bit
for bit with tests/assets/losses/CASE.json.

    python scripts/loss_golden.py --check              # exit 1, listing (case, step, old, new)
    python scripts/loss_golden.py --regenerate [CASE]  # on purpose: rewrite, list what changed

A refactor of a schedule, route, placement or layout must leave every file as it is; a change of
the math (a new default, a torch bump in constraints.txt) regenerates them in a commit of its
own that says why. Whatever could depend on the machine is pinned before torch loads (PINS).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = ROOT / "tests" / "assets" / "losses"

# Bit-exact across machines only with these (each read once, when torch or MKL loads): one
# thread, as reductions split by the thread count; ATen's AVX2 kernels (the default elsewhere is
# AVX-512, whose vector reductions add in another order); MKL's and oneDNN's code paths pinned
# (MKL's GEMM otherwise picks its blocking and ISA per CPU; COMPATIBLE is its one path that gives
# the same bits on Intel and AMD). The host kernels are bit-exact across ISAs and thread counts
# but for sum_squares (its f64 lanes add in another order on AVX-512, kernels/mod.rs), which the
# gradient norm reads: they run their scalar path (HOST_KERNELS_ISA).
PINS = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
HOST_KERNELS_ISA = "scalar"

TRAIN = {
    "max_steps": 5,
    "global_batch_size": 4,
    "learning_rate": 3e-3,
    "weight_decay": 0.1,
    "lr_scheduler": "cosine",
    "warmup_steps": 2,
    "max_grad_norm": 2.4,  # inside the grad norms of these runs (1.6 .. 3.7): binds in some steps
}
KEYS = ("loss", "grad_norm", "aux_loss")  # aux_loss: logged for a mixture of experts only


@dataclass(frozen=True)
class Case:
    """One training: the tiny model ``arch`` (4 layers; ``tied`` embeddings), ``ranks``
    processes, the ``runtime`` keys over tests/engine/tiny.py's defaults."""

    name: str
    arch: str = "qwen3"
    tied: bool = True
    ranks: int = 1
    runtime: dict[str, Any] = field(default_factory=dict)


# chunk 1000 splits every group into many chunks through 2 gradient slots (the ring's reuse)
CHUNKED = {"chunk_elems": 1000, "grad_slots": 2}
ROUTES = [(g, p) for g in ("gpu", "cpu") for p in ("replicated", "sharded")]
CASES = [
    Case("dense-F", runtime={"layers": "F"} | CHUNKED),
    # every activation family, offloaded whole, in part and not at all
    Case("dense-families", runtime={"layers": "1xF-r1, 1xS0110110-r0.5, 1xSAC.mm, 1xN-r0.3"}),
    Case("dense-sac-attn-noact", runtime={"layers": "2xSAC.attn-r1, 2xSAC.noact"}),
    Case("dense-resident", runtime={"resident_layers": 2, "resident_embeddings": True}),
    *(Case(f"dense-2ranks-{g}-{p}", ranks=2, runtime={"grad_route": g, "param_route": p} | CHUNKED)
      for g, p in ROUTES),
    # each rank owns its resident groups' state: the dense-2ranks-gpu-sharded curve, bit for bit
    Case("dense-2ranks-resident", ranks=2, runtime={"param_route": "sharded", "resident_layers": 2,
                                                    "resident_embeddings": True} | CHUNKED),
    Case("moe", arch="qwen3_moe", tied=False, runtime={"layers": "2xF, 1xSAC.attn-r1, 1xN"}),
    Case("moe-2ranks-cpu-sharded", arch="qwen3_moe", tied=False, ranks=2,
         runtime={"grad_route": "cpu", "param_route": "sharded", "chunk_elems": 4000}),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare with the checked-in curves")
    mode.add_argument("--regenerate", action="store_true", help="rewrite the checked-in curves")
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)
    unknown = set(args.cases) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; known: {[c.name for c in CASES]}")
    if platform.machine() != "x86_64":
        print(f"golden curves are x86-64 (AVX2) bits; this machine is {platform.machine()}")
        return 2
    if any(os.environ.get(k) != v for k, v in PINS.items()):  # pinned before torch loads
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | PINS)
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    changed = 0
    with tempfile.TemporaryDirectory(prefix="slidedp-golden-") as tmp:
        for case in cases:
            new = record(case, Path(tmp))
            path = GOLDEN_DIR / f"{case.name}.json"
            old = json.loads(path.read_text()) if path.exists() else None
            lines = differences(old, new)
            changed += bool(lines)
            print(f"{case.name}: {'changed' if lines else 'unchanged'}", *lines, sep="\n  ")
            if args.regenerate and lines:
                GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(new, indent=1) + "\n")
    verb = "rewritten" if args.regenerate else "differ from the checked-in curves"
    print(f"{changed} of {len(cases)} case(s) {verb}" if changed else "all cases bit-identical")
    return 1 if changed and args.check else 0


def differences(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """Each difference of ``new`` from ``old`` as 'step S KEY: OLD -> NEW (relative change)';
    floats compare exactly (their JSON text round-trips)."""
    if old is None:
        return ["no checked-in curve"]
    lines = [f"{key}: {old.get(key)!r} -> {new[key]!r}" for key in ("case", "final_params_sha256")
             if old.get(key) != new[key]]  # fmt: skip
    old_steps, new_steps = old.get("steps", []), new["steps"]
    if len(old_steps) != len(new_steps):
        lines.append(f"steps: {len(old_steps)} -> {len(new_steps)}")
    for before, after in zip(old_steps, new_steps, strict=False):
        for key in sorted(set(before) | set(after)):
            a, b = before.get(key), after.get(key)
            if a != b:
                rel = f" ({(b - a) / abs(a):+.1e})" if isinstance(a, float) and b and a else ""
                lines.append(f"step {after['step']} {key}: {a!r} -> {b!r}{rel}")
    return lines


def record(case: Case, tmp: Path) -> dict[str, Any]:
    """The curve of ``case``: its settings, each step's ``KEYS``, the final parameters' digest."""
    # imported here, not above: PINS must be in the environment before torch loads
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    from engine.tiny import make_model, read_metrics, write_config, write_data
    from multirank.ranks import run_ranks
    from slidedp.cli import main as slidedp_main
    from slidedp.kernels import Kernels

    torch.set_num_threads(1)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":  # a CPU without AVX2 ignores the pin
        sys.exit(f"the golden curves are AVX2 bits; torch runs its {capability} kernels here")
    _pin_host_kernels(Kernels)
    work = tmp / case.name
    work.mkdir()
    model = make_model(work, case.arch, tied=case.tied, layers=4)
    data = write_data(work / "data.jsonl", 24)
    out = work / "out"
    runtime = case.runtime | ({"ranks": case.ranks} if case.ranks > 1 else {})
    config = write_config(work / "c.yaml", model, data, out, train=TRAIN, runtime=runtime,
                          output={"tensorboard": False})  # fmt: skip
    with _quiet(work / "log.txt"):
        one = case.ranks == 1
        codes = [slidedp_main(["train", str(config)])] if one else run_ranks(config, case.ranks)
    if codes != [0] * case.ranks:
        sys.exit(f"{case.name}: training failed ({codes}):\n{(work / 'log.txt').read_text()}")
    steps = [{"step": m["step"]} | {k: m[k] for k in KEYS if k in m} for m in read_metrics(out)]
    settings = {"arch": case.arch, "tied": case.tied, "ranks": case.ranks, "runtime": case.runtime,
                "train": TRAIN, "torch": torch.__version__.split("+")[0]}  # fmt: skip
    return {"case": settings, "steps": steps, "final_params_sha256": _digest(out / "final")}


def _pin_host_kernels(kernels: Any) -> None:
    """Every ``Kernels`` built from here on (the engine's, a forked rank's) runs
    ``HOST_KERNELS_ISA`` unless its caller names one."""
    if getattr(kernels, "_golden_pinned", False):
        return
    init = kernels.__init__

    def pinned(self: Any, threads: int | None = None, isa: str | None = None) -> None:
        init(self, threads, isa or HOST_KERNELS_ISA)

    kernels.__init__ = pinned
    kernels._golden_pinned = True


def _digest(final: Path) -> str:
    """SHA-256 over the exported tensors' names, dtypes, shapes and bytes, in name order."""
    import torch  # after PINS, as in record
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for f in sorted(final.glob("*.safetensors")):
        for name, t in sorted(load_file(f).items()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _quiet(log: Path) -> Iterator[None]:
    """Stdout and stderr of this process and of the ranks it forks into ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log.open("w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
