"""A Chrome / Perfetto trace of one training step: one track per lane.

Open the JSON in https://ui.perfetto.dev or chrome://tracing. Tracks: host cast (f32→bf16 into
staging), H2D, compute, activation offload/reload, gradient D2H, CPU update (the Rust worker's
requests, labelled by group), and the compute lane's waits (version gates, copies). Everything is
on CLOCK_MONOTONIC; GPU spans are placed through a reference event (``LaneClock.start_trace``).
Times are µs from the step's first span, whose CLOCK_MONOTONIC second is ``otherData.origin_s``:
a profile taken on that clock (``perf record -k CLOCK_MONOTONIC``) lines up with the trace.

Example::

    engine.start_trace(); engine.step(t, batch, lr); engine.lane_times()
    write_trace(Path("step.json"), engine.stop_trace())
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slidedp.runtime.lanes import Span

TRACKS = {  # lane key → (track id, track name)
    "prep": (1, "host cast (prep)"),
    "h2d": (2, "H2D"),
    "compute": (3, "compute"),
    "offload": (4, "activation offload/reload"),
    "d2h": (5, "gradient D2H"),
    "update": (6, "CPU update"),
    "nodes": (8, "cross-node all-reduce"),
}
WAIT_TRACK = (7, "waits (compute lane)")


@dataclass(frozen=True)
class StepTrace:
    step: int
    spans: list[Span]  # lanes and waits
    updates: list[tuple[str, float, float]]  # (group name, start, end)


def trace_origin_s(trace: StepTrace) -> float | None:
    """The CLOCK_MONOTONIC second of the step's first span, the trace's time 0 (None: no span)."""
    return min((s for _, s, _ in [*trace.spans, *trace.updates]), default=None)


def chrome_events(trace: StepTrace) -> list[dict[str, object]]:
    t0 = trace_origin_s(trace)
    if t0 is None:
        return []
    spans = [(k, s, e) for k, s, e in trace.spans] + [("update", s, e) for _, s, e in trace.updates]
    events: list[dict[str, object]] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
        for tid, name in [*TRACKS.values(), WAIT_TRACK]
    ]
    events.append(
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"step {trace.step}"}}
    )
    labels = [k for k, _, _ in trace.spans] + [g for g, _, _ in trace.updates]
    for (key, start, end), label in zip(spans, labels, strict=True):
        tid = TRACKS[key][0] if key in TRACKS else WAIT_TRACK[0]
        events.append(
            {
                "ph": "X",
                "name": label,
                "pid": 0,
                "tid": tid,
                "ts": round((start - t0) * 1e6, 3),
                "dur": round(max(end - start, 0.0) * 1e6, 3),
            }
        )
    return events


def write_trace(path: Path, trace: StepTrace) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"clock": "CLOCK_MONOTONIC", "origin_s": trace_origin_s(trace), "step": trace.step}
    path.write_text(
        json.dumps(
            {"traceEvents": chrome_events(trace), "displayTimeUnit": "ms", "otherData": meta}
        )
    )
    return path
