"""``slidedp plan CONFIG.yaml [overrides]``: choose the run's policy, write the run's plan.

The selection is ``autopolicy.choose``, the one pipeline ``runtime.policy: auto`` runs too
(each stage timed and said in one line); the report adds the selection time and the break-even
steps (``clock``); neither calibration nor validation runs for ``--gpu-memory``. Invariants:
the fixed default (all ``F``) is a candidate, its accounting printed beside the choice; the
plan always chooses afresh, and is kept in the selection cache only when made for this
machine's GPU.

Example::

    slidedp plan examples/qwen3-4b-1gpu.yaml --out runs/qwen3-4b/plan.json
    slidedp train examples/qwen3-4b-1gpu.yaml --plan runs/qwen3-4b/plan.json
    slidedp plan tiny.yaml --gpu-memory 80 --out p.json   # for an 80 GiB GPU, from here
    slidedp train tiny.yaml runtime.policy=p.json          # its policy; this machine the rest
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from slidedp.autopolicy.auto import check_one_process
from slidedp.autopolicy.calibrate import Calibration, clause
from slidedp.autopolicy.choose import ChooseSpec, SelectionReport, choose
from slidedp.autopolicy.clock import Clock
from slidedp.autopolicy.select import MIN_GAIN
from slidedp.autopolicy.validate import Validation
from slidedp.cli_args import count, ratios, writable
from slidedp.config import TrainConfig, load_config
from slidedp.errors import ConfigError
from slidedp.plan.machine import Machine
from slidedp.plan.policy import resident_text, write_plan
from slidedp.preflight import check_model
from slidedp.profile.layer import FAMILIES, RATIOS, ProfileSpec, profile_spec

GIB = 2**30


def _gib(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size in GiB, got {text}")
    return value


def report_path(out: Path) -> Path:
    """Where the report of the plan ``out`` goes: beside it, ``NAME.report.json``."""
    return out.with_suffix(".report.json")


def _check_out(out: Path) -> None:
    """Refused before any measuring: a plan not named ``.json`` (the policy YAML of older
    versions is still read as ``runtime.policy``, no longer written), a place that cannot be
    written (the plan's or its report's)."""
    if out.suffix != ".json" or out.name.endswith(".report.json"):
        raise ConfigError(
            f"--out {out}: slidedp plan writes the run's plan as JSON (its report beside it as "
            ".report.json); name it PLAN.json"
        )
    writable("--out", str(out))
    writable("--out's report", str(report_path(out)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("config", help="YAML with model, data, train, output (and runtime)")
    arg("overrides", nargs="*", help="section.key=value, e.g. train.global_batch_size=16")
    arg("--out", default="plan.json", help="the plan to write (its report: .report.json beside)")
    arg("--profile", default=None, help="a `slidedp profile layer --json` report to use")
    arg("--gpu-memory", type=_gib, default=None, metavar="GIB",
        help="plan for a GPU of this size (default: this machine's GPU)")  # fmt: skip
    arg("--families", default=FAMILIES, help="checkpoint families to profile")
    arg("--ratios", type=ratios, default=RATIOS, help="offload ratios to profile")
    arg("--warmup", type=count(0), default=2)
    arg("--steps", type=count(1), default=5)
    arg("--cache-dir", default=None, help="default: $XDG_CACHE_HOME/slidedp/profile")
    arg("--force", action="store_true", help="profile even if cached")


def _profile_spec(args: argparse.Namespace, cfg: TrainConfig) -> ProfileSpec:
    given = {"families": args.families, "ratios": args.ratios, "warmup": args.warmup,
             "steps": args.steps, "cache_dir": args.cache_dir, "force": args.force}  # fmt: skip
    return profile_spec(cfg, **given)


def plan_spec(args: argparse.Namespace, cfg: TrainConfig, clock: Clock) -> ChooseSpec:
    """``slidedp plan``'s terms of the one selection (``autopolicy.choose``): it always
    measures and chooses afresh, checks the choice with the estimate, and is cached only when
    made for this machine's GPU from the cached measurements."""
    target = int(args.gpu_memory * GIB) if args.gpu_memory else None
    own = not (args.profile or args.gpu_memory or args.cache_dir)
    return ChooseSpec(measure=True, write_cache=own, profile=_profile_spec(args, cfg),
                      profile_file=args.profile, target_bytes=target, check=True,
                      origin="chosen by `slidedp plan`", clock=clock)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    clock = Clock(say=lambda line: print(f"slidedp plan {line}", flush=True))
    with clock.stage("setup"):
        out = Path(args.out)
        cfg = load_config(args.config, args.overrides)
        check_one_process(cfg.runtime, "slidedp plan")
        adapter = check_model(cfg)[0]
        machine = Machine.probe(cfg, measure=False)
        if not args.gpu_memory and machine.gpu_total_bytes is None:
            raise ConfigError("no GPU here to plan for: pass --gpu-memory GIB (the target's size)")
        _check_out(out)  # the last refusal: it makes --out's folder
    plan, found = choose(cfg, adapter, machine, plan_spec(args, cfg, clock))
    summary = plan_summary(found)
    report_path(out).write_text(json.dumps(summary, indent=1))
    write_plan(plan, out.parent, out.name)  # as OUTPUT/plan.json, whole
    print(format_summary(summary, out))
    return 0


def plan_summary(found: SelectionReport) -> dict[str, Any]:
    """The report beside the policy file: the choice, the program, the estimate, each stage."""
    s = found.state
    choice, report, host, est = s.shown, s.report, s.host, s.estimate
    assert choice is not None
    assert report is not None
    assert host is not None
    assert est is not None
    assert s.step_model is not None
    clock = s.clock
    validation = s.validation
    return {
        "layout": choice.layout,
        "program_layout": choice.program_layout,
        "resident_layers": choice.resident_layers,
        "resident_embeddings": choice.resident_embeddings,
        "kept_default": choice.kept_default,
        "budget_bytes": choice.budget_bytes,
        "gpu_total_bytes": s.total_bytes,
        "profile": report.get("cached") or "measured",
        # the probe's rate under copies, its rate alone, the blend the program priced at
        "host_adamw": {
            "gbps": host.gbps,
            "alone_gbps": host.alone_gbps,
            "program_gbps": s.update_gbps,
            "source": host.source,
        },
        "chunk": {
            "chunk_elems": found.cfg.runtime.layout.chunk_elems,
            "grad_slots": found.cfg.runtime.layout.grad_slots,
            "said": s.chunk_said,
        },
        "problem": choice.problem.to_json(),
        "solution": choice.solution.to_json(),
        "default": choice.default.to_json() | {"fits": choice.default_fits},
        "estimate_gpu_needed_bytes": est.gpu.needed_bytes if est.gpu else None,
        "step_model": {
            k: m and {"step_s": m.step_s, "regime": m.regime, "calibration": m.calibration}
            for k, m in s.step_model.items()
        },
        "calibration": _summary(s.calibration, s.not_calibrated),
        "validation": _summary(validation, s.not_validated),
        "timing_s": {f"{k}_s": v for k, v in clock.seconds.items()},
        "selection_s": clock.total_s,
        "break_even_steps": validation and validation.break_even_steps(clock.total_s),
    }


def _resident(s: dict[str, Any]) -> str:
    return resident_text(s["resident_layers"], s["resident_embeddings"])


def _summary(stage: Calibration | Validation | None, why: str | None) -> dict[str, Any]:
    if stage is None:
        return {"skipped": why}
    return stage.summary()


def _kept(s: dict[str, Any]) -> str:
    if not s["kept_default"]:
        return ""
    if s["validation"].get("winner") == "default":
        return " (the default: the program's layout did not run faster in validation)"
    return f" (the default: leaving it needs {1 + MIN_GAIN:.2f}x)"


def _validation_line(s: dict[str, Any]) -> str:
    v = s["validation"]
    if "skipped" in v:
        return f"  validated: no ({v['skipped']})"
    return f"  validated ({v['steps']} steps each): {v['said']}"


def _selection_line(s: dict[str, Any]) -> str:
    steps = s["break_even_steps"]
    if "skipped" in s["validation"]:
        even = "unknown (not validated)"
    else:
        even = "never (the default runs)" if steps is None else f"after {steps:,} steps"
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in s["timing_s"].items())
    return f"  selection {s['selection_s']:.1f} s ({stages}); break-even {even}"


def _model_line(model: dict[str, Any]) -> str:
    chosen, default = model["chosen"], model["default"]
    if chosen is None or default is None:
        return "  step-time model: n/a (no GPU here to take its peak from)"
    return (
        f"  step-time model ({chosen['calibration']}): {chosen['step_s']:.3f} s chosen vs "
        f"{default['step_s']:.3f} s default ({default['step_s'] / chosen['step_s']:.3f}x); "
        f"{chosen['regime']}"
    )


def _offloaded(solution: dict[str, Any], problem: dict[str, Any]) -> str:
    """The host memory the program's offloaded activations pin, and its budget."""
    pinned = f"{solution['offloaded_bytes'] / GIB:.2f} GiB offloaded to host memory"
    budget = problem.get("host_budget_bytes")
    return pinned if budget is None else f"{pinned} (of {budget / GIB:.2f} GiB to spare)"


def format_summary(s: dict[str, Any], out: Path) -> str:
    sol, default = s["solution"], s["default"]
    names = [c["name"] for c in s["problem"]["candidates"]]
    host = s["problem"]["host"]
    total = s["gpu_total_bytes"] / GIB
    when = "after the backward: clipping" if host["serial"] else "overlapping the backward"
    tail = (
        "none for the embedding and head (GPU-resident)"
        if s["resident_embeddings"]
        else f"{host['tail_s'] * 1e3:.0f} ms for the embedding and head (after it)"
    )
    lines = [
        f"slidedp plan: {len(names)} candidates from the profile ({s['profile']}): "
        + ", ".join(names),
        f"  budget for activations {s['budget_bytes'] / GIB:.2f} GiB of {total:.1f}; host "
        f"update {host['update_s_per_layer'] * 1e3:.1f} ms/layer ({when}) and {tail} at "
        f"{s['host_adamw']['program_gbps']:.0f} GB/s AdamW, {s['host_adamw']['source']}",
        f"  program: {s['program_layout']}",
        f"           step {sol['step_s']:.3f} s (layers {sol['compute_s']:.3f} s, host "
        f"{sol['host_s']:.3f} s), activations {sol['memory_bytes'] / GIB:.2f} GiB, "
        f"{_offloaded(sol, s['problem'])}",
        f"  default: {len(default['counts']) and sum(default['counts'])}xF-r0, step "
        f"{default['step_s']:.3f} s (layers {default['compute_s']:.3f} s) -> "
        f"{default['step_s'] / sol['step_s']:.3f}x predicted",
        f"  chosen:  {s['layout']}, {_resident(s)}{_kept(s)}",
        f"  chunk:   {s['chunk']['said']}",
        f"  estimate of the run with it: GPU {s['estimate_gpu_needed_bytes'] / GIB:.2f} GiB needed",
        _model_line(s["step_model"]),
        f"  {clause(s['calibration'])}",
        _validation_line(s),
        _selection_line(s),
        f"wrote {out} (train with --plan {out}, or its policy: runtime.policy={out}) and "
        f"{report_path(out)}",
    ]
    return "\n".join(lines)
