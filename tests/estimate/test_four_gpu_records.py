"""The step-time model against every four-GPU data-parallel record on 4x H200 (2026-11-28,
benchmarks/2026-11-28-qwen3-14b-several-gpus.md, benchmarks/four-gpus-14b/): each run of
ours predicted as ``slidedp bench train --predict`` predicts it (``bench.predict.
predict_report``), with the rates the record's one-GPU run of the fixed default measured on
the same machine in place of the probes it does not carry:

- the layer probe: its compute lane (``lanes_s.compute_s``) less the head's FLOPs-rate time,
  as a factor on every layer's FLOPs-rate time (``plan.timing.compute_times``), so a layer
  policy the run did not time (AutoPolicy's) keeps its replay's share;
- the host probe: its update lane's AdamW rate, 28 B per parameter over ``lanes_s.update_s``;
  for four ranks, the rate of one of four pools at once (``pool_adamw_gbps``, the probe's
  ``--ranks 4``), derived from the same JSON's four-GPU run of the fixed default: rank 0's
  update lane (``lanes_s``), 28 B per parameter of the groups it owns
  (``runtime.dist.group_owner``: the embedding and every fourth layer, 4.08B of 14.77B on
  Qwen3-14B) over its ``update_s``.

NCCL's rates: the records of four ranks carry none (``--no-collectives``), so the model's
assumed 360 GB/s (the same kind's four-rank all-gather measured 337). The one-GPU rows check
the schedule (their compute and update are the calibration); the four-GPU rows are the
prediction: does the model, given one GPU's compute and four pools' AdamW rate, find the step
of four, each owner's updates on its own lane.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slidedp.bench.predict import Probe, predict_report
from slidedp.config_runtime import RuntimeSection
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.plan.layout import parse_entry
from slidedp.plan.machine import gpu_peak
from slidedp.plan.policy import resolve_policy
from slidedp.plan.timing import ADAMW_BYTES_PER_PARAM, REPLAY_SHARE, Ranks, Rates, compute_times
from slidedp.runtime.dist import group_owner

RECORDS = Path(__file__).parents[2] / "benchmarks" / "four-gpus-14b"
# record -> the JSON whose one-GPU fixed-default run calibrates it (the same machine: the
# resident and AutoPolicy runs' one-GPU halves were cut or ran a variant, so the call minutes
# before on the same warm machine)
CALIBRATION = {
    "qwen3-14b-4xh200-b64.json": "qwen3-14b-4xh200-b64.json",
    "qwen3-14b-4xh200-b16.json": "qwen3-14b-4xh200-b16.json",
    "qwen3-14b-4xh200-b16-fixed-and-r8-1gpu.json": "qwen3-14b-4xh200-b16-fixed-and-r8-1gpu.json",
    "qwen3-14b-4xh200-b16-resident8.json": "qwen3-14b-4xh200-b16-fixed-and-r8-1gpu.json",
    "qwen3-14b-4xh200-b16-auto-route.json": "qwen3-14b-4xh200-b16-auto-variant-1gpu.json",
    "qwen3-14b-4xh200-b16-auto-variant-1gpu.json": "qwen3-14b-4xh200-b16-auto-variant-1gpu.json",
    "qwen3-32b-4xh200-b16.json": "qwen3-32b-4xh200-b16.json",
}
# the goal: the model within 10% of every four-GPU run
BOUND = 0.10
# the runs of ours the records hold: (record, ranks, route) -> the measured step, s
MEASURED = {
    ("qwen3-14b-4xh200-b64.json", 4, "sharded/gpu"): 12.816,
    ("qwen3-14b-4xh200-b64.json", 1, None): 12.519,
    ("qwen3-14b-4xh200-b16.json", 4, "sharded/gpu"): 4.977,
    ("qwen3-14b-4xh200-b16.json", 1, None): 5.454,
    ("qwen3-14b-4xh200-b16-fixed-and-r8-1gpu.json", 4, "sharded/gpu"): 4.545,
    ("qwen3-14b-4xh200-b16-fixed-and-r8-1gpu.json", 1, None): 4.877,
    ("qwen3-14b-4xh200-b16-resident8.json", 4, "sharded/gpu"): 3.961,
    ("qwen3-14b-4xh200-b16-auto-route.json", 4, "auto"): 3.099,
    ("qwen3-14b-4xh200-b16-auto-route.json", 4, "sharded/gpu"): 4.532,
    ("qwen3-14b-4xh200-b16-auto-variant-1gpu.json", 4, "sharded/gpu"): 4.523,
    ("qwen3-14b-4xh200-b16-auto-variant-1gpu.json", 1, None): 4.814,
    ("qwen3-32b-4xh200-b16.json", 4, "sharded/gpu"): 10.287,
    ("qwen3-32b-4xh200-b16.json", 1, None): 10.576,
}


def _one_gpu_run(report: dict[str, Any]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = [
        r for r in report["runs"] if r["system"] == "ours" and r.get("world", 1) == 1
    ]
    (run,) = runs
    return run


def four_pool_gbps(calibration: dict[str, Any], adapter: HFAdapter) -> float:
    """One of four pools' AdamW rate, B/s: rank 0's update lane in the calibration JSON's
    four-GPU run of the fixed default (the module's docstring)."""
    (run,) = (r for r in calibration["runs"] if r["system"] == "ours" and r.get("world") == 4
              and r["resident_layers"] == 0 and r["layout"].endswith("xF-r0"))  # fmt: skip
    params = [g.numel for g in adapter.group_specs()]
    owned = sum(n for g, n in enumerate(params) if group_owner(g, 4) == 0)
    return ADAMW_BYTES_PER_PARAM * owned / float(run["lanes_s"]["update_s"])


def record_probe(report: dict[str, Any], calibration: dict[str, Any], config_dir: Path) -> Probe:
    """A ``predict_report`` probe answering with the calibration run's rates (the module's
    docstring says how)."""
    run = _one_gpu_run(calibration)
    adapter = HFAdapter.from_dir(config_dir)
    peak = gpu_peak(report["device_name"])[0]
    assert peak is not None
    flops_rates = Rates(peak, adamw_gbps=1.0)  # the FLOPs-rate times; AdamW is not read
    # the fixed default, the calibration run's layout
    policy = resolve_policy(RuntimeSection.from_keys(), adapter, mirror=True,
                            device=torch.device("cuda"))  # fmt: skip

    def flops_times(batch: int) -> tuple[list[float], list[float], float]:
        return compute_times(adapter, policy, batch=batch, seq_len=report["seq_len"],
                             rates=flops_rates, ranks=Ranks())  # fmt: skip

    forward, backward, head = flops_times(run["batch"])
    factor = (float(run["lanes_s"]["compute_s"]) - head) / (sum(forward) + sum(backward))

    host_gbps = ADAMW_BYTES_PER_PARAM * report["model"]["params"] / run["lanes_s"]["update_s"]
    pool_gbps = four_pool_gbps(calibration, adapter)

    def probe(kind: str, args: dict[str, Any], _out: Path) -> dict[str, Any]:
        if kind == "host":  # no rate alone: these throughout
            assert args["ranks"] in (1, 4)
            pools = {"pool_adamw_gbps": pool_gbps / 1e9} if args["ranks"] == 4 else {}
            return {"adamw_gbps": host_gbps / 1e9} | pools
        forward = factor * flops_times(args["batch"])[0][0]  # every layer alike
        candidates = []
        for family in args["families"].split(","):
            for ratio in args["ratios"].split(","):
                _, policy = parse_entry(f"{family}-r{ratio}", 0.0)
                backward = (2 + REPLAY_SHARE[policy.family]) * forward
                candidates.append({"policy": str(policy), "forward_s": forward,
                                   "backward_s": backward})  # fmt: skip
        return {"candidates": candidates}

    return probe


def predictions(name: str, tmp_path: Path) -> list[dict[str, Any]]:
    report = json.loads((RECORDS / name).read_text())
    calibration = json.loads((RECORDS / CALIBRATION[name]).read_text())
    resolve_shape(report["shape"]).to_json_file(tmp_path / "config.json")
    probe = record_probe(report, calibration, tmp_path)
    rows: list[dict[str, Any]] = predict_report(report, tmp_path, probe)
    return rows


@pytest.mark.parametrize("name", sorted(CALIBRATION))
def test_the_model_against_a_four_gpu_record(tmp_path: Path, name: str) -> None:
    """Every run of ours in the record is predicted, each within ``BOUND`` of its measured
    step."""
    rows = predictions(name, tmp_path)
    found = {(name, r["world"], r["route"]): r for r in rows}
    assert set(found) == {k for k in MEASURED if k[0] == name}
    for key, row in found.items():
        assert row["measured_step_s"] == pytest.approx(MEASURED[key], abs=5e-4)
        assert row["error"] == pytest.approx(0.0, abs=BOUND), key
