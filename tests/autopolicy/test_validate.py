"""AutoPolicy's validation stage (``autopolicy.validate``): the solver's choice trains only when it
ran faster than the fixed default; a choice that runs out of memory is solved again with a
smaller budget, at most ``RESOLVES`` times; a trial is the engine itself and writes nothing
into the run's output directory; ``slidedp plan`` and ``train`` report the selection time and
the break-even steps."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from autopolicy.runs import (
    BATCH,
    SEQ,
    on_a_gpu,
    profile_row,
    run_config,
    selection_stages,
    written_policy,
)
from engine.tiny import read_metrics
from host_profile.fake import cache_rate
from slidedp.autopolicy import auto, choose, validate
from slidedp.autopolicy.command import report_path
from slidedp.autopolicy.select import Choice, select_layout
from slidedp.autopolicy.trial_child import TrialChild, runner_for
from slidedp.autopolicy.validate import RESOLVES, Trial, default_config, validate_choice
from slidedp.cli import main
from slidedp.config import TrainConfig, load_config
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine, update_threads

MIB, GIB = 2**20, 2**30
LAYERS = 4
CHOICE = f"{LAYERS}xN-r0"  # what the program picks from the report below at a fast host
ALL_F = f"{LAYERS}xF-r0"


def _report() -> dict[str, Any]:
    rows = [
        profile_row("F-r0", 30.0, 1.0),
        profile_row("SAC.mm-r0", 27.0, 100.0),
        profile_row("N-r0", 18.0, 300.0),
    ]
    return {"batch": BATCH, "seq_len": SEQ, "candidates": rows, "cached": None}


def _config(tmp_path: Path, **runtime: object) -> Path:
    """The run; the calibration stage off unless asked (test_calibrate has it): the solver's
    choice from the profile is the one validated."""
    runtime = {"policy_calibrate_steps": 0} | runtime
    return run_config(tmp_path, LAYERS, runtime)


class FakeTrials:
    """A runner whose step times and memory are given per layout: ``None`` runs out of
    memory (reserving ``reserved`` bytes); it records what it ran."""

    def __init__(self, step_s: dict[str, float | None], reserved: int | None = None) -> None:
        self.step_s, self.reserved, self.ran = step_s, reserved, list[TrainConfig]()

    def __call__(self, cfg: TrainConfig, steps: int) -> Trial:
        self.ran.append(cfg)
        rt = cfg.runtime
        step_s = self.step_s.get(rt.layout.layers, self.step_s["*"])
        return Trial(rt.layout.layers, rt.layout.resident_layers, step_s, self.reserved)


@pytest.fixture
def auto_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, TrainConfig]:
    return start_auto(tmp_path, monkeypatch)


def start_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, TrainConfig]:
    """A run with ``runtime.policy: auto`` whose profile is ``_report`` and whose host is
    fast (its update does not bound the step): the program picks ``CHOICE``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _config(tmp_path, policy="auto")
    cfg = load_config(path, [])
    cache_rate(update_threads(cfg, Machine.probe(cfg, measure=False)), None, 1000.0)
    monkeypatch.setattr(choose, "profile_layer", lambda args: _report())
    return path, cfg


def _resolve(cfg: TrainConfig) -> tuple[TrainConfig, str]:
    adapter = HFAdapter.from_dir(cfg.model.path)
    chosen, line = auto.resolve_auto(cfg, adapter, Machine.probe(cfg, measure=False),
                                     measure=True)  # fmt: skip
    assert line is not None
    return chosen, line


@pytest.mark.parametrize(("choice_s", "runs"), [(1.5, ALL_F), (1.0, ALL_F), (0.5, CHOICE)])
def test_the_choice_trains_only_when_validated_faster_than_the_default(
    auto_run: tuple[Path, TrainConfig],
    monkeypatch: pytest.MonkeyPatch,
    choice_s: float,
    runs: str,
) -> None:
    trials = FakeTrials({ALL_F: 1.0, "F": 1.0, "*": choice_s})
    monkeypatch.setattr(validate, "run_trial", trials)
    chosen, line = _resolve(auto_run[1])
    assert [c.runtime.layout.layers for c in trials.ran] == [CHOICE, "F"]  # the choice, the default
    assert (chosen.runtime.layout.layers, chosen.runtime.layout.resident_layers) == (runs, 0)
    assert line.startswith(f"policy   auto: {runs}, 0 GPU-resident")
    said = f"{CHOICE}, 0 GPU-resident {choice_s:.3f} s/step vs the default's 1.000 s"
    assert f"; validated (3 steps each): {said}" in line
    selection_s = float(line.split("; selection ")[1].split(" s (")[0])
    assert selection_stages(line) == ["profile", "host", "solve", "validation"]
    if runs == ALL_F:
        assert f"kept: the solver's {CHOICE}, 0 GPU-resident, predicted" in line
        assert line.endswith("break-even never (the default runs)")
    else:
        assert ", predicted 1.67x the default all-F layout" in line
        even = int(line.split("break-even after ")[1].removesuffix(" steps").replace(",", ""))
        # the selection's seconds over the 0.5 s each step saves (the line rounds the seconds)
        assert abs(even - selection_s / 0.5) <= 1


def test_validation_is_off_with_zero_steps_and_refuses_one_step(
    auto_run: tuple[Path, TrainConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_trials(cfg: TrainConfig, steps: int) -> Trial:
        raise AssertionError("a trial ran with validation off")

    monkeypatch.setattr(validate, "run_trial", no_trials)
    path, cfg = auto_run
    off = dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(policy_validate_steps=0))
    chosen, line = _resolve(off)
    assert chosen.runtime.layout.layers == CHOICE  # the solver's choice, as before validation
    assert "; not validated (runtime.policy_validate_steps=0); selection " in line
    assert line.endswith("break-even unknown (not validated)")
    with pytest.raises(Exception, match=r"runtime.policy_validate_steps must be 0 .* or >= 2"):
        load_config(path, ["runtime.policy_validate_steps=1"])


def _choice_and_resolve(
    cfg: TrainConfig, total_bytes: int
) -> tuple[Choice, list[int], Any, TrainConfig]:
    """The program's choice for ``cfg`` at ``total_bytes`` and a re-solve that records its
    budget cuts."""
    adapter = HFAdapter.from_dir(cfg.model.path)
    machine = Machine.probe(cfg, measure=False)
    cuts: list[int] = []

    def solve(cut_bytes: int = 0) -> Choice:
        if cut_bytes:
            cuts.append(cut_bytes)
        return select_layout(
            cfg, adapter, machine, _report(), total_bytes=total_bytes, update_gbps=1000.0,
            resident=False, budget_cut_bytes=cut_bytes,
        )  # fmt: skip

    return solve(), cuts, solve, default_config(cfg)


def test_a_choice_out_of_memory_is_solved_again_with_a_smaller_budget_at_most_twice(
    tmp_path: Path,
) -> None:
    cfg = load_config(_config(tmp_path), [])
    first, cuts, solve, default = _choice_and_resolve(cfg, 80 * GIB)
    assert first.layout == CHOICE
    limit, over = 10 * GIB, 100 * MIB
    # every layout but the default runs out of memory, reserving 100 MiB beyond the limit
    trials = FakeTrials({"F": 1.0, "*": None}, reserved=limit + over)
    found = validate_choice(default, first, solve, steps=3, limit_bytes=limit, runner=trials)
    assert cuts == [over, 2 * over]  # the overshoot taken off again after each failure
    assert len(cuts) == RESOLVES
    assert found.cuts_bytes == (over, 2 * over)
    # the choice, each re-solve, the default
    assert [c.runtime.layout.layers for c in trials.ran][1 + RESOLVES :] == ["F"]
    assert len(trials.ran) == 1 + RESOLVES + 1
    assert found.choice is None
    assert found.winner == found.default
    assert found.result(first).layout == ALL_F
    assert found.break_even_steps(100.0) is None
    assert "re-solved 2x, the budget cut by 0.10, 0.20 GiB" in found.describe()
    # the re-solved program had the smaller budget
    assert solve(2 * over).budget_bytes == first.budget_bytes - 2 * over


def test_a_re_solved_choice_that_fits_and_runs_faster_trains(tmp_path: Path) -> None:
    """At a budget that holds 4 N layers with 0.2 GiB to spare, the choice reserves 0.5 GiB
    beyond the limit: the budget is cut by that, the program takes fewer N layers, and that
    layout (fitting, faster than the default) wins."""
    cfg = load_config(_config(tmp_path), [])
    adapter = HFAdapter.from_dir(cfg.model.path)
    machine = Machine.probe(cfg, measure=False)
    from slidedp.autopolicy.select import HEADROOM, activation_budget

    at_80 = activation_budget(cfg, adapter, machine, 80 * GIB).bytes
    fixed = 80 * GIB - at_80 / (1 - HEADROOM)
    total = int(fixed + (4 * 300 + 4 + 200) * MIB / (1 - HEADROOM))
    first, cuts, solve, default = _choice_and_resolve(cfg, total)
    assert first.layout == CHOICE
    limit = 10 * GIB

    def runner(cfg: TrainConfig, steps: int) -> Trial:
        rt = cfg.runtime
        if rt.layout.layers == CHOICE:  # out of memory, 0.5 GiB over the limit
            return Trial(rt.layout.layers, 0, None, limit + GIB // 2)
        return Trial(rt.layout.layers, 0, 1.0 if rt.layout.layers == "F" else 0.75, limit - GIB)

    found = validate_choice(default, first, solve, steps=3, limit_bytes=limit, runner=runner)
    assert cuts == [GIB // 2]
    assert found.choice is not None
    layout = found.choice.layout
    assert layout != CHOICE
    assert "N-r0" in layout  # fewer N layers within the smaller budget
    assert found.winner.layout == layout
    assert found.speedup() == pytest.approx(4 / 3)
    assert found.break_even_steps(10.0) == 40  # 10 s over the 0.25 s each step saves
    assert found.result(first) == found.choice


def test_nothing_fitting_the_default_included_is_one_line_and_leaves_no_output(
    auto_run: tuple[Path, TrainConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(validate, "run_trial", FakeTrials({"*": None}))
    assert main(["train", str(auto_run[0])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no layout fit the device in validation (4xN-r0, 0 GPU-resident ran out of " in err[-1]
    assert "; the default ran out of memory): lower train.global_batch_size" in err[-1]
    assert err[-1].startswith("slidedp train: error: ")
    assert not (tmp_path / "out").exists()


def _shm_mappings() -> set[str]:
    """This process's mappings of shared-memory files (a store is one, in /dev/shm)."""
    return {x for x in Path("/proc/self/maps").read_text().splitlines() if "/dev/shm/" in x}


@pytest.mark.e2e
def test_a_trial_is_the_engine_and_writes_nothing_in_the_output_dir(tmp_path: Path) -> None:
    """Here and in a child process (as on CUDA, two trials in one): the run's own engine and
    data, the step time the median after a warm-up, the run's output directory as it was."""
    cfg = load_config(_config(tmp_path), ["runtime.layers=N"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    mapped = _shm_mappings()
    here = validate.run_trial(cfg, 3)
    assert _shm_mappings() <= mapped  # its store is gone with it (a child runs many trials)
    assert (here.layout, here.resident_layers, here.reserved_bytes) == ("N", 0, None)
    assert here.step_s is not None
    assert here.step_s > 0
    with TrialChild() as runner:
        child = [runner(cfg, 2), runner(load_config(_config(tmp_path), ["runtime.layers=F"]), 2)]
        assert (runner.trials, runner.processes) == (2, 1)
    assert [(t.layout, t.reserved_bytes) for t in child] == [("N", None), ("F", None)]
    assert all(t.step_s is not None and t.step_s > 0 for t in child)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_rank_says_its_trial_in_one_write(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every rank writes its trial to the same stdout file: the line and its newline in one
    write, or two ranks' lines can run together (seen on CI: ``{...}{...}``)."""
    writes: list[bytes] = []
    write = os.write

    def spy(fd: int, data: bytes) -> int:
        if fd == sys.stdout.fileno():
            writes.append(data)
        return write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    trial = Trial("N", 0, 0.25, None)
    validate.say_trial(trial)
    assert writes == [(json.dumps(dataclasses.asdict(trial)) + "\n").encode()]
    assert Trial(**json.loads(capfd.readouterr().out)) == trial


@pytest.mark.e2e
def test_a_trial_on_two_ranks_starts_them_and_takes_rank_0s_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two CPU ranks, started as ``slidedp train`` starts them: a step time, the run's output
    directory untouched. Of the ranks' trials the slowest step and the largest reservation
    count; a rank out of device memory (its exit code) is a trial that did not fit; ranks past
    ``TIMEOUT_S`` and any other failure are one line."""
    cfg = load_config(_config(tmp_path), ["runtime.layers=N", "runtime.ranks=2"])
    out = tmp_path / "out"
    out.mkdir()
    trial = validate.trial_on_ranks(cfg, 2)
    assert (trial.layout, trial.reserved_bytes) == ("N", None)
    assert trial.step_s is not None
    assert trial.step_s > 0
    assert list(out.iterdir()) == []
    assert runner_for(Machine.probe(cfg, measure=False), 2) is validate.trial_on_ranks

    def ended(code: int, said: bytes, printed: bytes = b"") -> Callable[..., int]:
        def launch(world: int, argv: list[str], **kwargs: Any) -> int:
            spec = kwargs["spec"]
            assert (world, spec.module) == (2, "slidedp.autopolicy.validate")
            spec.stdout.write(printed)
            spec.stderr.write(said)
            return code

        return launch

    from slidedp.runtime import launch

    ranks = [Trial("N", 0, 0.25, 7 * GIB), Trial("N", 0, 0.5, 5 * GIB)]
    printed = "".join(json.dumps(dataclasses.asdict(t)) + "\n" for t in ranks).encode()
    monkeypatch.setattr(launch, "launch", ended(0, b"", b"a warning\n" + printed))
    assert validate.trial_on_ranks(cfg, 2) == Trial("N", 0, 0.5, 7 * GIB)
    monkeypatch.setattr(launch, "launch", ended(validate.EXIT_OUT_OF_MEMORY, b"CUDA out of memory"))
    assert validate.trial_on_ranks(cfg, 2).step_s is None
    monkeypatch.setattr(launch, "launch", ended(launch.EXIT_TIMED_OUT, b""))
    with pytest.raises(ConfigError, match=r"validating N ran past 1800 s; set runtime\.policy_"):
        validate.trial_on_ranks(cfg, 2)
    monkeypatch.setattr(launch, "launch", ended(1, b"Traceback\nRuntimeError: boom\n"))
    with pytest.raises(ConfigError, match=r"validating N failed: RuntimeError: boom$"):
        validate.trial_on_ranks(cfg, 2)


def test_plan_reports_the_validated_step_times_selection_time_and_break_even(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Planned for this machine's GPU (no --gpu-memory; the GPU's size faked here), the plan
    validates its choice and says what it took; for another GPU it cannot."""
    path = _config(tmp_path)
    on_a_gpu(path, monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(validate, "run_trial", FakeTrials({"F": 1.0, "*": 0.5}))
    report = tmp_path / "profile.json"
    report.write_text(json.dumps(_report()))
    policy = tmp_path / "plan.json"
    assert main(["plan", str(path), "--profile", str(report), "--out", str(policy)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(report_path(policy).read_text())
    stages = ["setup_s", "profile_s", "host_s", "solve_s", "validation_s", "check_s"]
    assert list(summary["timing_s"]) == stages
    assert summary["selection_s"] == pytest.approx(sum(summary["timing_s"].values()))
    v = summary["validation"]
    assert (v["winner"], v["steps"], v["speedup"]) == ("chosen", 3, 2.0)
    assert (v["default"]["step_s"], v["trials"][0]["step_s"]) == (1.0, 0.5)
    assert summary["break_even_steps"] == math.ceil(summary["selection_s"] / 0.5)
    assert written_policy(policy)["layers"] == summary["layout"] == CHOICE
    assert "  validated (3 steps each): " in out
    assert f"break-even after {summary['break_even_steps']:,} steps" in out
    said = [
        x.split(":")[0].split(" ")[-1] for x in out.splitlines() if x.startswith("slidedp plan ")
    ]
    assert said == [s.removesuffix("_s") for s in stages]  # each stage said as it ended

    monkeypatch.setattr(validate, "run_trial", FakeTrials({"F": 1.0, "*": 1.2}))
    assert main(["plan", str(path), "--profile", str(report), "--out", str(policy)]) == 0
    summary = json.loads(report_path(policy).read_text())
    assert (summary["validation"]["winner"], summary["break_even_steps"]) == ("default", None)
    assert written_policy(policy) == {"layers": ALL_F, "resident_layers": 0,
                                                  "resident_embeddings": False}  # fmt: skip
    out = capsys.readouterr().out
    assert "break-even never (the default runs)" in out
    assert "(the default: the program's layout did not run faster in validation)" in out

    argv = ["plan", str(path), "--profile", str(report), "--out", str(policy), "--gpu-memory", "40"]
    assert main(argv) == 0
    summary = json.loads(report_path(policy).read_text())
    assert summary["validation"] == {"skipped": "planned for another GPU (--gpu-memory)"}
    assert "validation_s" not in summary["timing_s"]
    assert "break-even unknown (not validated)" in capsys.readouterr().out


@pytest.mark.e2e
def test_auto_validates_on_the_tiny_model_and_trains_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole path with real trials: the layer profiled, the choice and the default run,
    the winner trains; the output directory holds the training run's files only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _config(tmp_path, policy="auto")
    cfg = load_config(path, [])
    cache_rate(update_threads(cfg, Machine.probe(cfg, measure=False)), None, 1000.0)
    monkeypatch.setattr(choose, "profile_layer", lambda args: _report())  # the program picks N
    assert main(["train", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("policy   auto: "))
    assert f"; validated (3 steps each): {CHOICE}, 0 GPU-resident " in line
    resolved = yaml.safe_load((tmp_path / "out" / "resolved_config.yaml").read_text())
    assert resolved["runtime"]["layers"] in (CHOICE, ALL_F)
    assert line.startswith(f"policy   auto: {resolved['runtime']['layers']}, 0 GPU-resident")
    assert len(read_metrics(tmp_path / "out")) == 2
    assert not list((tmp_path / "out").glob("*validate*"))
