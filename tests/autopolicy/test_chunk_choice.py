"""AutoPolicy's chunk stage (``chunk_choice``): the whole layer unless the probe measured a
chunk ``MIN_GAIN`` faster, the ring kept at its bytes; in ``runtime.policy: auto`` the chunk runs
with the layout, is validated against the default's whole layers, is kept in the selection cache
and by a resumed run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from autopolicy.runs import run_config, written_policy
from autopolicy.test_validate import ALL_F, CHOICE, FakeTrials, _resolve, start_auto
from slidedp.autopolicy import choose, selection_cache, validate
from slidedp.autopolicy.chunk_choice import MIN_GAIN, ChunkChoice, choose_chunk, with_chunk
from slidedp.autopolicy.command import report_path
from slidedp.autopolicy.kept import kept_line, kept_policy
from slidedp.autopolicy.selection_cache import Selection, read_selection, write_selection
from slidedp.config import TrainConfig, load_config
from slidedp.io.checkpoint import STATE_FILE
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine
from slidedp.plan.policy import layer_chunk_elems, read_plan
from slidedp.plan.resolve import resolve_plan

NUMEL = 3 << 20
MIB_1 = 1 << 19  # elements of 1 MiB of BF16


def _report(step_s: list[float]) -> dict[str, Any]:
    sizes = [0, MIB_1, 2 * MIB_1][: len(step_s)]
    rows = [{"chunk_elems": c, "step_s": t} for c, t in zip(sizes, step_s, strict=True)]
    return {"layer_numel": NUMEL, "mirror": True, "candidates": rows, "cached": None}


def test_the_whole_layer_stays_unless_a_chunk_is_measurably_faster() -> None:
    near = 1.0 * (1 - MIN_GAIN) + 1e-6
    kept = choose_chunk(_report([1.0, near, 1.2]), grad_slots=4)
    assert (kept.chunk_elems, kept.grad_slots, kept.is_default) == (0, 4, True)
    assert "the whole layer" in kept.describe()
    chosen = choose_chunk(_report([1.0, 0.9, 0.8]), grad_slots=4)
    assert (chosen.chunk_elems, chosen.cost_s, chosen.default_s) == (2 * MIB_1, 0.8, 1.0)
    assert chosen.grad_slots == 4 * 3  # four layers of three 2-MiB chunks
    assert chosen.describe().startswith("2 MiB, 12 gradient slots (host side 800.0 vs 1000.0 ms")
    two = choose_chunk(_report([1.0, 0.5]), grad_slots=2)
    assert (two.chunk_elems, two.grad_slots) == (MIB_1, 12)  # two layers of six 1-MiB chunks


def _chunk(monkeypatch: pytest.MonkeyPatch, mirror: bool = False) -> ChunkChoice:
    """The chunk stage answers a 1 MiB chunk, as a probe on a GPU would, with loads from the
    mirror or not (a CPU run has none: f32)."""
    chunk = ChunkChoice(MIB_1, 24, 0.5, 1.0, mirror=mirror, source="measured now")

    def stage(cfg: TrainConfig, *args: Any, **kwargs: Any) -> tuple[ChunkChoice, str]:
        assert cfg.runtime.layout.chunk_elems == 0  # the default's config: the chunk left to auto
        return chunk, chunk.describe()

    monkeypatch.setattr(choose, "probe_chunk", stage)
    return chunk


@pytest.mark.parametrize(("choice_s", "wins"), [(0.5, True), (1.5, False)])
def test_auto_validates_the_chunk_with_the_layout_against_whole_layers(
    auto_run: tuple[Path, TrainConfig],
    monkeypatch: pytest.MonkeyPatch,
    choice_s: float,
    wins: bool,
) -> None:
    chunk = _chunk(monkeypatch)
    trials = FakeTrials({ALL_F: 1.0, "F": 1.0, "*": choice_s})
    monkeypatch.setattr(validate, "run_trial", trials)
    chosen, line = _resolve(auto_run[1])
    ran = [
        (c.runtime.layout.layers, c.runtime.layout.chunk_elems, c.runtime.layout.grad_slots)
        for c in trials.ran
    ]
    assert ran == [(CHOICE, MIB_1, 24), ("F", 0, 4)]  # the default: whole layers
    rt = chosen.runtime
    if wins:
        assert (rt.layout.layers, rt.layout.chunk_elems, rt.layout.grad_slots) == (
            CHOICE,
            MIB_1,
            24,
        )
        assert f"; chunk {chunk.describe()};" in line
    else:
        assert (rt.layout.layers, rt.layout.chunk_elems, rt.layout.grad_slots) == (ALL_F, 0, 4)
        assert "not run: the default won validation;" in line


def test_an_unvalidated_chunk_is_not_applied(
    auto_run: tuple[Path, TrainConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeated probes differ by up to ~10%: without validation the whole layer runs."""
    _chunk(monkeypatch)
    cfg = auto_run[1]
    runtime = cfg.runtime.with_keys(policy_validate_steps=0)
    cfg = dataclasses.replace(cfg, runtime=runtime)
    chosen, line = _resolve(cfg)
    assert (chosen.runtime.layout.chunk_elems, chosen.runtime.layout.grad_slots) == (0, 4)
    assert "; chunk the whole layer (1 MiB, 24 gradient slots" in line
    assert "not applied unvalidated: runtime.policy_validate_steps=0);" in line


def test_a_chunk_probed_with_other_loads_is_not_applied(
    auto_run: tuple[Path, TrainConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk probed with the mirror's loads, for a run that casts (here: f32 on CPU, no
    mirror), is not the run's measurement: the whole layer runs, in validation too."""
    _chunk(monkeypatch, mirror=True)
    trials = FakeTrials({ALL_F: 1.0, "F": 1.0, "*": 0.5})
    monkeypatch.setattr(validate, "run_trial", trials)
    chosen, line = _resolve(auto_run[1])
    assert [c.runtime.layout.chunk_elems for c in trials.ran] == [0, 0]
    assert (chosen.runtime.layout.layers, chosen.runtime.layout.chunk_elems) == (CHOICE, 0)
    assert "not run: the chosen layout loads without the mirror probed;" in line


def test_a_cached_selection_brings_its_chunk(auto_run: tuple[Path, TrainConfig]) -> None:
    cfg = auto_run[1]
    adapter, machine = HFAdapter.from_dir(cfg.model.path), Machine.probe(cfg, measure=False)
    whole_layer = layer_chunk_elems(adapter)
    facts = {"any": "key"}
    line = "policy   auto: 4xN-r0, 0 GPU-resident; chunk 1 MiB"
    for chunk, slots, kept in ((MIB_1, 24, (MIB_1, 24)), (0, 4, (0, 4))):
        keys = {"layers": CHOICE, "chunk_elems": chunk, "grad_slots": slots, "policy": ""}
        run = load_config(auto_run[0], [f"runtime.{k}={v}" for k, v in keys.items()])
        plan = resolve_plan(run, adapter, machine)
        write_selection(facts, Selection(plan.to_json(), line, 1.0))
        hit = read_selection(facts, layers=4, routes=[], say=print)
        assert hit is not None
        chosen, said = selection_cache.from_cache(cfg, *hit, whole_layer)
        assert (chosen.runtime.layout.chunk_elems, chosen.runtime.layout.grad_slots) == kept
        assert chosen.runtime.layout.layers == CHOICE
        assert said.startswith(line)


def test_a_layout_kept_as_the_default_is_still_validated_for_its_chunk(
    auto_run: tuple[Path, TrainConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the program keeps the all-F layout, the chunk alone still differs from the
    default: it runs only after a faster validation."""
    _chunk(monkeypatch)
    monkeypatch.setattr(choose, "profile_layer", lambda args: _all_f_report())
    trials = FakeTrials({"*": 0.9, "F": 1.0})
    monkeypatch.setattr(validate, "run_trial", trials)
    chosen, _ = _resolve(auto_run[1])
    assert [(c.runtime.layout.layers, c.runtime.layout.chunk_elems) for c in trials.ran] == [
        (ALL_F, MIB_1), ("F", 0)]  # fmt: skip
    assert chosen.runtime.layout.chunk_elems == MIB_1


def _all_f_report() -> dict[str, Any]:
    from autopolicy.runs import BATCH, SEQ, profile_row

    return {"batch": BATCH, "seq_len": SEQ, "candidates": [profile_row("F-r0", 30.0, 1.0)],
            "cached": None}  # fmt: skip


def test_with_chunk_leaves_whole_layers_alone(auto_run: tuple[Path, TrainConfig]) -> None:
    cfg = auto_run[1]
    adapter, machine = HFAdapter.from_dir(cfg.model.path), Machine.probe(cfg, measure=False)
    assert with_chunk(cfg, None, adapter, machine) is cfg
    assert with_chunk(cfg, ChunkChoice(0, 4, 1.0, 1.0, False, "cached"), adapter, machine) is cfg
    chunk = ChunkChoice(MIB_1, 24, 0.5, 1.0, False, "cached")
    chunked = with_chunk(cfg, chunk, adapter, machine).runtime
    assert (chunked.layout.chunk_elems, chunked.layout.grad_slots) == (MIB_1, 24)
    other_loads = dataclasses.replace(chunk, mirror=True)  # this CPU run has no mirror
    assert with_chunk(cfg, other_loads, adapter, machine) is cfg


@pytest.mark.parametrize(("recorded", "kept"), [(MIB_1, MIB_1), (777, 0), (0, 0)])
def test_a_resumed_run_keeps_the_chunk_its_checkpoint_ran_with(
    tmp_path: Path, recorded: int, kept: int
) -> None:
    """The checkpoint records the resolved chunk: one layer's (777 here) for a config's 0, so
    that one is the whole layer again."""
    policy = {"layers": "4xF-r0", "resident_layers": 0, "param_route": "replicated",
              "grad_route": "gpu", "chunk_elems": recorded, "grad_slots": 24}  # fmt: skip
    (tmp_path / STATE_FILE).write_text(json.dumps({"policy": policy}))
    found = kept_policy(tmp_path, 4, 777)
    assert found is not None
    assert found.chunk_elems == kept
    cfg = load_config(run_config(tmp_path, 4, {"policy": "auto"}), [])
    resumed, line = kept_line(cfg, found, [], tmp_path)
    assert (resumed.runtime.layout.chunk_elems, resumed.runtime.layout.grad_slots) == (
        kept,
        24 if kept else 4,
    )
    assert (f", chunk {kept:,} elements (kept from" in line) == bool(kept)


@pytest.fixture
def auto_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, TrainConfig]:
    return start_auto(tmp_path, monkeypatch)


def test_plan_writes_a_chunk_only_where_validation_ran_it_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``slidedp plan`` on this machine's GPU (faked): a chunk-only choice (the program keeps
    all F) is validated, and its policy file carries the chunk and its ring only when it ran
    faster; for another GPU (--gpu-memory) the chunk stage does not run."""
    from autopolicy.runs import on_a_gpu
    from slidedp.cli import main

    path = run_config(tmp_path, 4, {"policy_calibrate_steps": 0})
    on_a_gpu(path, monkeypatch, tmp_path / "cache")
    chunk = ChunkChoice(MIB_1, 24, 0.5, 1.0, mirror=True, source="measured now")
    monkeypatch.setattr(choose, "probe_chunk", lambda *a, **k: (chunk, chunk.describe()))
    monkeypatch.setattr(
        choose,
        "with_chunk",
        lambda cfg, c, *a: with_chunk(cfg, c and dataclasses.replace(c, mirror=False), *a),
    )  # the faked GPU: f32, no mirror
    report = tmp_path / "profile.json"
    report.write_text(json.dumps(_all_f_report()))
    policy = tmp_path / "plan.json"
    argv = ["plan", str(path), "--profile", str(report), "--out", str(policy)]
    whole = layer_chunk_elems(HFAdapter.from_dir(load_config(path, []).model.path))
    for step_s, written in ((0.5, (MIB_1, 24)), (1.5, (whole, 4))):
        trials = FakeTrials({"F": 1.0, "*": step_s})
        monkeypatch.setattr(validate, "run_trial", trials)
        assert main(argv) == 0
        assert [c.runtime.layout.chunk_elems for c in trials.ran] == [MIB_1, 0]
        assert written_policy(policy) == {"layers": ALL_F, "resident_layers": 0,
                                          "resident_embeddings": False}  # fmt: skip
        ran = read_plan(policy).policy
        assert (ran.chunk_elems, ran.grad_slots) == written
        said = json.loads(report_path(policy).read_text())["chunk"]["said"]
        assert said.startswith("1 MiB")
        won = written[0] == MIB_1
        assert said.endswith("" if won else ", not run: the default won validation")
    capsys.readouterr()
    assert main([*argv, "--gpu-memory", "40"]) == 0
    summary = json.loads(report_path(policy).read_text())
    assert summary["chunk"]["said"] == "the config's (planned for another GPU: --gpu-memory)"
