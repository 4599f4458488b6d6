"""``slidedp bench train``: our engine beside the compute-only reference, FSDP2 CPU offload and
the peers (DeepSpeed ZeRO-Offload, GPU-resident FSDP2, RoundPipe), same synthetic tokens.

Run (on the GPU machine)::

    slidedp bench train --shape qwen3-4b --seq 1024 --batch 16 --json out.json
    slidedp bench train --shape qwen3-4b --batch 4 --gpus 2 --routes all --json scale.json

Each system runs in its own subprocess (``bench.child``); ``--set`` overrides ours,
``--peer-set SYSTEM[:LABEL].KEY=VALUE`` a peer or its variant. Reports tokens/s, model TFLOP/s,
MFU, peak GPU reserved and host PSS, ratios ours/other (``bench.report``, ``bench.sweep``);
``--gpus N`` adds weak scaling (``bench.multi``, ``bench.scaling``), with ``--context-parallel R``
ours splitting each sequence over R of them (``bench.context``). Invariants: OOM, TIMEOUT and
UNAVAILABLE are reported, any other failure exits 1 after the report; ``--json`` is rewritten
after every run (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from slidedp.bench import context, multi
from slidedp.bench.child import run_child
from slidedp.bench.measure import RunSpec
from slidedp.bench.peers import (
    PEERS,
    check_variant,
    parse_peer_sets,
    peer_overrides,
    split_variant,
    system_and_key,
)
from slidedp.bench.plot import plot_sweep
from slidedp.bench.predict import predict_report, print_predictions
from slidedp.bench.provenance import provenance
from slidedp.bench.report import Model, print_report, ratios, summarise
from slidedp.bench.scaling import collectives_report, print_scale, scale_report
from slidedp.bench.shape import bench_model, check_seq
from slidedp.bench.sweep import print_summary, sweep_summary
from slidedp.cli_args import writable
from slidedp.config import config_to_dict, load_config
from slidedp.errors import ConfigError, SlidedpError
from slidedp.models.shapes import SHAPES
from slidedp.profile.pareto import require_matplotlib
from slidedp.runtime.flops import FLOPS_FORMULA, model_flops_per_token

DEFAULT_SYSTEMS = ("ours", "reference", "fsdp2")
SYSTEMS = (*DEFAULT_SYSTEMS, *PEERS)
RESULTS = ("ok", "oom", "timeout", "unavailable")  # a run's statuses that are not a failure
OURS_DEFAULTS: dict[str, Any] = {
    "train": {"max_steps": 1, "learning_rate": 1e-5, "lr_scheduler": "constant"},
    # auto's choice uncalibrated and unvalidated unless --set asks: the bench runs the default
    # beside it, and the reference runs the layout auto chooses for ours
    # (``bench.ours.auto_layout``)
    "runtime": {"policy_validate_steps": 0, "policy_calibrate_steps": 0},
}
BENCH_OWNED = frozenset(
    ("model.path", "data", "output", "train.max_steps", "train.global_batch_size", "runtime.device",
     "runtime.ranks", "runtime.gpus", "runtime.context_parallel")
)  # fmt: skip


def ours_config(overrides: list[str]) -> dict[str, Any]:
    """Our whole resolved config (every key, as plain values) with ``overrides`` applied and
    validated by ``load_config``; the keys the bench sets itself are refused."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        key = key.strip()
        # an item without '=' is malformed whatever its key: load_config says so
        if sep and (key in BENCH_OWNED or key.partition(".")[0] in BENCH_OWNED):
            raise ConfigError(
                f"--set {item}: '{key}' is set by the bench (use --shape, --batch/--sweep, "
                "--seq, --steps, --device, --gpus/--ranks, --context-parallel)"
            )
    placeholders = {"model": {"path": "-"}, "data": {"path": "-"}, "output": {"dir": "-"}}
    with tempfile.TemporaryDirectory(prefix="slidedp-bench-") as tmp:
        path = Path(tmp) / "ours.yaml"
        path.write_text(yaml.safe_dump({**placeholders, **OURS_DEFAULTS}))
        return config_to_dict(load_config(path, overrides))


def ours_configs(overrides: list[str], systems: list[str]) -> dict[str, dict[str, Any]]:
    """The whole config of ``ours`` (from the plain ``--set`` items; also where ``systems``
    has only variants of it: the reference and the report follow it) and of each variant
    ``ours:LABEL`` of ``systems`` (those items, then its own ``--set ours:LABEL.KEY=VALUE``: a
    key set in both is the variant's). A variant trains the bench's one model, so its
    ``model.*`` keys are refused; so is an item naming no variant of ``systems``."""
    own: dict[str, list[str]] = {"ours": []}
    own |= {name: [] for name in systems if split_variant(name)[0] == "ours"}
    plain = []
    for item in overrides:
        if not item.startswith("ours:"):
            plain.append(item)
            continue
        name, key = system_and_key(item, systems)
        if name not in own:
            raise ConfigError(
                f"--set {item}: the variant {name} is not in --systems {','.join(systems)!r}; "
                "name it there too"
            )
        if key.partition(".")[0] == "model":
            raise ConfigError(
                f"--set {item}: every system trains the bench's one model; set model.* for all "
                "(--set model.KEY=VALUE)"
            )
        own[name].append(key)
    return {name: ours_config([*plain, *items]) for name, items in own.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--shape", default="qwen3-4b", help=f"{', '.join(SHAPES)}, or an HF config.json path "
        "(a model directory with safetensors: ours starts from its weights, the others from "
        "its config)")  # fmt: skip
    arg("--batch", type=int, default=4, help="sequences per step")
    arg("--sweep", default=None, help="batch sizes, e.g. 4,8,16,32 (replaces --batch)")
    arg("--seq", type=int, default=1024, help="tokens per sequence")
    arg("--layers", type=int, default=0, help="cut the shape to its first N layers (0: all)")
    arg("--warmup", type=int, default=3, help="steps run first and discarded")
    arg("--steps", type=int, default=5, help="steps measured")
    arg(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"a subset of {','.join(SYSTEMS)}; a variant of ours or of a peer as SYSTEM:LABEL, "
        "its own --set ours:LABEL.KEY=VALUE or --peer-set SYSTEM:LABEL.KEY=VALUE over the "
        "system's (e.g. ours:auto, zero3-offload:big)",
    )
    arg(
        "--peer-set",
        dest="peer_sets",
        action="append",
        default=[],
        metavar="SYSTEM.KEY=VALUE",
        help="a peer's config, e.g. zero3-offload.zero_optimization.stage3_prefetch_bucket_size=1e8"
        " or roundpipe.num_microbatch=4",
    )
    arg(
        "--system-timeout",
        default=None,
        metavar="S[,SYSTEM=S...]",
        help="kill a run after S seconds and report it as TIMEOUT; SYSTEM=S for one system, a "
        "variant by its full name (e.g. 120,zero3-offload=200,zero3-offload:big=300; default: no "
        "limit)",
    )
    arg("--device", default="auto", choices=("auto", "cuda", "cpu"))
    arg(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="our engine's config, as slidedp train's overrides (e.g. runtime.offload_ratio=1); "
        "ours:LABEL.SECTION.KEY=VALUE: a variant's own (e.g. ours:auto.runtime.policy=auto)",
    )
    arg("--seed", type=int, default=0, help="seed of the synthetic tokens")
    arg(
        "--gpu-limit",
        type=float,
        default=0.0,
        metavar="GIB",
        help="cap each system's GPU memory here, as on a smaller GPU (e.g. 80 for an H100)",
    )
    arg(
        "--host-limit",
        type=float,
        default=0.0,
        metavar="GIB",
        help="report a system whose host PSS passes this as OOM (killed), as on a smaller host",
    )
    arg("--json", default=None, help="also write the report to this JSON file")
    arg("--png", default=None, help="plot tokens/s and memory vs batch (needs matplotlib)")
    arg(
        "--trace",
        default=None,
        metavar="FILE",
        help="Chrome/Perfetto trace of our first measured step (FILE; with --sweep, FILE-bN.json; "
        "a variant ours:LABEL's FILE-LABEL.json or FILE-LABEL-bN.json; "
        "on N ranks FILE-xN-PARAM-GRAD-rankR.json)",
    )
    arg(
        "--predict",
        action="store_true",
        help="also the step-time model's prediction of each run of ours, calibrated by probes "
        "run here after the runs (bench.predict)",
    )
    multi.add_arguments(parser)
    context.add_arguments(parser)


def _parse(args: argparse.Namespace) -> tuple[list[int], list[str], str]:
    """(batches, systems, device) from the arguments, or one ``ConfigError`` line."""
    try:
        batches = [int(b) for b in args.sweep.split(",")] if args.sweep else [args.batch]
    except ValueError:
        raise ConfigError(f"--sweep must be comma-separated integers, got {args.sweep!r}") from None
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted({split_variant(s)[0] for s in systems} - set(SYSTEMS))
    if unknown or not systems:
        raise ConfigError(
            f"--systems {args.systems!r}: use a comma-separated subset of {','.join(SYSTEMS)}"
        )
    for name in systems:
        why = check_variant(name) if ":" in name else None
        if why or systems.count(name) > 1:
            raise ConfigError(f"--systems {args.systems!r}: {name!r}: {why or 'named twice'}")
    if min(batches) < 1 or args.seq < 2 or args.steps < 1 or args.warmup < 0:
        raise ConfigError("need --batch/--sweep >= 1, --seq >= 2, --steps >= 1, --warmup >= 0")
    if args.gpu_limit < 0 or args.host_limit < 0:
        raise ConfigError("--gpu-limit and --host-limit are GiB > 0 (0: no limit)")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is available; use --device cpu")
    if device == "cpu" and args.gpu_limit:
        raise ConfigError(
            "--gpu-limit caps GPU memory, and this bench runs on the CPU: drop it (--host-limit "
            "caps host memory)"
        )
    return batches, systems, device


def system_timeouts(text: str | None, systems: list[str]) -> dict[str, float]:
    """``--system-timeout``: seconds per system of ``systems`` (0: no limit), from a default
    ``S`` and ``SYSTEM=S`` items, or one ``ConfigError`` line."""
    if text is None:
        return dict.fromkeys(systems, 0.0)
    default, per_system = 0.0, {}
    for item in text.split(","):
        name, sep, value = item.strip().rpartition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if seconds <= 0 or (sep and name not in systems):
            raise ConfigError(
                f"--system-timeout {text!r}: use S or SYSTEM=S, comma-separated, seconds > 0, "
                f"SYSTEM one of --systems ({','.join(systems)})"
            )
        if sep:
            per_system[name] = seconds
        else:
            default = seconds
    return {s: per_system.get(s, default) for s in systems}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (batch, system), each in its own subprocess; the report."""

    batches, systems, device = _parse(args)
    _check_outputs(args)
    configs = ours_configs(args.overrides, systems)
    if args.context_parallel is not None:
        configs = context.with_context_keys(args.overrides, configs)
    ours = configs["ours"]
    peer_sets = peer_overrides(parse_peer_sets(args.peer_sets, systems), systems)
    timeouts = system_timeouts(args.system_timeout, systems)
    scale = multi.parse_scale(args, systems, device, ours)  # None: one GPU only
    shape = bench_model(args.shape, args.layers, ours)
    config, weights = shape.config, shape.weights
    check_seq(config, args.seq)
    split = context.parse_context(args, scale, ours, config, device)  # None: no --context-parallel
    model = Model(model_flops_per_token(config, args.seq), None, shape.params)
    report: dict[str, Any] = {
        "shape": args.shape,
        "weights_dir": weights or None,  # ours loads these; the others start from the config
        "model": shape.report(),
        "seq_len": args.seq,
        "device": device,
        "device_name": "cpu",
        "peak_flops": None,
        "flops_formula": FLOPS_FORMULA,
        "flops_per_token": model.flops_per_token,
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "gpu_limit_gib": args.gpu_limit or None,
        "host_limit_gib": args.host_limit or None,
        "ours_config": {"train": ours["train"], "runtime": ours["runtime"]},
        "ours_variants": {  # ours:LABEL's config, where --systems names any
            name: {"train": config["train"], "runtime": config["runtime"]}
            for name, config in configs.items()
            if name != "ours"
        },
        "peer_sets": peer_sets,
        "system_timeout_s": timeouts,
        "provenance": provenance(),
    }
    if split is not None and scale is not None:
        scale = dataclasses.replace(scale, context=split.size)
        report["context_parallel"] = context.context_report(split, scale.world)
    with tempfile.TemporaryDirectory(prefix="slidedp-bench-") as tmp:
        config.to_json_file(Path(tmp) / "config.json")
        spec = RunSpec(
            system="peak",
            config_dir=tmp,
            batch=0,
            seq_len=args.seq,
            warmup=args.warmup,
            steps=args.steps,
            device=device,
            seed=args.seed,
            ours=ours,
            gpu_limit_gib=args.gpu_limit,
            host_limit_gib=args.host_limit,
            weights_dir=weights,
        )
        if device == "cuda":
            model = dataclasses.replace(model, peak_flops=_peak(spec, Path(tmp), report))
        if scale is not None and scale.collectives:
            print(f"slidedp bench train: collectives on {scale.world} ranks ...", file=sys.stderr)
            result, _ = run_child(multi.collectives_spec(spec, scale, config), Path(tmp))
            report["collectives"] = collectives_report(result)
        sweep = _Sweep(args, systems, configs, peer_sets, timeouts, scale, split, Path(tmp))
        report["runs"] = []  # filled in as the runs finish
        for batch in batches:
            for run in sweep.specs(spec, batch, ours):
                if run.system == "reference" and split is not None:
                    sweep.run_reference(run, report, model, len(batches))
                else:
                    sweep.run(run, report, model, len(batches))
        if args.predict:
            report["predictions"] = predict_report(report, Path(tmp))
    if scale is not None:
        report |= scale_report(report["runs"], scale, model.flops_per_token, args.seq)
    return report


def _check_outputs(args: argparse.Namespace) -> None:
    """The report's files can be written (``--png``: matplotlib is there), before any run."""
    if args.png:
        require_matplotlib()
    writable("--json", args.json)
    writable("--png", args.png)


def _peak(spec: RunSpec, tmp: Path, report: dict[str, Any]) -> float | None:
    """The GPU's measured bf16 GEMM peak (None where it failed: the report says why), in a
    child like every run: the parent never touches the GPU."""
    peak, _ = run_child(spec, tmp)
    report.update({k: peak.get(k) for k in ("device_name", "peak_flops")})
    if "error" in peak:
        report["peak_error"] = peak["error"]
    flops: float | None = report["peak_flops"]
    return flops


@dataclass(frozen=True)
class _Sweep:
    """What every run of one ``bench`` shares: its arguments, the systems and their
    configs, peer sets and time limits, the ranks scale (None: one GPU), the context
    parallelism (None: none) and the folder."""

    args: argparse.Namespace
    systems: list[str]
    configs: dict[str, dict[str, Any]]
    peer_sets: dict[str, dict[str, Any]]
    timeouts: dict[str, float]
    scale: multi.Scale | None
    split: context.ContextBench | None  # --context-parallel
    tmp: Path

    def specs(self, spec: RunSpec, batch: int, ours: dict[str, Any]) -> list[RunSpec]:
        """The runs at ``batch``: every system (a variant as its system, with its own name
        and overrides), then the scaled ones; with ``--context-parallel`` ours on the ranks
        only."""
        at_batch = []
        for name in self.systems:
            system, variant = split_variant(name)
            if system == "ours" and self.split is not None:
                continue
            at_batch.append(
                dataclasses.replace(spec, system=system, variant=variant, batch=batch,
                                    peer=self.peer_sets.get(name, {}),
                                    timeout_s=self.timeouts[name],
                                    ours=self.configs.get(name, ours))
            )  # fmt: skip
        if self.scale is None:
            return at_batch
        scaled = multi.scaled_specs(
            dataclasses.replace(spec, batch=batch), self.systems, self.scale, at_batch
        )
        return scaled + at_batch if self.scale.first else at_batch + scaled

    def run(self, run: RunSpec, report: dict[str, Any], model: Model, batches: int) -> None:
        """``run`` in its child process, its result added to ``report`` (and ``--json``)."""
        args, runs = self.args, report["runs"]
        print(f"slidedp bench train: {_describe(run)} ...", file=sys.stderr)
        if args.trace and run.system == "ours":
            run = dataclasses.replace(run, ours=_traced(run, args, batches))
        started = time.monotonic()
        result, peak_pss_bytes = run_child(run, self.tmp)
        if self.split is not None:
            model = self.split.model_at(model, run.seq_len)
        runs.append(summarise(result, peak_pss_bytes, model, world=run.world))
        runs[-1]["seq_len"] = run.seq_len
        # the whole process: model build, warm-up and steps (what a device call plans for)
        runs[-1]["wall_s"] = round(time.monotonic() - started, 1)
        print(
            f"slidedp bench train: {_describe(run)}: {runs[-1]['status']} in "
            f"{runs[-1]['wall_s']:.0f} s",
            file=sys.stderr,
        )
        if self.scale is not None:
            runs[-1] |= multi.run_keys(run)
        _conclude(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    def run_reference(self, run: RunSpec, report: dict[str, Any], model: Model, n: int) -> None:
        """The reference at ``--seq``, or where it ran out of memory at the next length of
        ``split.reference_lengths`` (``--ref-seq``: at that one)."""
        assert self.split is not None, "only with --context-parallel"
        for seq_len in self.split.reference_lengths():
            self.run(dataclasses.replace(run, seq_len=seq_len), report, model, n)
            if report["runs"][-1]["status"] != "oom":
                return


def _conclude(report: dict[str, Any]) -> None:
    """The report's ratios (on one GPU, at ``--seq``) and sweep summary from its runs so far."""
    at_seq = [r for r in report["runs"] if r.get("seq_len", report["seq_len"]) == report["seq_len"]]
    report["ratios"] = ratios([r for r in at_seq if r.get("world", 1) == 1])
    report["summary"] = sweep_summary(at_seq)


def _describe(run: RunSpec) -> str:
    where = "" if run.world == 1 else f" on {run.world} ranks"
    route = multi.run_keys(run)["route"]
    return f"{run.full_system}, batch {run.batch}{where}" + (f", route {route}" if route else "")


def _traced(run: RunSpec, args: argparse.Namespace, batches: int) -> dict[str, Any]:
    """``run.ours`` tracing its first measured step into ``--trace`` (one file per variant of
    ours, per swept batch,
    per route on several ranks, per rank: ``bench.ours``)."""
    path, ours = Path(args.trace), run.ours
    tag = (f"-{run.variant}" if run.variant else "") + (f"-b{run.batch}" if batches > 1 else "")
    if run.world > 1:
        tag += f"-x{run.world}-{str(multi.run_keys(run)['route']).replace('/', '-')}"
    if tag:
        path = path.with_name(f"{path.stem}{tag}{path.suffix or '.json'}")
    runtime = {**ours["runtime"], "trace_path": str(path.resolve()), "trace_step": args.warmup}
    return {**ours, "runtime": runtime}


def main(args: argparse.Namespace) -> int:
    try:
        report = bench(args)
    except SlidedpError as e:
        print(f"slidedp bench train: error: {e}", file=sys.stderr)
        return 2
    print_report(report)
    context.print_context(report)
    print_summary(report["summary"])
    if "scaling" in report:
        print_scale(report)
    print_predictions(report.get("predictions", []))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.png:
        plot_sweep(report, Path(args.png))
    failed = [r for r in report["runs"] if r["status"] not in RESULTS]
    if report.get("collectives", {}).get("status", "ok") not in ("ok", "oom"):
        failed.append(report["collectives"])
    return 1 if failed or "peak_error" in report else 0
