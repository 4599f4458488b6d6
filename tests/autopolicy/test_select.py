"""The policy selector's layout stage (``autopolicy.select``) and ``slidedp plan``: the integer
program's choice equals a brute-force search over every count vector, the fixed default is
always feasible and never predicted faster than the choice, and the written policy file trains."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from autopolicy.runs import written_policy
from engine.tiny import make_model, read_metrics, write_config, write_data
from host_profile.fake import cache_rate
from slidedp.autopolicy import auto, choose, select
from slidedp.autopolicy.command import report_path
from slidedp.autopolicy.program import Problem, solve
from slidedp.autopolicy.select import (
    MIN_GAIN,
    activation_budget,
    host_tail_s,
    host_update_s_per_layer,
    select_layout,
)
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import (
    RESIDENT_UPDATE_BYTES_PER_PARAM,
    RESIDENT_UPDATE_GBPS,
    resident_bytes_per_layer,
    resident_embedding_bytes,
    resident_embedding_update_s,
)
from slidedp.plan.layout import parse_layout
from slidedp.plan.machine import Machine, update_threads

MIB = 2**20
GIB = 2**30
LAYERS = 4
BATCH, SEQ = 4, 32


def _row(policy: str, time_ms: float, retained_mib: float, *, pareto: bool = True,
         offloaded_mib: float = 0.0) -> dict[str, Any]:  # fmt: skip
    return {
        "policy": policy,
        "pareto": pareto,
        "forward_s": time_ms / 3e3,
        "backward_s": 2 * time_ms / 3e3,
        "reload_s": 0.0,
        "retained_bytes": None,  # as on CPU: the cost model's bytes are used
        "estimated_retained_bytes": int(retained_mib * MIB),
        "offloaded_bytes": int(offloaded_mib * MIB),
        "estimated_offloaded_bytes": int(offloaded_mib * MIB),
        "transient_bytes": None,
        "estimated_transient_bytes": 4 * MIB,
    }


def _report() -> dict[str, Any]:
    rows = [
        _row("F-r0", 30.0, 1.0, pareto=False),  # the default: kept though dominated here
        _row("F-r1", 30.0, 0.0),
        _row("SAC.mm-r0", 27.0, 100.0),
        _row("N-r0", 18.0, 300.0),
        _row("S1111111-r0", 29.0, 400.0, pareto=False),  # not Pareto: never a candidate
    ]
    return {"batch": BATCH, "seq_len": SEQ, "candidates": rows, "cached": None}


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Any, HFAdapter, Machine]:
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 16, min_len=SEQ, max_len=SEQ)
    path = write_config(tmp_path / "run.yaml", model, data, tmp_path / "out",
                        train={"max_steps": 2, "global_batch_size": BATCH, "max_grad_norm": 1.0},
                        output={"tensorboard": False})  # fmt: skip
    cfg = load_config(path, [])
    return path, cfg, HFAdapter.from_dir(model), Machine.probe(cfg, measure=False)


def _brute_force(program: Problem) -> float:
    """The best step of every count vector and resident count that fits (the program's
    accounting)."""
    problem = program.to_json()
    cands, best = problem["candidates"], float("inf")
    per_layer = problem["host"]["update_s_per_layer"]
    resident = problem.get("resident") or {"bytes_per_layer": 0.0, "max_layers": 0}
    w = resident["bytes_per_layer"]
    least_backward = min(max(c["time_s"] - c["forward_s"], 0.0) for c in cands)
    pinned = problem.get("host_budget_bytes")
    for counts in itertools.product(range(LAYERS + 1), repeat=len(cands)):
        if sum(counts) != LAYERS:
            continue
        offloaded = sum(c["offloaded_bytes"] * n for c, n in zip(cands, counts, strict=True))
        if pinned is not None and offloaded > pinned:
            continue
        used = [c for c, n in zip(cands, counts, strict=True) if n]
        mem = sum(c["retained_bytes"] * n for c, n in zip(cands, counts, strict=True))
        mem += max(2 * c["offloaded_bytes"] for c in used) + max(c["transient_bytes"] for c in used)
        parked = max(c["transient_bytes"] for c in used) + problem["parked_bytes"]
        for r in range(resident["max_layers"] + 1):
            if mem + r * w <= problem["budget_bytes"] and parked + r * w <= problem["budget_bytes"]:
                compute = sum(c["time_s"] * n for c, n in zip(cands, counts, strict=True))
                compute += problem.get("fixed_s", 0.0)
                device = resident.get("update_s_per_layer", 0.0) * r  # the resident update
                forward = sum(c["forward_s"] * n for c, n in zip(cands, counts, strict=True))
                host, tail = per_layer * (LAYERS - r), problem["host"]["tail_s"]
                if problem["host"]["serial"]:  # clipping: both updates follow the backward
                    best = min(best, compute + max(host + tail, device))
                else:  # it overlaps the backward, never the forward, and paces it: the
                    # resident layers' backward (at least the least of any) follows it; the
                    # embedding's update is last
                    paced = forward + host + least_backward * r
                    best = min(best, max(compute + device, paced) + tail)
    return best


@pytest.mark.parametrize("clipping", [1.0, 0.0])
@pytest.mark.parametrize("extra_mib", [5, 250, 650, 2000])
def test_the_choice_is_the_brute_force_optimum_within_the_budget(
    run: tuple[Path, Any, HFAdapter, Machine], extra_mib: int, clipping: float
) -> None:
    _, cfg, adapter, machine = run
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_grad_norm=clipping))
    # a GPU as large as what no layout changes plus `extra_mib` for activations
    base = 10 * GIB
    free = activation_budget(cfg, adapter, machine, base).bytes
    total = int(base + (extra_mib * MIB - free) / 0.94)
    choice = select_layout(cfg, adapter, machine, _report(), total_bytes=total, update_gbps=10.0,
                           resident=False)  # fmt: skip
    names = [c.name for c in choice.problem.candidates]
    assert names == ["F-r0", "F-r1", "SAC.mm-r0", "N-r0"]
    assert choice.budget_bytes == pytest.approx(extra_mib * MIB, abs=MIB)
    assert choice.solution.step_s == pytest.approx(_brute_force(choice.problem), rel=1e-9)
    assert choice.solution.memory_bytes <= choice.budget_bytes
    layers = parse_layout(choice.layout, LAYERS, 0.0)
    assert len(layers) == LAYERS
    assert choice.default.step_s >= choice.solution.step_s
    host = (host_update_s_per_layer(adapter, 10.0) * LAYERS
            + host_tail_s(adapter, 10.0, torch.bfloat16))  # fmt: skip
    assert choice.solution.host_s == pytest.approx(host)
    if extra_mib >= 4 * 300 + 4:
        assert choice.layout == "4xN-r0"
    if extra_mib == 5:  # the transient and no more: offloaded F (retains nothing)
        assert choice.layout == "4xF-r1"


@pytest.mark.parametrize("clipping", [1.0, 0.0])
@pytest.mark.parametrize("resident_layers", [0, 1, 3, LAYERS])
def test_gpu_resident_layers_are_the_brute_force_optimum_within_the_budget(
    run: tuple[Path, Any, HFAdapter, Machine], resident_layers: int, clipping: float
) -> None:
    """A budget with room for the all-F transient and ``resident_layers`` resident layers (and
    a little more): the program keeps exactly that many resident (a slow host makes each worth
    more than any activation layout), and its step is the brute force's over counts and K
    (without clipping: the resident layers' backward after the host lane that paced the rest)."""
    _, cfg, adapter, machine = run
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_grad_norm=clipping))
    w = resident_bytes_per_layer(adapter, torch.bfloat16, clipping=clipping > 0)
    base = 10 * GIB
    free = activation_budget(cfg, adapter, machine, base).bytes
    # 5 MiB fit the all-F-r1 layout alone (above); room for K resident layers and a quarter
    extra = 5 * MIB + resident_layers * w + w // 4
    choice = select_layout(cfg, adapter, machine, _report(), update_gbps=0.01,
                           total_bytes=int(base + (extra - free) / 0.94))  # fmt: skip
    assert choice.problem.resident is not None
    assert choice.problem.resident.bytes_per_layer == w
    problem, sol = choice.problem, choice.solution
    # what is left beside the chosen activations, in both of the program's memory rows
    activations = sol.memory_bytes - sol.resident_layers * w
    transient = max(c.transient_bytes for c, n in zip(problem.candidates, sol.counts,
                                                          strict=True) if n)  # fmt: skip
    left = problem.budget_bytes - max(activations, transient + problem.parked_bytes)
    assert choice.resident_layers == min(LAYERS, int(left // w))
    assert choice.resident_layers >= min(LAYERS, resident_layers)  # the room was used
    assert sol.step_s == pytest.approx(_brute_force(problem), rel=1e-9)
    host = host_update_s_per_layer(adapter, 0.01) * (LAYERS - choice.resident_layers)
    tail = 0.0 if choice.resident_embeddings else host_tail_s(adapter, 0.01, torch.bfloat16)
    assert sol.host_s == pytest.approx(host + tail)


@pytest.mark.parametrize("room", [True, False])
def test_resident_embeddings_are_chosen_where_they_fit_and_shorten_the_step(
    run: tuple[Path, Any, HFAdapter, Machine], room: bool
) -> None:
    """Room for every layer resident and (``room``) the embeddings too: the program keeps the
    embedding and head on the GPU, which takes their bytes off the budget and their host update
    (the step's tail after the backward) off the host lane; its step is the faster of the two
    brute forces. Without the room the embeddings stay on the host, every layer resident."""
    _, cfg, adapter, machine = run
    w = resident_bytes_per_layer(adapter, torch.bfloat16, clipping=True)
    e = resident_embedding_bytes(adapter, torch.bfloat16, clipping=True)
    base = 10 * GIB
    budget = activation_budget(cfg, adapter, machine, base)
    free = budget.bytes
    # the clipped backward's peak (its 4 MiB transient beside the parked gradients) with every
    # layer resident, and a quarter of the embeddings' bytes to spare
    extra = 4 * MIB + budget.parked_bytes + LAYERS * w + (e if room else 0) + e // 4
    choice = select_layout(cfg, adapter, machine, _report(), update_gbps=0.01,
                           total_bytes=int(base + (extra - free) / 0.94))  # fmt: skip
    assert (choice.resident_layers, choice.resident_embeddings) == (LAYERS, room)
    assert choice.program_layout.endswith("4 GPU-resident" + (" + embeddings" if room else ""))
    assert choice.problem.host is not None
    assert choice.problem.resident is not None
    assert choice.problem.host.tail_s == (
        0.0 if room else host_tail_s(adapter, 0.01, torch.bfloat16)
    )
    # their update, and each resident layer's, is device time: 28 B/param at the H100's rate
    rate = RESIDENT_UPDATE_GBPS * 1e9 / RESIDENT_UPDATE_BYTES_PER_PARAM
    layer = sum(p.numel() for p in adapter.layer_module(0).parameters())
    assert choice.problem.resident.update_s_per_layer == pytest.approx(layer / rate)
    specs = adapter.group_specs()
    embeddings = specs[adapter.embed_group].numel + specs[adapter.head_group].numel
    assert choice.problem.fixed_s == pytest.approx(embeddings / rate if room else 0)
    assert choice.solution.compute_s == pytest.approx(
        choice.problem.fixed_s + LAYERS * layer / rate
        + sum(c.time_s * n for c, n in zip(choice.problem.candidates,
                                             choice.solution.counts, strict=True))
    )  # fmt: skip
    host = select_layout(cfg, adapter, machine, _report(), update_gbps=0.01, embeddings=False,
                         total_bytes=int(base + (extra - free) / 0.94)).problem  # fmt: skip
    on_gpu = select.with_resident_embeddings(host, e, resident_embedding_update_s(adapter))
    steps = [_brute_force(host), _brute_force(on_gpu)]
    assert choice.solution.step_s == pytest.approx(min(steps), rel=1e-9)
    assert (steps[1] < steps[0]) == room


@pytest.mark.parametrize("shares", [0.5, 2.5, None])
def test_the_offloaded_activations_leave_the_mirror_its_host_memory(
    run: tuple[Path, Any, HFAdapter, Machine], shares: float | None
) -> None:
    """On a GPU the offloaded activations (pinned in host memory from forward to backward) get
    only what MemAvailable leaves beside the all-F run with its BF16 mirror and the mirror's
    headroom: room for ``shares`` of an offloading layer's share. The program stays within it
    (the brute force counts the same row), and unbounded (``None``: RAM to spare) it offloads
    on every layer. Without the row the arena took the mirror's room on Qwen3-8B and every
    streamed layer was cast on the host (BENCHMARKS.md, issue #16)."""
    from slidedp.estimate_report import estimate_run
    from slidedp.plan.resolve import MIRROR_HEADROOM_BYTES

    _, cfg, adapter, machine = run
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_grad_norm=0.0))
    share = 300 * MIB
    report = _report()  # N-r1: faster than N-r0 here, nothing retained, all in host memory
    report["candidates"].append(_row("N-r1", 17.0, 0.0, offloaded_mib=share / MIB))
    gpu = dataclasses.replace(machine, device="cuda", dtype="bfloat16",
                              mem_available_bytes=10**15)  # fmt: skip
    default = estimate_run(dataclasses.replace(cfg, runtime=select.all_f(cfg.runtime)), adapter,
                           gpu, step_model=False)  # fmt: skip
    assert default.mirror_bytes > 0
    if shares is not None:
        gpu = dataclasses.replace(gpu, mem_available_bytes=int(
            default.ram_bytes + MIRROR_HEADROOM_BYTES + select.HOST_SLACK_BYTES + shares * share
        ))  # fmt: skip
    total = 10 * GIB  # room for N-r1's pool, not for N-r0's retained activations
    free = activation_budget(cfg, adapter, gpu, total).bytes
    total = int(total + (2 * share + 8 * MIB - free) / 0.94)
    choice = select_layout(cfg, adapter, gpu, report, total_bytes=total, update_gbps=1e3,
                           resident=False)  # fmt: skip
    budget = choice.problem.host_budget_bytes
    offloading = choice.solution.counts[-1]
    assert choice.solution.offloaded_bytes == offloading * share
    assert choice.solution.step_s == pytest.approx(_brute_force(choice.problem), rel=1e-9)
    if shares is None:
        assert offloading == LAYERS
    else:
        assert budget == pytest.approx(shares * share, abs=1)
        assert offloading == int(shares)
        # a mirror the config asks for is not decided by what fits: no headroom kept for it
        given = dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(bf16_mirror=True))
        kept = select.offload_host_budget(given, adapter, gpu)
        assert kept is not None
        assert budget is not None
        headroom = kept - budget
        assert headroom == pytest.approx(MIRROR_HEADROOM_BYTES, abs=1)
    cpu = select_layout(cfg, adapter, machine, report, total_bytes=total, update_gbps=1e3)
    assert cpu.problem.host_budget_bytes is None  # on CPU the activations are host memory


def test_where_only_offloading_fits_the_device_the_arena_takes_the_mirrors_room(
    run: tuple[Path, Any, HFAdapter, Machine],
) -> None:
    """A device budget that only offloaded layers fit, and host memory beside the mirror for
    half a share: no layout fits with the mirror's room kept, so the budget is the one without
    the mirror (the run then goes without it), and every layer offloads."""
    from slidedp.estimate_report import estimate_run
    from slidedp.plan.resolve import MIRROR_HEADROOM_BYTES

    _, cfg, adapter, machine = run
    share = 300 * MIB
    report = _report()
    report["candidates"] = [_row("F-r0", 30.0, 200.0), _row("N-r1", 17.0, 0.0, offloaded_mib=300)]
    gpu = dataclasses.replace(machine, device="cuda", dtype="bfloat16", mem_available_bytes=10**15)
    all_f = dataclasses.replace(cfg, runtime=select.all_f(cfg.runtime))
    ram = estimate_run(all_f, adapter, gpu, step_model=False).ram_bytes
    available = int(ram + MIRROR_HEADROOM_BYTES + select.HOST_SLACK_BYTES + share // 2)
    gpu = dataclasses.replace(gpu, mem_available_bytes=available)
    assert select.offload_host_budget(cfg, adapter, gpu) == pytest.approx(share / 2, abs=1)
    total = 10 * GIB  # room for N-r1's pool and transient, not for one F-r0 layer beside it
    free = activation_budget(cfg, adapter, gpu, total).bytes
    total = int(total + (2 * share + 8 * MIB - free) / 0.94)
    choice = select_layout(cfg, adapter, gpu, report, total_bytes=total, update_gbps=1e3,
                           resident=False)  # fmt: skip
    assert choice.layout == "4xN-r1"
    without = select.offload_host_budget(cfg, adapter, gpu, mirror=False)
    assert choice.problem.host_budget_bytes == without
    assert without is not None
    assert without > 4 * share  # the mirror's headroom and its own bytes


def test_the_host_tail_is_the_embeddings_update_and_their_copies(
    run: tuple[Path, Any, HFAdapter, Machine],
) -> None:
    """What ends a step with streamed embeddings: the embedding's gradient out (D2H), both
    groups' AdamW, the embedding's weights in (H2D), in the compute dtype's bytes."""
    from slidedp.plan.timing import ADAMW_BYTES_PER_PARAM, D2H_GBPS, H2D_GBPS

    _, _, adapter, _ = run
    specs = adapter.group_specs()
    embed = specs[adapter.embed_group].numel
    update = ADAMW_BYTES_PER_PARAM * (embed + specs[adapter.head_group].numel) / 10e9
    for dtype in (torch.bfloat16, torch.float32):
        copies = dtype.itemsize * embed * (1 / (D2H_GBPS * 1e9) + 1 / (H2D_GBPS * 1e9))
        assert host_tail_s(adapter, 10.0, dtype) == pytest.approx(update + copies, rel=1e-12)


def test_embeddings_that_leave_no_layout_room_stay_on_the_host(
    run: tuple[Path, Any, HFAdapter, Machine],
) -> None:
    """Resident embeddings as large as the whole budget: no layout fits beside them, so the
    program's own solution stands (the alternative's infeasibility is not an error)."""
    _, cfg, adapter, machine = run
    choice = select_layout(cfg, adapter, machine, _report(), update_gbps=0.01,
                           total_bytes=10 * GIB)  # fmt: skip
    problem = choice.problem
    solved, solution, embeddings = select.solve_residency(problem, int(problem.budget_bytes),
                                                          0.0)  # fmt: skip
    assert (solved, embeddings) == (problem, False)
    assert solution == solve(problem)


def test_a_layout_predicted_less_than_min_gain_faster_keeps_the_default(
    run: tuple[Path, Any, HFAdapter, Machine],
) -> None:
    """A clipped step bound by a slow host update: the program still finds its least-compute
    layout (all N), but predicted under MIN_GAIN faster, so the default is kept (on the H100 such
    predictions measured slower than the default, BENCHMARKS.md issue #16)."""
    _, cfg, adapter, machine = run
    fast = select_layout(cfg, adapter, machine, _report(), total_bytes=80 * GIB, update_gbps=10.0,
                         resident=False)  # fmt: skip
    assert (fast.layout, fast.kept_default) == ("4xN-r0", False)
    assert fast.gain >= 1 + MIN_GAIN
    slow = select_layout(cfg, adapter, machine, _report(), total_bytes=80 * GIB, update_gbps=1e-3,
                         resident=False)  # fmt: skip
    assert slow.program_layout == "4xN-r0, 0 GPU-resident"  # the least compute among equal steps
    assert 1 < slow.gain < 1 + MIN_GAIN
    assert (slow.layout, slow.kept_default) == ("4xF-r0", True)
    assert [str(p) for p in slow.layers] == ["F-r0"] * LAYERS


@pytest.mark.e2e
def test_plan_writes_a_plan_whose_policy_trains(
    run: tuple[Path, Any, HFAdapter, Machine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, _, _ = run
    report = tmp_path / "profile.json"
    report.write_text(json.dumps(_report()))
    policy = tmp_path / "plans" / "plan.json"
    argv = ["plan", str(path), "--profile", str(report), "--gpu-memory", "80", "--out", str(policy)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "chosen:  4xN-r0, 4 GPU-resident + embeddings" in out  # 80 GB: room for all
    assert "default: 4xF-r0" in out
    assert "0.00 GiB offloaded to host memory" in out  # planned on CPU: no host budget
    assert written_policy(policy) == {"layers": "4xN-r0", "resident_layers": 4,
                                                  "resident_embeddings": True}  # fmt: skip
    summary = json.loads(report_path(policy).read_text())
    assert set(summary["timing_s"]) == {"setup_s", "profile_s", "host_s", "solve_s", "check_s"}
    assert summary["host_adamw"]["source"].startswith("measured")  # probed here when missing
    assert main(["train", str(path), f"runtime.policy={policy}"]) == 0
    banner = capsys.readouterr().out
    assert f"layers 4xN-r0, 4 GPU-resident + embeddings (from the policy file {policy})" in banner
    assert len(read_metrics(tmp_path / "out")) == 2


def test_plan_refuses_a_profile_of_another_shape_and_a_machine_without_a_gpu(
    run: tuple[Path, Any, HFAdapter, Machine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, _, _ = run
    report = tmp_path / "profile.json"
    report.write_text(json.dumps(_report() | {"batch": 16}))
    policy = tmp_path / "plan.json"
    assert main(["plan", str(path), "--profile", str(report), "--gpu-memory", "80",
                 "--out", str(policy)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "is of B=16 S=32, the run is B=4 S=32" in err
    assert len(err.splitlines()) == 1
    assert main(["plan", str(path), "--profile", str(report), "--out", str(policy)]) == 2
    assert "no GPU here to plan for: pass --gpu-memory" in capsys.readouterr().err
    assert not policy.exists()


def test_plan_refuses_before_measuring_an_out_that_is_not_a_plans_name(
    run: tuple[Path, Any, HFAdapter, Machine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, _, _ = run
    for out in (tmp_path / "policy.yaml", tmp_path / "plan.report.json"):
        assert main(["plan", str(path), "--gpu-memory", "80", "--out", str(out)]) == 2
        assert "name it PLAN.json" in capsys.readouterr().err
        assert not out.exists()
    with pytest.raises(SystemExit):
        main(["plan", str(path), "--gpu-memory", "-1"])
    assert "must be a positive size in GiB" in capsys.readouterr().err
    assert not out.exists()


def test_plan_and_auto_take_the_host_lane_from_the_cached_probe(
    run: tuple[Path, Any, HFAdapter, Machine],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, cfg, adapter, machine = run
    cache_rate(update_threads(cfg, machine), None, 3.0)  # this CPU, far slower than the table
    report = tmp_path / "profile.json"
    report.write_text(json.dumps(_report()))
    policy = tmp_path / "plan.json"
    argv = ["plan", str(path), "--profile", str(report), "--gpu-memory", "80", "--out", str(policy)]
    assert main(argv) == 0
    assert "at 3 GB/s AdamW, measured (cached)" in capsys.readouterr().out
    summary = json.loads(report_path(policy).read_text())
    # no rate alone on CPU: the program prices the update at the one rate
    assert summary["host_adamw"] == {"gbps": 3.0, "alone_gbps": None, "program_gbps": 3.0,
                                     "source": "measured (cached)"}  # fmt: skip
    per_layer = host_update_s_per_layer(adapter, 3.0)
    assert summary["problem"]["host"]["update_s_per_layer"] == pytest.approx(per_layer)

    # runtime.policy: auto, from a cached layer profile: the same rate reaches the selector
    seen: list[float] = []

    def spy(*args: Any, update_gbps: float, **kwargs: Any) -> select.Choice:
        seen.append(update_gbps)
        return select_layout(*args, update_gbps=update_gbps, **kwargs)

    monkeypatch.setattr(choose, "cached_profile", lambda args: _report())
    monkeypatch.setattr(select, "select_layout", spy)
    chosen = dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(policy="auto"))
    _, line = auto.resolve_auto(chosen, adapter, machine, measure=False)
    assert seen == [3.0]
    assert line is not None
    assert "host AdamW 3 GB/s measured (cached)" in line
