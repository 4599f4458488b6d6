"""``slidedp bench model TRACE.json ... [--slots 2] [--grad-slots 4]``: the step-time model
(``plan.timing``) against traced steps. Each trace's operations keep their measured durations;
the model adds the engine's dependencies and predicts the step, which is compared with the
traced step's wall time. A check of the dependency structure: the service times come from the
trace itself, not from calibration probes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from slidedp.bench.predict import regime_on
from slidedp.bench.provenance import write_report
from slidedp.cli_args import count, writable
from slidedp.errors import ConfigError
from slidedp.plan.step_spec import predict_step
from slidedp.plan.timing import spec_from_trace, traced_step_s


def compare(path: Path, slots: int, grad_slots: int) -> dict[str, Any]:
    try:
        trace = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the trace {path}: {e}") from None
    try:
        spec = spec_from_trace(trace, slots=slots, grad_slots=grad_slots)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    predicted = predict_step(spec)
    traced = traced_step_s(trace)
    return {
        "trace": str(path),
        "clipping": spec.clipping,
        "traced_step_s": traced,
        "predicted_step_s": predicted.step_s,
        "error": predicted.step_s / traced - 1,
        "exposed_s": predicted.exposed_s,
        "regime": regime_on(predicted.regime, None),  # a trace does not name its device
        "critical_path": list(predicted.critical_path),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "traces", nargs="+", help="traces of `bench train --trace` / runtime.trace_path"
    )
    parser.add_argument("--slots", type=count(1), default=2, help="runtime.slots of the runs")
    parser.add_argument("--grad-slots", type=count(1), default=4, help="runtime.grad_slots")
    parser.add_argument("--json", help="also write the comparison and this run's facts here")


def main(args: argparse.Namespace) -> int:
    writable("--json", args.json)
    rows = [compare(Path(t), args.slots, args.grad_slots) for t in args.traces]
    head = f"{'trace':<48} {'clip':>5} {'traced':>8} {'model':>8} {'error':>7}"
    print(f"{head}  exposed (model), regime")
    for r in rows:
        exposed = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["exposed_s"].items())
        print(
            f"{Path(r['trace']).name:<48} {r['clipping']!s:>5} {r['traced_step_s']:8.3f} "
            f"{r['predicted_step_s']:8.3f} {r['error']:+7.1%}  {exposed}; {r['regime']}"
        )
    write_report(args.json, rows)
    return 0
