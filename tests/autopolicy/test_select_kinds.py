"""AutoPolicy for models whose decoder layers are of several kinds (Gemma 4's sliding and full
attention, Qwen3.5's linear and full attention): the layer profile measures each kind's first
layer once and caches it apart, the program gives each kind its own candidates (its choice
equals a brute-force search over every count vector of every kind), the placed layout puts
each kind's candidates on that kind's layers, and ``train`` with ``runtime.policy: auto``
trains such a model."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from autopolicy.test_select import _row
from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.autopolicy.program import Problem
from slidedp.autopolicy.select import activation_budget, select_layout
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.layout import parse_entry, parse_layout
from slidedp.plan.machine import Machine
from slidedp.profile import layer as layer_profile

MIB = 2**20
GIB = 2**30
BATCH, SEQ = 4, 32
LAYERS = 4  # gemma4_text: sliding, sliding, full, full (its last layer is full)


# each kind its own candidates: SAC.mm only on the sliding layers, SAC.attn only on the full one
SLIDING = [_row("F-r0", 30.0, 1.0, pareto=False), _row("F-r1", 30.0, 0.0),
           _row("SAC.mm-r0", 27.0, 100.0), _row("N-r0", 18.0, 300.0)]  # fmt: skip
FULL = [_row("F-r0", 50.0, 2.0), _row("SAC.attn-r0", 40.0, 50.0), _row("N-r0", 20.0, 600.0),
        _row("N-r1", 60.0, 0.0, pareto=False)]  # fmt: skip


def _report() -> dict[str, Any]:
    rows = [r | {"kind": 0} for r in SLIDING] + [r | {"kind": 2} for r in FULL]
    return {"batch": BATCH, "seq_len": SEQ, "kinds": {"0": 2, "2": 2}, "candidates": rows,
            "cached": None}  # fmt: skip


def _allowed(kind: int) -> set[str]:
    rows = SLIDING if kind == 0 else FULL
    return {r["policy"] for r in rows if r["pareto"] or r["policy"] == "F-r0"}


@pytest.fixture
def run(tmp_path: Path) -> tuple[Any, HFAdapter, Machine]:
    model = make_model(tmp_path, "gemma4_text", tied=False, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 16, min_len=SEQ, max_len=SEQ)
    path = write_config(tmp_path / "run.yaml", model, data, tmp_path / "out",
                        train={"max_steps": 2, "global_batch_size": BATCH, "max_grad_norm": 1.0},
                        output={"tensorboard": False})  # fmt: skip
    cfg = load_config(path, [])
    return cfg, HFAdapter.from_dir(model), Machine.probe(cfg, measure=False)


def _compositions(cands: list[int], layers: int) -> list[dict[int, int]]:
    return [dict(zip(cands, n, strict=True))
            for n in itertools.product(range(layers + 1), repeat=len(cands))
            if sum(n) == layers]  # fmt: skip


def _brute_force(program: Problem) -> float:
    """The best step of every count vector of every kind and every resident count that fits
    (the program's accounting: a resident layer saves the cheapest kind's update)."""
    problem = program.to_json()
    cands, kinds, host = problem["candidates"], problem["kinds"], problem["host"]
    resident = problem.get("resident") or {"bytes_per_layer": 0.0, "max_layers": 0}
    w, budget = resident["bytes_per_layer"], problem["budget_bytes"]
    updates = [k["update_s_per_layer"] for k in kinds]
    streamed = sum(u * k["layers"] for u, k in zip(updates, kinds, strict=True))
    per_kind = [_compositions([j for j, c in enumerate(cands) if c["kind"] == i], k["layers"])
                for i, k in enumerate(kinds)]  # fmt: skip
    best = float("inf")
    for parts in itertools.product(*per_kind):
        counts = {j: n for part in parts for j, n in part.items()}
        used = [cands[j] for j, n in counts.items() if n]
        mem = sum(cands[j]["retained_bytes"] * n for j, n in counts.items())
        mem += max(2 * c["offloaded_bytes"] for c in used) + max(c["transient_bytes"] for c in used)
        parked = max(c["transient_bytes"] for c in used) + problem["parked_bytes"]
        compute = sum(cands[j]["time_s"] * n for j, n in counts.items())
        compute += problem.get("fixed_s", 0.0)
        forward = sum(cands[j]["forward_s"] * n for j, n in counts.items())
        least_backward = min(max(c["time_s"] - c["forward_s"], 0.0) for c in cands)
        for r in range(resident["max_layers"] + 1):
            if mem + r * w > budget or parked + r * w > budget:
                continue
            lane = streamed - min(updates) * r
            device = resident.get("update_s_per_layer", 0.0) * r  # the resident update
            if host["serial"]:  # both updates after the backward, side by side
                best = min(best, compute + max(lane + host["tail_s"], device))
            else:  # the resident layers' backward after the lane that paced the rest
                paced = forward + lane + least_backward * r
                best = min(best, max(compute + device, paced) + host["tail_s"])
    return best


@pytest.mark.parametrize(("clipping", "resident"), [(1.0, False), (0.0, False), (1.0, True)])
@pytest.mark.parametrize("extra_mib", [9.0, 60, 130, 700, 3000])
def test_each_kind_takes_its_own_candidates_at_the_brute_force_optimum(
    run: tuple[Any, HFAdapter, Machine], extra_mib: float, clipping: float, resident: bool
) -> None:
    cfg, adapter, machine = run
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_grad_norm=clipping))
    assert adapter.layer_kinds == [0, 0, 2, 2]
    base = 10 * GIB
    free = activation_budget(cfg, adapter, machine, base).bytes
    total = int(base + (extra_mib * MIB - free) / 0.94)
    # a slow host where layers may be resident: their saved update is worth their bytes
    choice = select_layout(cfg, adapter, machine, _report(), total_bytes=total,
                           update_gbps=0.05 if resident else 10.0, resident=resident)  # fmt: skip
    problem, sol = choice.problem, choice.solution
    assert [(k.name, k.layers) for k in problem.kinds] == [("layer 0", 2), ("layer 2", 2)]
    updates = [k.update_s_per_layer for k in problem.kinds]
    assert updates[0] is not None
    assert updates[1] is not None
    assert updates[0] < updates[1]
    assert sol.step_s == pytest.approx(_brute_force(problem), rel=1e-9)
    assert sol.memory_bytes <= choice.budget_bytes
    # the layout's text parses back to the placed per-layer policies, each of its kind's
    layers = parse_layout(choice.layout, LAYERS, 0.0)
    assert layers == choice.layers
    for policy, kind in zip(layers, adapter.layer_kinds, strict=True):
        assert str(policy) in _allowed(kind)
    if not choice.kept_default:  # the placed layout is the program's counts, kind by kind
        placed = collections.Counter(
            (k, str(p)) for k, p in zip(adapter.layer_kinds, layers, strict=True)
        )
        index = {0: 0, 1: 2}
        cands = zip(problem.candidates, sol.counts, strict=True)
        counted = {(index[c.kind], c.name.split(": ")[1]): n for c, n in cands if n}
        assert placed == counted
    if extra_mib == 9.0:  # the transient, the full layers' F and no more: sliding ones offload
        assert [str(p) for p in layers] == ["F-r1", "F-r1", "F-r0", "F-r0"]
    if extra_mib == 3000 and not resident:  # room for every layer's fastest
        assert [str(p) for p in layers] == ["N-r0"] * LAYERS
    default = {"layer 0: F-r0": 2, "layer 2: F-r0": 2}
    assert choice.default.counts == tuple(default.get(c.name, 0) for c in problem.candidates)
    assert choice.default.step_s >= sol.step_s


def test_a_profile_of_another_models_kinds_is_refused(run: tuple[Any, HFAdapter, Machine]) -> None:
    cfg, adapter, machine = run
    one_kind = _report() | {"kinds": {"0": LAYERS}}
    with pytest.raises(ConfigError, match=r"kinds of layers \[0\], the model's are of layers"):
        select_layout(cfg, adapter, machine, one_kind, total_bytes=10 * GIB, update_gbps=10.0)


def test_each_kind_is_profiled_once_and_cached_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path, "qwen3_5_moe_text", tied=False, layers=3)  # linear, full, linear
    measured: list[tuple[int, str]] = []
    real = layer_profile.measure

    def counted(*args: Any) -> layer_profile.Candidate:
        measured.append((args[-1], str(args[1])))
        return real(*args)

    monkeypatch.setattr(layer_profile, "measure", counted)
    argv = ["profile", "layer", "--shape", str(model / "config.json"), "--device", "cpu",
            "--batch", "1", "--seq-len", "8", "--families", "F,N", "--ratios", "0",
            "--warmup", "0", "--steps", "1", "--cache-dir", str(tmp_path / "cache"),
            "--json", str(tmp_path / "p.json")]  # fmt: skip
    assert main(argv) == 0
    assert sorted(measured) == [(0, "F-r0"), (0, "N-r0"), (1, "F-r0"), (1, "N-r0")]
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["kinds"] == {"0": 2, "1": 1}
    assert sorted((c["kind"], c["policy"]) for c in report["candidates"]) == sorted(measured)
    # the full-attention layer saves other tensors than the linear-attention one
    n = {c["kind"]: c["estimated_retained_bytes"] for c in report["candidates"]
         if c["policy"] == "N-r0"}  # fmt: skip
    assert n[0] != n[1]
    assert len(list((tmp_path / "cache").glob("layer-*.json"))) == 2
    assert main(argv) == 0  # both kinds cached: nothing measured again
    assert len(measured) == 4
    assert json.loads((tmp_path / "p.json").read_text())["cached"].count("layer-") == 2


@pytest.mark.e2e
def test_train_with_policy_auto_on_layers_of_two_kinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = make_model(tmp_path, "gemma4_text", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 16, min_len=16, max_len=16)
    path = write_config(tmp_path / "auto.yaml", model, data, tmp_path / "auto",
                        train={"max_steps": 2, "global_batch_size": 2, "max_grad_norm": 1.0},
                        data={"path": str(data), "seq_len": 16, "pad_id": 0},
                        runtime={"policy": "auto"}, output={"tensorboard": False})  # fmt: skip
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("policy   auto: "))
    assert "profiled in" in line
    resolved = yaml.safe_load((tmp_path / "auto" / "resolved_config.yaml").read_text())
    layers = parse_layout(resolved["runtime"]["layers"], 3, 0.0)
    assert line.startswith(f"policy   auto: {resolved['runtime']['layers']}, 0 GPU-resident")
    # every layer's policy was a candidate of its own kind's profile
    (cached,) = {c for c in (tmp_path / "slidedp" / "profile").glob("layer-*.json")
                 if json.loads(c.read_text())["layer"] == 2}  # fmt: skip
    full = {c["policy"] for c in json.loads(cached.read_text())["candidates"]}
    assert str(layers[2]) in full
    assert parse_entry(str(layers[2]), 0.0)[1] == layers[2]
    assert len(list((tmp_path / "slidedp" / "profile").glob("layer-*.json"))) == 2
    assert [m["step"] for m in read_metrics(tmp_path / "auto")] == [1, 2]


def test_the_step_models_layer_times_weigh_each_kind_by_its_layers() -> None:
    from slidedp.plan.timing import layer_times

    rows = [{"policy": "F-r0", "kind": 0, "forward_s": 1.0, "backward_s": 2.0},
            {"policy": "F-r0", "kind": 2, "forward_s": 5.0, "backward_s": 6.0},
            {"policy": "N-r1", "kind": 2, "forward_s": 7.0, "backward_s": 8.0}]  # fmt: skip
    times = layer_times({"kinds": {"0": 3, "2": 1}, "candidates": rows})
    assert times == {"F-r0": (2.0, 3.0), "N-r1": (7.0, 8.0)}


def test_the_frontier_of_each_kind_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from slidedp.profile.pareto import plot_pareto

    report = _report() | {"shape": "gemma4", "gpu": "cpu"}
    plot_pareto(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
