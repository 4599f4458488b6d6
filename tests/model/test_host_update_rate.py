"""The host update's rate in the step-time model: alone for the share of the update no copy
overlaps, under the copies for the rest (``plan.timing.host_update_gbps``), checked against
the 4x H200 runs of Qwen3-14B in benchmarks/four-gpus-14b."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from estimate.test_four_gpu_records import four_pool_gbps
from slidedp.config_runtime import RuntimeSection
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.plan.machine import gpu_peak
from slidedp.plan.policy import resolve_policy
from slidedp.plan.step_spec import predict_step
from slidedp.plan.timing import Ranks, Rates, host_update_gbps, spec_from_shapes

RUNS = Path(__file__).parents[2] / "benchmarks" / "four-gpus-14b"
# the host of those runs: AdamW alone at 64 threads (157-163 GB/s) and while its four GPUs
# copy (~83 GB/s), as measured on it before the runs; the probe's rate under copies is one
# GPU's, so 83 is a floor of it and the predictions below lean long
ALONE_GBPS, UNDER_COPIES_GBPS = 160.0, 83.0
# the F layer's forward and backward at B=16 x 1024: the runs' compute lane (2.93-3.03 s a
# step) less the head's, over 40 layers of one forward and a backward of two
LAYER_S = (0.0225, 0.045)


def test_the_update_runs_alone_where_no_copy_overlaps_it() -> None:
    rates = Rates(989e12, UNDER_COPIES_GBPS, adamw_alone_gbps=ALONE_GBPS)
    assert host_update_gbps(rates, 0.0) == ALONE_GBPS
    assert host_update_gbps(rates, 1.0) == UNDER_COPIES_GBPS
    assert host_update_gbps(rates, 3.0) == UNDER_COPIES_GBPS  # more copies than the probe's
    # half the bytes at each rate: the seconds add up
    assert host_update_gbps(rates, 0.5) == pytest.approx(2 / (1 / 83 + 1 / 160))
    # no rate alone (a CPU probe, the table): the one rate throughout
    assert host_update_gbps(Rates(989e12, 40.0), 0.5) == 40.0


RECORD = RUNS / "qwen3-14b-4xh200-b16-auto-variant-1gpu.json"


def _default_run(world: int) -> tuple[float, str]:
    """The fixed default's measured step on ``world`` GPUs, and its routes."""
    report = json.loads(RECORD.read_text())
    (run,) = (r for r in report["runs"] if r["system"] == "ours" and r["world"] == world)
    assert run["layout"] == "40xF-r0"
    assert run["mirror"]
    return float(run["step_time_s"]), str(run["route"] or "replicated/gpu")


@pytest.mark.parametrize("world", [1, 4])
def test_the_14b_default_on_4xh200_is_predicted_from_the_host_rates(world: int) -> None:
    """Qwen3-14B B=16, the fixed default, clipping, on 1 and 4 H200s: within 20% of the
    measured step with the update partly alone (+7%), on four each owner's lane at its pool's
    rate (rank 0's update lane in the four-GPU run, ``four_pool_gbps``) within 10% (+2%). The
    rate under the copies throughout (one GPU), or the node's one rate shared by the four
    owners' lanes (no pool rate), predicts the step over 30% too long."""
    adapter = HFAdapter(resolve_shape("qwen3-14b"))
    measured_s, route = _default_run(world)
    param_route, grad_route = route.split("/")
    runtime = RuntimeSection.from_keys(gpus=world, param_route=param_route, grad_route=grad_route)
    policy = resolve_policy(runtime, adapter, mirror=True, device=torch.device("cuda"))
    peak, _ = gpu_peak("NVIDIA H200")
    assert peak is not None
    four_pools = four_pool_gbps(json.loads(RECORD.read_text()), adapter) / 1e9

    def step_s(alone_gbps: float | None, pool_gbps: float | None = None) -> float:
        rates = Rates(peak, UNDER_COPIES_GBPS, measured={"F-r0": LAYER_S},
                      adamw_alone_gbps=alone_gbps, pool_gbps=pool_gbps)  # fmt: skip
        spec = spec_from_shapes(
            adapter, policy, batch=16, seq_len=1024, rates=rates, clipping=True,
            offloaded_bytes=[0] * adapter.num_layers,
            ranks=Ranks(world, grad_route, param_route),  # type: ignore[arg-type]
        )  # fmt: skip
        return predict_step(spec).step_s

    # one GPU, 20%: the rate under copies is four GPUs' (a floor of one's), the copies' rates
    # are the PCIe ceilings (these GPUs' H2D measured 44-55 GB/s) and the layer times a fit
    if world == 1:
        assert step_s(ALONE_GBPS) == pytest.approx(measured_s, rel=0.20)
        assert step_s(None) > 1.3 * measured_s
    else:
        assert step_s(ALONE_GBPS, four_pools) == pytest.approx(measured_s, rel=0.10)
        assert step_s(ALONE_GBPS) > 1.3 * measured_s
