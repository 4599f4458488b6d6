"""``slidedp plan CONFIG.yaml [overrides]``: choose the run's layout, write it as a policy file.

Stages, each timed and said in one line: the layer profile, the host AdamW rate, on a GPU the
chunk (``chunk_choice``), the integer program (``select``), the calibration (``calibrate``), the
validation (``validate``; neither for ``--gpu-memory``) and ``slidedp estimate`` of the choice;
the report adds the selection time and the break-even steps (``clock``). Invariants: the fixed
default (all ``F``) is a candidate, its accounting printed beside the choice; the plan always
chooses afresh, and is kept in the selection cache only when made for this machine's GPU.

Example::

    slidedp plan examples/qwen3-4b-1gpu.yaml --out runs/qwen3-4b/policy.yaml
    slidedp train examples/qwen3-4b-1gpu.yaml runtime.policy=runs/qwen3-4b/policy.yaml
    slidedp plan tiny.yaml --gpu-memory 80 --device cpu   # plan for an 80 GiB GPU from here
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from slidedp.autopolicy.auto import check_one_process, chunk_stage
from slidedp.autopolicy.calibrate import Calibration, calibrate_choice, clause, why_not_calibrated
from slidedp.autopolicy.chunk_choice import with_chunk
from slidedp.autopolicy.clock import Clock
from slidedp.autopolicy.select import MIN_GAIN, Choice, select_layout
from slidedp.autopolicy.selection_cache import KeyTerms, store_selection
from slidedp.autopolicy.validate import (
    Validation,
    default_config,
    limit_bytes,
    needs_validation,
    runner_for,
    validate_choice,
    with_choice,
)
from slidedp.config import load_config
from slidedp.errors import ConfigError
from slidedp.estimate import shortages
from slidedp.estimate_report import estimate_run
from slidedp.plan.layout import LayerPolicy
from slidedp.plan.machine import Machine, host_rate, update_threads
from slidedp.plan.policy import resident_text
from slidedp.preflight import check_model
from slidedp.profile.layer import FAMILIES, RATIOS, ProfileSpec, profile_layer, profile_spec

GIB = 2**30


def _gib(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size in GiB, got {text}")
    return value


def _check_out(out: Path) -> None:
    """Refused before any measuring: a report that would overwrite the policy, a place that
    cannot be written."""
    if out.suffix == ".json":
        raise ConfigError(f"--out {out}: the report goes beside it as .json; name it .yaml")
    parent = next((p for p in (out.parent, *out.parent.parents) if p.exists()), Path("."))
    if out.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {out}: cannot write a file there")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("config", help="YAML with model, data, train, output (and runtime)")
    arg("overrides", nargs="*", help="section.key=value, e.g. train.global_batch_size=16")
    arg("--out", default="policy.yaml", help="the policy file to write (the report: .json beside)")
    arg("--profile", default=None, help="a `slidedp profile layer --json` report to use")
    arg("--gpu-memory", type=_gib, default=None, metavar="GIB",
        help="plan for a GPU of this size (default: this machine's GPU)")  # fmt: skip
    arg("--families", default=FAMILIES, help="checkpoint families to profile")
    arg("--ratios", default=RATIOS, help="offload ratios to profile")
    arg("--warmup", type=int, default=2)
    arg("--steps", type=int, default=5)
    arg("--cache-dir", default=None, help="default: $XDG_CACHE_HOME/slidedp/profile")
    arg("--force", action="store_true", help="profile even if cached")


def _profile(args: argparse.Namespace, cfg: Any, batch: int) -> dict[str, Any]:
    if args.profile:
        try:
            report: dict[str, Any] = json.loads(Path(args.profile).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"--profile {args.profile}: not a readable JSON report ({e})"
            ) from None
        rows = report.get("candidates") if isinstance(report, dict) else None
        needed = {"policy", "pareto", "forward_s", "backward_s", "reload_s", "retained_bytes",
                  "estimated_retained_bytes", "offloaded_bytes", "estimated_offloaded_bytes",
                  "transient_bytes", "estimated_transient_bytes"}  # fmt: skip
        if not isinstance(rows, list) or not all(isinstance(r, dict) and needed <= set(r)
                                                 for r in rows):  # fmt: skip
            raise ConfigError(
                f"--profile {args.profile}: not a `slidedp profile layer --json` report"
            )
        if report.get("batch") != batch or report.get("seq_len") != cfg.data.seq_len:
            raise ConfigError(
                f"--profile {args.profile} is of B={report.get('batch')} S={report.get('seq_len')}"
                f", the run is B={batch} S={cfg.data.seq_len}: profile the run's own shape"
            )
        return report
    return profile_layer(_profile_spec(args, cfg))


def _profile_spec(args: argparse.Namespace, cfg: Any) -> ProfileSpec:
    given = {"families": args.families, "ratios": args.ratios, "warmup": args.warmup,
             "steps": args.steps, "cache_dir": args.cache_dir, "force": args.force}  # fmt: skip
    return profile_spec(cfg, **given)


def main(args: argparse.Namespace) -> int:

    clock = Clock(say=lambda line: print(f"slidedp plan {line}", flush=True))
    with clock.stage("setup"):
        out = Path(args.out)
        _check_out(out)
        cfg = load_config(args.config, args.overrides)
        check_one_process(cfg.runtime, "slidedp plan")
        adapter = check_model(cfg)[0]
        machine = Machine.probe(cfg, measure=False)
        total = int(args.gpu_memory * GIB) if args.gpu_memory else machine.gpu_total_bytes
        if total is None:
            raise ConfigError("no GPU here to plan for: pass --gpu-memory GIB (the target's size)")
        batch = profile_spec(cfg).batch
    with clock.stage("profile") as notes:
        report = _profile(args, cfg, batch)
        source = args.profile or report.get("cached") or "measured"
        notes.append(f"{len(report['candidates'])} candidates, {source}")
    with clock.stage("host") as notes:
        host = host_rate(update_threads(cfg, machine), machine, measure=True)
        notes.append(f"AdamW {host.gbps:.0f} GB/s {host.source}")
    chunk, chunk_said = None, "the config's (planned for another GPU: --gpu-memory)"
    if not args.gpu_memory:  # the probe measures this machine's GPU
        chunk, chunk_said = chunk_stage(default_config(cfg), adapter, machine, measure=True,
                                        clock=clock)  # fmt: skip
    other_chunk = chunk is not None and not chunk.is_default

    calibrated: dict[LayerPolicy, float] = {}  # the calibration stage's layer times

    def solve_at(cut_bytes: int = 0) -> Choice:
        return select_layout(cfg, adapter, machine, report, total_bytes=total,
                             update_gbps=host.gbps, budget_cut_bytes=cut_bytes,
                             times_s=calibrated)  # fmt: skip

    with clock.stage("solve") as notes:
        choice = solved = solve_at()
        notes.append(f"{choice.layout}, {choice.resident_text}")
    calibration, not_calibrated = None, _why_not_calibrated(args, cfg, choice)
    if not_calibrated is None:  # the plan is for this machine's GPU: its trials run here
        with clock.stage("calibrate") as notes:
            calibration = calibrate_choice(cfg, choice, steps=cfg.runtime.policy_calibrate_steps,
                                           runner=runner_for(machine))  # fmt: skip
            calibrated.update(calibration.times_s())
            choice = solved = solve_at()
            notes.append(f"{calibration.describe()}; solved again: {choice.program_layout}")
    validation, why = None, _why_not_validated(args, cfg, choice, other_chunk=other_chunk)
    if why is None:  # the plan is for this machine's GPU: its steps can be run here
        with clock.stage("validation") as notes:

            def configure(base: Any, c: Choice) -> Any:
                return with_chunk(with_choice(base, c), chunk, adapter, machine)

            validation = validate_choice(default_config(cfg), choice, solve_at,
                                         steps=cfg.runtime.policy_validate_steps,
                                         limit_bytes=limit_bytes(machine),
                                         runner=runner_for(machine),
                                         configure=configure)  # fmt: skip
            notes.append(validation.describe())
        choice = validation.result(solved)
        if validation.choice is None and other_chunk:  # the default won: whole layers too
            chunk, chunk_said = None, f"the whole layer ({chunk_said}; the default won validation)"
    elif other_chunk:  # a chunk runs only where validation ran it faster (autopolicy.chunk_choice)
        chunk, chunk_said = None, f"the whole layer ({chunk_said}; not applied unvalidated: {why})"

    with clock.stage("check"):
        target = dataclasses.replace(machine, device="cuda", gpu_total_bytes=total)
        runtime = dataclasses.replace(cfg.runtime, layers=choice.layout, policy="",
                                      resident_layers=choice.resident_layers,
                                      resident_embeddings=choice.resident_embeddings)  # fmt: skip
        chosen = with_chunk(dataclasses.replace(cfg, runtime=runtime), chunk, adapter, machine)
        est = estimate_run(chosen, adapter, target)
        # the step-time model ranks the choice against the default (on a GPU: it needs its peak)
        est_f = estimate_run(default_config(cfg), adapter, target)
        model = {"chosen": est.step_model, "default": est_f.step_model}
    # the GPU budget is the estimate's (a shortage there is a bug); the host's (offload
    # arenas in RAM) is checked where the plan is for this machine
    short = [s for s in shortages(est) if s.startswith("GPU") or not args.gpu_memory]
    if short:
        raise ConfigError(f"the chosen layout {choice.layout} does not fit: {'; '.join(short)}")

    out.parent.mkdir(parents=True, exist_ok=True)
    policy = {"layers": choice.layout, "resident_layers": choice.resident_layers,
              "resident_embeddings": choice.resident_embeddings}  # fmt: skip
    if chunk is not None and not chunk.is_default:
        policy |= {"chunk_elems": chunk.chunk_elems, "grad_slots": chunk.grad_slots}
    out.write_text(yaml.safe_dump(policy, sort_keys=False))
    summary = {
        "layout": choice.layout,
        "program_layout": choice.program_layout,
        "resident_layers": choice.resident_layers,
        "resident_embeddings": choice.resident_embeddings,
        "kept_default": choice.kept_default,
        "budget_bytes": choice.budget_bytes,
        "gpu_total_bytes": total,
        "profile": report.get("cached") or "measured",
        "host_adamw": {"gbps": host.gbps, "source": host.source},
        "chunk": {
            "chunk_elems": chosen.runtime.chunk_elems,
            "grad_slots": chosen.runtime.grad_slots,
            "said": chunk_said,
        },
        "problem": choice.problem,
        "solution": choice.solution,
        "default": choice.default,
        "estimate_gpu_needed_bytes": est.gpu.needed_bytes if est.gpu else None,
        "step_model": {
            k: m and {"step_s": m["step_s"], "regime": m["regime"], "calibration": m["calibration"]}
            for k, m in model.items()
        },
        "calibration": _summary(calibration, not_calibrated),
        "validation": _summary(validation, why),
        "timing_s": {f"{k}_s": v for k, v in clock.seconds.items()},
        "selection_s": clock.total_s,
        "break_even_steps": validation and validation.break_even_steps(clock.total_s),
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(format_summary(summary, out))
    if not (args.profile or args.gpu_memory or args.cache_dir):  # this GPU, cached measurements
        terms = KeyTerms(resident=True, routes=[], profile=_profile_spec(args, cfg))
        store_selection(cfg, chosen, adapter, machine, _auto_line(summary), clock, validation,
                        terms)  # fmt: skip
    return 0


def _resident(s: dict[str, Any]) -> str:
    return resident_text(s["resident_layers"], s["resident_embeddings"])


def _auto_line(s: dict[str, Any]) -> str:
    """The banner line of a ``train`` with ``runtime.policy: auto`` that takes this plan's
    choice from the selection cache."""
    return (
        f"policy   auto: {s['layout']}, {_resident(s)}{_kept(s)}, chosen by "
        f"`slidedp plan`; chunk {s['chunk']['said']}; {clause(s['calibration'])}; "
        f"{_validation_line(s).strip()}; "
        f"{_selection_line(s).strip()}"
    )


def _why_not_validated(
    args: argparse.Namespace, cfg: Any, choice: Choice, *, other_chunk: bool
) -> str | None:
    """Why the plan is not validated by running it (None: it is); ``other_chunk``: the chunk
    stage chose another chunk than the whole layer."""
    if not cfg.runtime.policy_validate_steps:
        return "runtime.policy_validate_steps=0"
    if args.gpu_memory:
        return "planned for another GPU (--gpu-memory)"
    if not needs_validation(choice) and not other_chunk:
        return "the default chosen: nothing to compare"
    return None


def _why_not_calibrated(args: argparse.Namespace, cfg: Any, choice: Choice) -> str | None:
    """Why the plan's candidates are not calibrated (None: they are)."""
    steps = cfg.runtime.policy_calibrate_steps
    if steps and args.gpu_memory:
        return "planned for another GPU (--gpu-memory)"
    return why_not_calibrated(steps, choice)


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
        f"{s['host_adamw']['gbps']:.0f} GB/s AdamW, {s['host_adamw']['source']}",
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
        f"wrote {out} (train with runtime.policy={out}) and {out.with_suffix('.json')}",
    ]
    return "\n".join(lines)
