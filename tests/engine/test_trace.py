"""``runtime.trace_path``: a Chrome/Perfetto trace of one step, one track per lane."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.runtime.trace import TRACKS, WAIT_TRACK, StepTrace, write_trace

pytestmark = pytest.mark.e2e  # every test here trains end to end


def test_the_traced_step_has_every_lane_on_one_timeline(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=3)
    data = write_data(tmp_path / "data.jsonl", 16)
    trace = tmp_path / "trace.json"
    config = write_config(
        tmp_path / "c.yaml",
        model,
        data,
        tmp_path / "out",
        train={"max_steps": 3, "max_grad_norm": 0.0},  # updates overlap the backward
        runtime={"trace_path": str(trace), "trace_step": 1, "offload_ratio": 1.0},
    )
    assert main(["train", str(config)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {name for _, name in [*TRACKS.values(), WAIT_TRACK]}
    spans = [e for e in events if e["ph"] == "X"]
    by_track: dict[int, list[dict[str, object]]] = {}
    for e in spans:
        by_track.setdefault(int(e["tid"]), []).append(e)
    for lane in ("h2d", "compute", "offload", "d2h", "update"):
        assert by_track.get(TRACKS[lane][0]), f"no {lane} span"
    updates = {e["name"] for e in by_track[TRACKS["update"][0]]}
    assert updates <= {"embed", "head", "layers.0", "layers.1", "layers.2"}
    assert len(updates) >= 3, "the step's layer updates run inside it"
    assert min(float(e["ts"]) for e in spans) == 0.0
    assert all(float(e["dur"]) >= 0 for e in spans)
    meta = json.loads(trace.read_text())["otherData"]
    assert meta["clock"] == "CLOCK_MONOTONIC"
    assert meta["step"] == 1
    assert 0 < meta["origin_s"] < time.monotonic()  # the step's time 0 on that clock


def test_the_trace_says_where_its_time_zero_is_on_the_monotonic_clock(tmp_path: Path) -> None:
    trace = StepTrace(step=4, spans=[("compute", 10.5, 10.75), ("h2d", 10.25, 10.5)],
                      updates=[("layers.0", 10.75, 11.0)])  # fmt: skip
    meta = json.loads(write_trace(tmp_path / "t.json", trace).read_text())
    assert meta["otherData"] == {"clock": "CLOCK_MONOTONIC", "origin_s": 10.25, "step": 4}
    starts = sorted(meta["otherData"]["origin_s"] + e["ts"] / 1e6
                    for e in meta["traceEvents"] if e["ph"] == "X")  # fmt: skip
    assert starts == [10.25, 10.5, 10.75]  # each span's own monotonic start
    empty = json.loads(write_trace(tmp_path / "e.json", StepTrace(0, [], [])).read_text())
    assert empty["otherData"]["origin_s"] is None
