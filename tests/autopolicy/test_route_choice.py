"""``runtime.policy: auto`` on several GPUs of one host: the routes stage (``route_choice``)
as a function of the probes' numbers, and ``resolve_auto`` for two GPUs from cached (here:
written) probes, on this machine without a GPU. A resumed run keeps its routes; several nodes
and a rank of another launcher are refused with one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from host_profile.fake import cache_chunks, cache_rate
from slidedp.autopolicy import auto, choose
from slidedp.autopolicy.chunk_choice import chunk_skipped, probe_terms
from slidedp.autopolicy.route_choice import candidate_routes, choose_route
from slidedp.config import TrainConfig, config_from_dict
from slidedp.errors import ConfigError
from slidedp.io.checkpoint import STATE_FILE
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.plan.machine import Machine, update_threads
from slidedp.plan.policy import layer_numel
from slidedp.plan.predict import ROUTES, Route, route_steps
from slidedp.plan.timing import Links, Rates, layer_times
from slidedp.profile.cache import cache_file, write_report
from slidedp.profile.links import links_facts

GIB = 2**30
H200 = "NVIDIA H200"
BATCH = 16  # per GPU
DEFAULT: Route = ("replicated", "gpu")
# the 2x H200 host of BENCHMARKS.md ("Two GPUs"): layer-sized bf16 reduce and all-gather over
# NVLink, pinned copies while AdamW runs, the joint AdamW rate
FAST = {"reduce_gbps": 301.0, "gather_gbps": 320.0}
SLOW = {"reduce_gbps": 5.0, "gather_gbps": 5.0}  # a slow interconnect (PCIe through the host)
H2D, D2H, ADAMW = 55.0, 54.0, 147.0


def _machine() -> Machine:
    return Machine(device="cuda", dtype="bfloat16", cores=32, shm_free_bytes=1024 * GIB,
                   mem_available_bytes=1024 * GIB, gpu_name=H200,
                   gpu_total_bytes=141 * GIB)  # fmt: skip


def _cfg(tmp_path: Path, clipping: bool = False, **runtime: Any) -> TrainConfig:
    """Qwen3-1.7B (published shape, meta device) on 2 GPUs at 16 sequences of 1024 each."""
    model = tmp_path / "qwen3-1.7b"
    model.mkdir(exist_ok=True)
    resolve_shape("qwen3-1.7b").to_json_file(model / "config.json")
    return config_from_dict({
        "model": {"path": str(model)},
        "data": {"path": str(tmp_path / "data.jsonl"), "seq_len": 1024},
        "train": {"max_steps": 10, "global_batch_size": 2 * BATCH, "dtype": "bfloat16",
                  "max_grad_norm": 1.0 if clipping else 0.0},
        "output": {"dir": str(tmp_path / "out")},
        # device auto: a GPU run on the GPU machine, a cache miss here (never measured)
        "runtime": {"device": "auto", "gpus": 2} | runtime,
    })  # fmt: skip


def _profile(adapter: HFAdapter) -> dict[str, Any]:
    """A layer profile as `slidedp profile layer` reports it, F-r0 and N-r0: Qwen3-1.7B's layer
    at 16 x 1024 at the model's FLOPs rate (36.5% of 989 TFLOP/s), N without the replay."""
    forward_s = 6.0e-3
    rows = []
    for policy, backward_s, retained in (("F-r0", 3 * forward_s, 32), ("N-r0", 2 * forward_s, 900)):
        rows.append({
            "policy": policy, "pareto": True, "forward_s": forward_s, "backward_s": backward_s,
            "reload_s": 0.0, "retained_bytes": None, "estimated_retained_bytes": retained << 20,
            "offloaded_bytes": 0, "estimated_offloaded_bytes": 0, "transient_bytes": None,
            "estimated_transient_bytes": 2 * GIB,
        })  # fmt: skip
    return {"batch": BATCH, "seq_len": 1024, "candidates": rows, "cached": "test"}


def _steps(tmp_path: Path, links: dict[str, float], clipping: bool = False) -> dict[Any, float]:
    cfg = _cfg(tmp_path, clipping)
    adapter = HFAdapter.from_dir(cfg.model.path)
    rates = Rates(989e12, ADAMW, links=Links(H2D, D2H, source="measured", **links),
                  measured=layer_times(_profile(adapter)))  # fmt: skip
    return route_steps(cfg, adapter, _machine(), list(ROUTES), rates)


@pytest.mark.parametrize("clipping", [False, True])
def test_on_nvlink_the_default_route_is_kept(tmp_path: Path, clipping: bool) -> None:
    """With the H200 pair's links the two gpu routes are within a few % (sharding halves the
    H2D, the all-gather at 320 GB/s gives most of it back), and the cpu routes are slower (the
    owners' host sums on the update lane, beside AdamW; their bf16 copies are the gpu route's
    bytes): the default, replicated/gpu, stays, since no route is 5% faster."""
    steps = _steps(tmp_path, FAST, clipping)
    assert set(steps) == set(ROUTES)
    gpu, cpu = steps[DEFAULT], steps[("replicated", "cpu")]
    assert abs(steps[("sharded", "gpu")] / gpu - 1) < 0.05
    assert cpu > gpu
    choice = choose_route(steps, DEFAULT)
    assert choice.route == DEFAULT
    assert choice.describe().startswith(f"replicated/gpu (predicted {gpu:.3f} s; ")


def test_on_a_slow_interconnect_the_cpu_route_is_chosen(tmp_path: Path) -> None:
    """At 5 GB/s between the GPUs the gpu route's reduce of every layer's bf16 gradient
    (2 B/param) takes longer than the cpu route's bf16 copies over PCIe (2 B/param at 54 GB/s)
    and the host sums (on the owners' update workers, in the DRAM AdamW uses), and the
    sharded route's all-gather (the whole layer at 5 GB/s) longer than the replicated route's
    H2D of the whole layer at 55: replicated/cpu, by over 20%."""
    steps = _steps(tmp_path, SLOW)
    choice = choose_route(steps, DEFAULT)
    assert choice.route == ("replicated", "cpu")
    assert min(steps, key=lambda r: steps[r]) == ("replicated", "cpu")
    assert choice.gain > 1.2
    assert "1." in choice.describe()
    assert "the config's replicated/gpu" in choice.describe()


def test_the_default_is_kept_unless_another_is_min_gain_faster() -> None:
    near: dict[Route, float] = {DEFAULT: 1.04, ("sharded", "gpu"): 1.0}
    assert choose_route(near, DEFAULT).route == DEFAULT
    assert choose_route(near, DEFAULT).kept_default
    far: dict[Route, float] = {DEFAULT: 1.06, ("sharded", "gpu"): 1.0}
    assert choose_route(far, DEFAULT).route == ("sharded", "gpu")
    with pytest.raises(ConfigError, match="no route fits"):
        choose_route({}, DEFAULT)


def test_routes_the_config_sets_are_its_own(tmp_path: Path) -> None:
    assert candidate_routes(_cfg(tmp_path), None) == list(ROUTES)
    assert candidate_routes(_cfg(tmp_path, grad_route="cpu"), None) == [
        ("replicated", "cpu"), ("sharded", "cpu"),
    ]  # fmt: skip
    assert candidate_routes(_cfg(tmp_path, param_route="sharded"), True) == [("sharded", "gpu")]
    # a route set to its default value cannot be told from an unset one (documented)
    assert candidate_routes(_cfg(tmp_path, grad_route="gpu"), None) == list(ROUTES)


CHUNK = 1 << 19  # 1 MiB of BF16: the chunk the cached chunk probe below finds fastest


def _cache_probes(cfg: TrainConfig, adapter: HFAdapter, links: dict[str, float]) -> None:
    """The host, chunk and link probes of this (pretended) 2x H200 host, in the cache."""
    threads = update_threads(cfg, _machine())
    cache_rate(threads, H200, 300.0, joint_gbps=ADAMW, pools=(2, 150.0))  # the rate shared
    # several ranks on the replicated route keep the mirror
    cache_chunks(threads, H200, layer_numel(adapter), True, {0: 1.0, CHUNK: 0.5})
    facts = links_facts(2, H200, layer_numel(adapter))
    write_report(cache_file(None, "links", facts), facts | links | {"measured_s": 1.0})


@pytest.mark.e2e
@pytest.mark.parametrize(("links", "route"), [(FAST, DEFAULT), (SLOW, ("replicated", "cpu"))])
def test_auto_on_two_gpus_chooses_layout_and_routes_from_the_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: dict[str, float], route: Any
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path, clipping=True, policy="auto")
    adapter = HFAdapter.from_dir(cfg.model.path)
    _cache_probes(cfg, adapter, links)
    monkeypatch.setattr(choose, "cached_profile", lambda args: _profile(adapter))
    chosen, line = auto.resolve_auto(cfg, adapter, _machine(), measure=False)
    rt = chosen.runtime
    assert rt.autopolicy.policy == ""
    assert (rt.layout.param_route, rt.layout.grad_route) == route
    # the program keeps layers GPU-resident (each rank owns its groups' state); on the cpu
    # route, which refuses them, the same layout runs with every group on the host
    resident = rt.layout.resident_layers
    assert (resident > 0) == (route[1] == "gpu")
    assert rt.layout.layers != "F"  # the program's placed layout, every layer counted
    assert line is not None
    assert line.startswith(f"policy   auto: {rt.layout.layers}, {resident or 26} GPU-resident")
    assert ("the GPU-resident groups on the host there" in line) == (route[1] == "cpu")
    assert f"; routes {route[0]}/{route[1]} (predicted " in line
    assert f"; reduce {links['reduce_gbps']:.0f}, all_gather " in line
    # the cached chunk probe's choice, shown, and not applied until validated on the ranks
    slots = 4 * -(-layer_numel(adapter) // CHUNK)
    assert line.endswith(" GB/s measured, copies at the PCIe ceilings; chunk the whole layer "
                         f"(1 MiB, {slots} gradient slots (host side 500.0 vs 1000.0 ms for the "
                         "whole layer; cached); not applied unvalidated: `slidedp train` "
                         "validates it); not calibrated (several ranks: the profiled times); "
                         "not validated here (`slidedp train` validates)")  # fmt: skip
    assert (rt.layout.chunk_elems, rt.layout.grad_slots) == (0, 4)

    # the config's own route stays, and validate/estimate without a link probe say why
    fixed, line = auto.resolve_auto(
        _cfg(tmp_path, clipping=True, policy="auto", grad_route="cpu", param_route="sharded"),
        adapter, _machine(), measure=False,
    )  # fmt: skip
    assert (fixed.runtime.layout.param_route, fixed.runtime.layout.grad_route) == ("sharded", "cpu")
    assert line is not None
    assert "fixed by the config" in line
    for f in (tmp_path / "cache").rglob("links-*.json"):
        f.unlink()
    unmeasured, line = auto.resolve_auto(cfg, adapter, _machine(), measure=False)
    assert (unmeasured.runtime.layout.param_route, unmeasured.runtime.layout.grad_route) == DEFAULT
    assert line is not None
    assert (
        "routes replicated/gpu, the config's (the links between the GPUs are not measured)" in line
    )


def test_without_a_profile_validate_says_train_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path, policy="auto")
    adapter = HFAdapter.from_dir(cfg.model.path)
    chosen, line = auto.resolve_auto(cfg, adapter, _machine(), measure=False)
    assert (chosen.runtime.autopolicy.policy, chosen.runtime.layout.layers) == ("", "F")
    assert line == (
        "policy   auto: the layer is not profiled yet, so the default layout and routes are "
        "checked; `slidedp train` profiles it and chooses"
    )


def test_a_resumed_run_keeps_its_layout_and_routes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "out" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    policy = {"layers": "20xF-r0, 8xN-r0", "resident_layers": 0, "param_route": "sharded",
              "grad_route": "cpu"}  # fmt: skip
    (checkpoint / STATE_FILE).write_text(json.dumps({"policy": policy}))
    cfg = _cfg(tmp_path, policy="auto")
    adapter = HFAdapter.from_dir(cfg.model.path)
    chosen, line = auto.resolve_auto(cfg, adapter, _machine(), measure=True, resume=checkpoint)
    rt = chosen.runtime
    assert (rt.layout.layers, rt.layout.param_route, rt.layout.grad_route) == (
        "20xF-r0, 8xN-r0",
        "sharded",
        "cpu",
    )
    assert line == (
        "policy   auto: 20xF-r0, 8xN-r0, 0 GPU-resident, routes sharded/cpu "
        "(kept from checkpoint-4)"
    )
    # a route the config sets wins over the checkpoint's
    policy |= {"param_route": "replicated", "grad_route": "gpu"}
    (checkpoint / STATE_FILE).write_text(json.dumps({"policy": policy}))
    own = dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(grad_route="cpu"))
    kept, _ = auto.resolve_auto(own, adapter, _machine(), measure=True, resume=checkpoint)
    assert (kept.runtime.layout.param_route, kept.runtime.layout.grad_route) == (
        "replicated",
        "cpu",
    )


def test_several_nodes_and_other_launchers_are_refused_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = HFAdapter.from_dir(_cfg(tmp_path).model.path)
    nodes = _cfg(tmp_path, policy="auto", nodes=2, master_addr="127.0.0.1")
    with pytest.raises(
        ConfigError, match=r"^runtime\.policy=auto chooses for the GPUs of one host"
    ):
        auto.resolve_auto(nodes, adapter, _machine(), measure=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of torchrun
    with pytest.raises(ConfigError, match="chooses once, before the ranks start"):
        auto.resolve_auto(_cfg(tmp_path, policy="auto"), adapter, _machine(), measure=False)


def test_estimate_on_two_gpus_predicts_with_the_cached_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``slidedp estimate`` of a 2-GPU run takes the link and host probes where cached: the
    same rates auto predicts the routes with."""
    from slidedp.estimate_report import estimate_run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path)
    adapter = HFAdapter.from_dir(cfg.model.path)
    steps = {}
    for name, links in (("fast", FAST), ("slow", SLOW)):
        _cache_probes(cfg, adapter, links)
        model = estimate_run(cfg, adapter, _machine()).step_model
        assert model is not None
        assert "reduce and all_gather between the GPUs (cached)" in model.calibration
        steps[name] = model.step_s
    assert steps["slow"] > 1.3 * steps["fast"]  # the gpu route's reduce at 5 GB/s


def test_a_route_without_the_mirror_casts_at_the_probed_rate(tmp_path: Path) -> None:
    """Without the BF16 mirror (set off), each rank casts what it loads on its host thread: the
    whole layer on the replicated route, its share on the sharded one. A slower probed cast
    slows both, the replicated route more."""
    cfg = _cfg(tmp_path, bf16_mirror=False)
    adapter = HFAdapter.from_dir(cfg.model.path)
    routes = [DEFAULT, ("sharded", "gpu")]

    def steps(cast_gbps: float) -> dict[Any, float]:
        rates = Rates(989e12, ADAMW, cast_gbps, Links(H2D, D2H, source="measured", **FAST),
                      layer_times(_profile(adapter)))  # fmt: skip
        return route_steps(cfg, adapter, _machine(), routes, rates)

    fast, slow = steps(80.0), steps(2.0)
    sharded = slow[("sharded", "gpu")] - fast[("sharded", "gpu")]
    assert sharded > 0.1
    assert slow[DEFAULT] - fast[DEFAULT] > 1.5 * sharded


def test_the_chunk_probe_takes_the_default_runs_mirror_whatever_the_policy(
    tmp_path: Path,
) -> None:
    """The launcher's child gets the config with ``runtime.policy: auto``; on the sharded
    route the mirror is decided by the estimate, which refuses an unresolved policy: the probe
    takes the fixed default's (a child that raised there failed every such run)."""
    cfg = _cfg(tmp_path, policy="auto", param_route="sharded")
    adapter = HFAdapter.from_dir(cfg.model.path)
    numel, threads, mirror = probe_terms(cfg, adapter, _machine())
    assert (numel, threads) == (layer_numel(adapter), update_threads(cfg, _machine()))
    assert mirror  # 1 TiB of RAM: it fits
    assert chunk_skipped(cfg.runtime, _machine()) is None
    rings = cfg.runtime.with_keys(grad_slots=8)
    assert chunk_skipped(rings, _machine()) == (
        "the whole layer (the config sets runtime.grad_slots=8)")  # fmt: skip
