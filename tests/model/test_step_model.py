"""The step-time model (``slidedp_core::model``, ``plan.timing``) from Python: the binding, its
errors, and a traced H100 step the model must reproduce."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from slidedp import _native
from slidedp.cli import main
from slidedp.errors import InvalidArgumentError
from slidedp.plan.step_spec import Prediction, StepSpec, predict_step
from slidedp.plan.timing import (
    Links,
    Ranks,
    Rates,
    spec_from_shapes,
    spec_from_trace,
    traced_step_s,
)

TRACES = Path(__file__).parents[2] / "benchmarks" / "traces"


def _spec(layers: int = 3, update_s: float = 0.1) -> StepSpec:
    groups = layers + 2
    return StepSpec(
        forward_s=(1.0,) * layers, backward_s=(2.0,) * layers, embed_forward_s=0.0,
        head_s=1.0, embed_backward_s=0.0, load_s=(0.5,) * groups,
        grad_copy_s=(0.5,) * groups, update_s=(update_s,) * groups, slots=2,
        grad_slots=4, clipping=False,
    )  # fmt: skip


def test_the_binding_returns_the_rust_prediction() -> None:
    p = predict_step(_spec())
    # 3 x (1 + 2) + 1 = 10 s of compute; the boundary adds the last copies (layer 1, embedding),
    # the embedding's update and the next step's first two loads: 1 + 0.1 + 1
    assert p.step_s == pytest.approx(12.1)
    assert p.busy_s["compute"] == pytest.approx(10.0)
    assert p.critical_path[-1] == "t3 end"
    slow = predict_step(_spec(update_s=3.0))
    assert slow.regime.startswith("Update-bound")


def test_a_bad_spec_is_one_error_naming_the_field() -> None:
    bad = dataclasses.replace(_spec(), update_s=(0.1,))
    with pytest.raises(InvalidArgumentError, match="update_s has 1 entries, expected 5"):
        predict_step(bad)
    missing = _spec().to_json()
    del missing["head_s"]
    with pytest.raises(InvalidArgumentError, match="head_s"):
        _native.predict_step(json.dumps(missing))


@pytest.mark.parametrize(
    ("trace", "clipping"),
    [("qwen3-4b-h100-mirror-clip-b16.json", True), ("qwen3-4b-h100-mirror-noclip-b16.json", False)],
)
def test_a_traced_h100_step_is_predicted_within_ten_percent(trace: str, clipping: bool) -> None:
    # measured 2026-11-22 (BENCHMARKS.md); the model is given each operation's traced duration
    # and must reproduce the step from the engine's dependencies alone
    data = json.loads((TRACES / trace).read_text())
    spec = spec_from_trace(data, slots=2, grad_slots=4)
    assert spec.clipping is clipping
    assert len(spec.forward_s) == 36
    error = predict_step(spec).step_s / traced_step_s(data) - 1
    assert abs(error) <= 0.10, error


def test_bench_model_prints_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.json"
    trace = TRACES / "qwen3-4b-h100-mirror-clip-b4.json"
    assert main(["bench", "model", str(trace), "--json", str(out)]) == 0
    assert "qwen3-4b-h100-mirror-clip-b4.json" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert abs(row["error"]) < 0.02
    assert row["regime"].startswith("Update-bound")  # B=4: one AdamW pass binds the step


def test_the_layer_profile_calibrates_the_layers_and_predicts_a_traced_layout() -> None:
    """The H100 layer profile's times replace the FLOPs-rate ones for the profiled policies;
    with them the model predicts the traced `24xSAC.mm, 12xN` step (no clipping, B=16) within
    10% (BENCHMARKS.md: traced 1.512 s)."""
    import functools

    import torch

    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.models.shapes import resolve_shape
    from slidedp.plan.machine import adamw_gbps, gpu_peak
    from slidedp.plan.policy import resolve_policy
    from slidedp.plan.timing import layer_times, spec_from_shapes

    profile = json.loads((TRACES.parent / "qwen3-4b-h100-profile-layer-b16.json").read_text())
    times = layer_times(profile)
    adapter = HFAdapter(resolve_shape("qwen3-4b"))
    runtime = RuntimeSection.from_keys(layers="24xSAC.mm, 12xN")
    policy = resolve_policy(runtime, adapter, mirror=True, device=torch.device("cuda"))
    peak, _ = gpu_peak("NVIDIA H100 80GB HBM3")
    assert peak is not None
    shaped = functools.partial(
        spec_from_shapes, adapter, policy, batch=16, seq_len=1024, clipping=False,
        offloaded_bytes=[0] * adapter.num_layers,
    )  # fmt: skip
    spec = shaped(rates=Rates(peak, adamw_gbps(16), measured=times))
    assert spec.forward_s[0] == times["SAC.mm-r0"][0]
    assert spec.backward_s[-1] == times["N-r0"][1]
    uncalibrated = shaped(rates=Rates(peak, adamw_gbps(16)))
    assert uncalibrated.backward_s[-1] != spec.backward_s[-1]
    assert predict_step(spec).step_s == pytest.approx(1.512, rel=0.10)


@dataclasses.dataclass(frozen=True)
class _RouteStep:
    spec: StepSpec
    prediction: Prediction


def _route_step(ranks: Ranks, *, batch: int, clipping: bool) -> _RouteStep:
    """Qwen3-1.7B on the 2x H200 host of BENCHMARKS.md ("Two GPUs: ... routes"): its measured
    layer-sized reduce and all-gather, its H2D/D2H, AdamW at 147 GB/s."""
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.models.shapes import resolve_shape
    from slidedp.plan.policy import resolve_policy

    adapter = HFAdapter(resolve_shape("qwen3-1.7b"))
    runtime = RuntimeSection.from_keys(gpus=ranks.count)
    runtime = runtime.with_keys(grad_route=ranks.grad_route)
    runtime = runtime.with_keys(param_route=ranks.param_route)
    policy = resolve_policy(runtime, adapter, mirror=True, device=torch.device("cuda"))
    links = Links(h2d_gbps=55, d2h_gbps=54, reduce_gbps=301, gather_gbps=320)
    spec = spec_from_shapes(
        adapter, policy, batch=batch, seq_len=1024, rates=Rates(989e12, 147, links=links),
        clipping=clipping, offloaded_bytes=[0] * adapter.num_layers, ranks=ranks,
    )  # fmt: skip
    return _RouteStep(spec, predict_step(spec))


def test_the_routes_in_the_spec_and_the_gpu_route_beats_the_cpu_route() -> None:
    one = _route_step(Ranks(1), batch=16, clipping=False)
    gpu = _route_step(Ranks(2, "gpu", "replicated"), batch=16, clipping=False)
    sharded = _route_step(Ranks(2, "gpu", "sharded"), batch=16, clipping=False)
    cpu = _route_step(Ranks(2, "cpu", "replicated"), batch=16, clipping=False)
    layer = 1  # a decoder layer's group
    # gpu route: a reduce per group, bf16 copies; sharded: half the H2D, then the all-gather
    assert gpu.spec.reduce_s
    assert not gpu.spec.host_sum_s
    assert not one.spec.reduce_s
    assert sharded.spec.load_s[layer] == pytest.approx(
        gpu.spec.load_s[layer] / 2 + gpu.spec.load_s[layer] * 55 / 320
    )
    # cpu route: bf16 copies (as the gpu route's), a host sum of every group on the update lane
    # (the owners' workers sum before AdamW, in the same DRAM): 2 bf16 copies read, the f32
    # sum written (its Σ g² in the same pass), against AdamW's 28 bytes per parameter
    assert cpu.spec.grad_copy_s[layer] == pytest.approx(gpu.spec.grad_copy_s[layer])
    assert all(s > 0 for s in cpu.spec.host_sum_s)
    assert cpu.spec.host_sum_s[layer] == pytest.approx((2 * 2 + 4) * cpu.spec.update_s[layer] / 28)
    step = {k: v.prediction.step_s for k, v in
            {"one": one, "gpu": gpu, "sharded": sharded, "cpu": cpu}.items()}  # fmt: skip
    # as measured there (0.77 s on 1 GPU, 0.81 s on either gpu route): the gpu route costs a
    # few % over one GPU and beats the cpu route, whose sums lengthen the update lane (1.12 s
    # measured when the training threads summed f32 copies; not yet measured with the workers
    # summing bf16 copies, which the model puts within a few % of the gpu route at 2 GPUs).
    # No two-pool rate on record: the owners' two lanes share the node's 147 GB/s, rank 0's
    # with the embedding (0.31B of 2.03B parameters) the next forward waits for first: +10%
    assert step["one"] < step["gpu"] < 1.12 * step["one"]
    assert abs(step["sharded"] / step["gpu"] - 1) < 0.05
    assert step["gpu"] < step["cpu"] < 1.05 * step["gpu"]
    exposed = cpu.prediction.exposed_s
    assert exposed.get("host", 0.0) == 0  # no sum on the training thread
    assert exposed["update"] > gpu.prediction.exposed_s.get("update", 0.0)


def test_the_cast_on_delivery_takes_the_probed_cast_rate() -> None:
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.models.shapes import resolve_shape
    from slidedp.plan.policy import resolve_policy

    adapter = HFAdapter(resolve_shape("qwen3-1.7b"))
    policy = resolve_policy(RuntimeSection(), adapter, mirror=False, device=torch.device("cuda"))
    shaped = functools.partial(
        spec_from_shapes, adapter, policy, batch=16, seq_len=1024, clipping=True,
        offloaded_bytes=[0] * adapter.num_layers,
    )  # fmt: skip
    table, probed = shaped(rates=Rates(989e12, 110)), shaped(rates=Rates(989e12, 110, 26.0))
    assert probed.cast_s[1] == pytest.approx(table.cast_s[1] * 78.0 / 26.0)
    assert predict_step(probed).step_s > predict_step(table).step_s


def test_gpu_resident_groups_skip_the_host_and_shorten_a_host_bound_step() -> None:
    """Qwen3-1.7B B=16 with clipping, as `slidedp plan` chose on the H100 (BENCHMARKS.md,
    issue #16, twelfth lease: 27 layers and the embeddings resident ran 0.485 s a step against
    the all-host default's 1.014 s in validation). Resident groups have no load, cast, copy nor
    host update; their AdamW is device time; the step is no longer update-bound."""
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.models.shapes import resolve_shape
    from slidedp.plan.cost import resident_update_s
    from slidedp.plan.policy import resolve_policy

    adapter = HFAdapter(resolve_shape("qwen3-1.7b"))

    def spec(resident_layers: int, embeddings: bool) -> StepSpec:
        runtime = RuntimeSection.from_keys(
            resident_layers=resident_layers, resident_embeddings=embeddings
        )
        policy = resolve_policy(runtime, adapter, mirror=False, device=torch.device("cuda"))
        return spec_from_shapes(
            adapter, policy, batch=16, seq_len=1024, rates=Rates(989e12, 116), clipping=True,
            offloaded_bytes=[0] * adapter.num_layers,
        )  # fmt: skip

    host, resident = spec(0, False), spec(27, True)
    layers = adapter.num_layers
    assert host.resident == ()
    # the embedding and layers 0..26 resident, layer 27 streams, the head resident
    assert resident.resident == (True,) * 28 + (False, True)
    layer_params = adapter.group_specs()[1].numel
    assert resident.backward_s[0] == pytest.approx(
        host.backward_s[0] + resident_update_s(layer_params)
    )
    assert resident.backward_s[-1] == host.backward_s[-1]
    assert resident.embed_backward_s > host.embed_backward_s == 0.0
    fast, slow = predict_step(resident), predict_step(host)
    assert slow.regime.startswith("Update-bound")
    assert fast.regime.startswith("GPU-bound")
    # measured 2.09x; predicted 1.44x: the uncalibrated layer rate (36.5% of the peak) is
    # slower than the measured run's Liger layers (48% MFU), and the resident step is compute
    assert slow.step_s / fast.step_s > 1.4
    assert layers == 28
    # without clipping at a slow host (40 GB/s): the host lane binds, on streamed groups only
    # (8 resident layers and the embeddings: groups 0..8 and 29 take no ring slot nor update)
    runtime = RuntimeSection.from_keys(resident_layers=8, resident_embeddings=True)
    policy = resolve_policy(runtime, adapter, mirror=True, device=torch.device("cuda"))
    free = predict_step(spec_from_shapes(
        adapter, policy, batch=16, seq_len=1024, rates=Rates(989e12, 40), clipping=False,
        offloaded_bytes=[0] * layers,
    ))  # fmt: skip
    assert free.regime.startswith("Update-bound")
    on_path = {op.rsplit(" g", 1)[1] for op in free.critical_path if " g" in op}
    assert on_path, free.critical_path
    assert not on_path & {*map(str, range(9)), "29"}, free.critical_path


def test_resident_groups_on_four_ranks_are_priced_per_owner_and_broadcast() -> None:
    """Qwen3-14B on 4 GPUs of a node (gpu route), 8 layers and the embeddings resident: each
    resident group is still reduced onto its owner (the route's ``reduce_s``), never loaded,
    copied nor updated on the host; its device update is the owner's (a quarter of the update
    on each rank, in parallel) plus the broadcast of its bf16 weights at the all-gather's rate.
    At a host that binds the 4-rank step, keeping them resident shortens it."""
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.models.shapes import resolve_shape
    from slidedp.plan.cost import resident_update_s
    from slidedp.plan.policy import resolve_policy

    adapter = HFAdapter(resolve_shape("qwen3-14b"))
    links = Links(reduce_gbps=300.0, gather_gbps=250.0)

    def spec(resident_layers: int, embeddings: bool) -> StepSpec:
        runtime = RuntimeSection.from_keys(
            resident_layers=resident_layers, resident_embeddings=embeddings
        )
        policy = resolve_policy(runtime, adapter, mirror=True, device=torch.device("cuda"))
        return spec_from_shapes(
            adapter, policy, batch=16, seq_len=1024, rates=Rates(989e12, 83, links=links),
            clipping=True, offloaded_bytes=[0] * adapter.num_layers, ranks=Ranks(4, "gpu"),
        )  # fmt: skip

    host, resident = spec(0, False), spec(8, True)
    layers = adapter.num_layers
    assert resident.resident == (True,) * 9 + (False,) * (layers - 8) + (True,)
    assert len(resident.reduce_s) == layers + 2  # every gradient reduced onto its owner
    n = adapter.group_specs()[1].numel
    owner_update_and_broadcast = resident_update_s(n) / 4 + 2 * n / (250.0 * 1e9)
    assert resident.backward_s[0] == pytest.approx(host.backward_s[0] + owner_update_and_broadcast)
    assert resident.backward_s[8] == host.backward_s[8]
    assert resident.embed_backward_s > host.embed_backward_s
    assert predict_step(resident).step_s < predict_step(host).step_s
