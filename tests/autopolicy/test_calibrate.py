"""AutoPolicy's calibration stage (``calibrate``): the shortlisted candidates' layer times
measured on a reduced model of the run, ``τ_j = τ_0 + (T_j - T_0) / k_j``, replace the
profile's before the program is solved again; a trial out of memory keeps the profiled time;
``train`` says the stage in its own line and in the banner."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from autopolicy.runs import BATCH, SEQ, on_a_gpu, profile_row, resolve, run_config, selection_stages
from engine.tiny import read_metrics
from host_profile.fake import cache_rate
from slidedp.autopolicy import choose, validate
from slidedp.autopolicy.calibrate import SHORTLIST, calibrate_choice, shortlist
from slidedp.autopolicy.command import report_path
from slidedp.autopolicy.program import Candidate, Layout, Problem
from slidedp.autopolicy.select import DEFAULT, Choice, select_layout
from slidedp.autopolicy.validate import Trial
from slidedp.cli import main
from slidedp.config import TrainConfig, load_config
from slidedp.models.hf import HFAdapter
from slidedp.plan.layout import LayerPolicy, parse_layout
from slidedp.plan.machine import Machine, update_threads

MIB, GIB = 2**20, 2**30
N_R0 = LayerPolicy("N")


def _report() -> dict[str, Any]:
    """Profiled: F-r0 30 ms a layer, N-r0 18 ms (the program picks every layer N-r0)."""
    rows = [profile_row("F-r0", 30.0, 1.0), profile_row("N-r0", 18.0, 300.0)]
    return {"batch": BATCH, "seq_len": SEQ, "candidates": rows, "cached": None}


def _config(tmp_path: Path, layers: int, **runtime: object) -> Path:
    return run_config(tmp_path, layers, runtime)


class FakeSteps:
    """A runner whose step time is given per layout text (``"F"``: the reduced model's
    default, or a list of its runs' times in order; ``None``: out of memory); it records each
    config it ran and the layer count of the model it was given (the directory is gone after
    the stage)."""

    def __init__(self, step_s: dict[str, Any]) -> None:
        self.step_s, self.ran, self.model_layers = step_s, list[TrainConfig](), list[int]()

    def __call__(self, cfg: TrainConfig, steps: int) -> Trial:
        self.ran.append(cfg)
        config = json.loads((Path(cfg.model.path) / "config.json").read_text())
        self.model_layers.append(int(config["num_hidden_layers"]))
        rt = cfg.runtime
        step_s = self.step_s["F"] if rt.layout.layers == "F" else self.step_s["*"]
        if isinstance(step_s, list):
            step_s = step_s.pop(0)
        return Trial(rt.layout.layers, rt.layout.resident_layers, step_s, None)


def _solved(path: Path, *overrides: str) -> tuple[TrainConfig, Choice]:
    cfg = load_config(path, list(overrides))
    adapter = HFAdapter.from_dir(cfg.model.path)
    choice = select_layout(cfg, adapter, Machine.probe(cfg, measure=False), _report(),
                           total_bytes=80 * GIB, update_gbps=1000.0,
                           resident=False)  # fmt: skip
    return cfg, choice


def test_the_calibrated_time_is_the_default_time_plus_the_step_added_per_replaced_layer(
    tmp_path: Path,
) -> None:
    cfg, choice = _solved(_config(tmp_path, layers=6))
    assert shortlist(choice) == [N_R0]
    runner = FakeSteps({"F": 1.0, "*": 1.1})
    found = calibrate_choice(cfg, choice, steps=3, runner=runner)
    # K = 4 of the model's 6 layers, k = 2 of them N-r0: τ = 0.030 + (1.1 - 1.0) / 2
    assert (found.layers, found.replaced) == (4, 2)
    assert (found.default_time_s, found.default_step_s) == pytest.approx((0.030, 1.0))
    (one,) = found.candidates
    assert (one.profiled_s, one.step_s, one.time_s) == pytest.approx((0.018, 1.1, 0.080))
    assert found.times_s() == {N_R0: pytest.approx(0.080)}
    assert "N-r0 τ 0.018 → 0.080 s (2 of 4 layers replaced" in found.describe()


def test_the_reduced_model_has_k_layers_and_none_resident(tmp_path: Path) -> None:
    # the run's own layout and resident layers (as the launcher's choice would set them) are
    # not the trials'
    given = ("runtime.layers=6xN", "runtime.resident_layers=2")
    cfg, choice = _solved(_config(tmp_path, layers=6), *given)
    runner = FakeSteps({"F": 1.0, "*": 1.1})
    calibrate_choice(cfg, choice, steps=3, runner=runner)
    assert runner.model_layers == [4, 4, 4]  # the default, the candidate, the default again
    assert [c.runtime.layout.resident_layers for c in runner.ran] == [0, 0, 0]
    assert [c.runtime.autopolicy.policy for c in runner.ran] == ["", "", ""]
    assert [c.runtime.layout.layers for c in runner.ran][::2] == ["F", "F"]
    trial = parse_layout(runner.ran[1].runtime.layout.layers, 4, 0.0)
    assert (trial.count(N_R0), trial.count(DEFAULT)) == (2, 2)
    # the weights are left out: the trainer initialises them from the config
    assert runner.ran[0].model.path != cfg.model.path
    assert not Path(runner.ran[0].model.path).exists()  # a temporary directory, gone


def test_a_candidate_within_the_defaults_spread_keeps_its_profiled_time(tmp_path: Path) -> None:
    """The default runs before and after the candidates: T_0 is their mean, and a T_j no
    farther from it than their spread is noise (as a first trial's warm-up read on the H100)."""
    cfg, choice = _solved(_config(tmp_path, layers=6))
    found = calibrate_choice(cfg, choice, steps=3, runner=FakeSteps({"F": [1.04, 0.96], "*": 0.93}))
    assert (found.default_step_s, found.default_spread_s) == pytest.approx((1.0, 0.08))
    (one,) = found.candidates
    assert (one.step_s, one.time_s) == (0.93, None)  # 0.07 from T_0, within 0.08
    assert found.times_s() == {}
    assert "N-r0 step 0.930 s, within the default's spread (τ 0.018 s kept)" in found.describe()
    assert "the default's step 1.000 ± 0.040 s" in found.describe()
    # beyond the spread it is calibrated, against the mean: τ = 0.030 + (1.1 - 1.0) / 2
    found = calibrate_choice(cfg, choice, steps=3, runner=FakeSteps({"F": [1.04, 0.96], "*": 1.1}))
    assert found.times_s() == {N_R0: pytest.approx(0.080)}
    # the second default out of memory: no spread to tell noise by, every τ kept
    found = calibrate_choice(cfg, choice, steps=3, runner=FakeSteps({"F": [1.0, None], "*": 1.1}))
    assert (found.default_step_s, found.default_spread_s, found.times_s()) == (1.0, None, {})
    assert "N-r0 step 1.100 s (τ 0.018 s kept)" in found.describe()
    assert "the default's step 1.000 s, its second run out of memory: every τ kept" in (
        found.describe()
    )
    # every candidate out of memory: the default is not run again
    runner = FakeSteps({"F": [1.0], "*": None})
    assert calibrate_choice(cfg, choice, steps=3, runner=runner).times_s() == {}
    assert len(runner.ran) == 2


def test_the_shortlist_is_the_used_candidates_but_the_default_most_used_first() -> None:
    names = ["F-r0", "N-r0", "SAC.mm-r0", "F-r1", "S0000100-r0.5", "N-r1"]
    cands = tuple(Candidate(name=n, time_s=0.0, retained_bytes=0.0) for n in names)
    problem = Problem(layers=20, budget_bytes=0.0, candidates=cands)
    solution = Layout(counts=(5, 1, 4, 0, 7, 3), resident_layers=0, step_s=0.0, compute_s=0.0,
                      host_s=0.0, memory_bytes=0.0, offloaded_bytes=0.0)  # fmt: skip
    choice = Choice("", (), 0, problem, solution, solution, True)
    assert len(shortlist(choice)) == SHORTLIST == 3
    assert [str(p) for p in shortlist(choice)] == ["S0000100-r0.5", "SAC.mm-r0", "N-r1"]


def test_a_trial_out_of_memory_keeps_the_profiled_time(tmp_path: Path) -> None:
    cfg, choice = _solved(_config(tmp_path, layers=4))
    found = calibrate_choice(cfg, choice, steps=3, runner=FakeSteps({"F": 1.0, "*": None}))
    assert found.times_s() == {}
    assert "N-r0 ran out of memory (τ 0.018 s kept)" in found.describe()
    adapter = HFAdapter.from_dir(cfg.model.path)
    again = select_layout(cfg, adapter, Machine.probe(cfg, measure=False), _report(),
                          total_bytes=80 * GIB, update_gbps=1000.0, resident=False,
                          times_s=found.times_s())  # fmt: skip
    assert again.layout == choice.layout == "4xN-r0"


@pytest.fixture
def auto_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``runtime.policy: auto`` on a 4-layer model profiled as ``_report`` with a fast host:
    the program picks every layer N-r0 from the profile; validation off, so only the
    calibration can change that."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _config(tmp_path, 4, policy="auto", policy_validate_steps=0)
    cfg = load_config(path, [])
    cache_rate(update_threads(cfg, Machine.probe(cfg, measure=False)), None, 1000.0)
    monkeypatch.setattr(choose, "profile_layer", lambda args: _report())
    return path


def test_the_calibrated_times_are_what_the_program_solves_with(
    auto_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # N-r0 adds 0.2 s to the reduced model's step over its 2 layers: 0.130 s a layer, slower
    # than F-r0's 0.030; the profile's 0.018 would have kept N-r0
    runner = FakeSteps({"F": 1.0, "*": 1.2})
    monkeypatch.setattr(validate, "run_trial", runner)
    chosen, line = resolve(auto_run)
    assert chosen.runtime.layout.layers == "4xF-r0"
    assert "; calibrated (5 steps each): 1 candidate on a 4-layer model: N-r0 τ 0.018 → " in line
    assert "0.130 s (2 of 4 layers replaced; the default's step 1.000 ± 0.000 s, τ 0.030 s)" in line
    assert selection_stages(line) == ["profile", "host", "solve", "calibrate"]


def test_calibration_off_keeps_the_profiled_times(
    auto_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_trials(cfg: TrainConfig, steps: int) -> Trial:
        raise AssertionError("a trial ran with calibration off")

    monkeypatch.setattr(validate, "run_trial", no_trials)
    chosen, line = resolve(auto_run, "runtime.policy_calibrate_steps=0")
    assert chosen.runtime.layout.layers == "4xN-r0"
    assert "; not calibrated (runtime.policy_calibrate_steps=0); " in line


@pytest.mark.e2e
def test_train_with_auto_calibrates_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real run: the profile says N-r0 is faster (so there is a candidate to calibrate), the
    calibration's trials train the reduced model on this CPU, and the run trains."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _config(tmp_path, 3, policy="auto", policy_calibrate_steps=2, policy_validate_steps=0)
    cfg = load_config(path, [])
    cache_rate(update_threads(cfg, Machine.probe(cfg, measure=False)), None, 1000.0)
    monkeypatch.setattr(choose, "profile_layer", lambda args: _report())
    assert main(["train", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    said = next(x for x in out if x.startswith("policy   auto calibrate: "))
    # calibrated, or kept where this CPU's trials differ by less than the default's spread
    assert re.search(r"\(1 candidate on a 3-layer model: N-r0 (τ 0\.018 → |step .* kept\))", said)
    assert "(1 of 3 layers replaced; " in said
    banner = next(x for x in out if x.startswith("policy   auto: "))
    assert "; calibrated (2 steps each): 1 candidate on a 3-layer model: N-r0 " in banner
    assert len(read_metrics(tmp_path / "out")) == 2


def test_a_negative_calibration_step_count_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, 2, policy="auto")
    assert main(["train", str(path), "runtime.policy_calibrate_steps=-1"]) == 2
    err = capsys.readouterr().err
    assert "runtime.policy_calibrate_steps must be 0 (no calibration) or >= 2" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_plan_reports_the_calibrated_times_it_solved_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``slidedp plan`` for this machine's GPU (its size faked) calibrates, and its report
    keeps the calibrated time in the program it solved; for another GPU it cannot."""
    path = _config(tmp_path, 4, policy_validate_steps=0)
    on_a_gpu(path, monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(validate, "run_trial", FakeSteps({"F": 1.0, "*": 1.2}))
    report, policy = tmp_path / "profile.json", tmp_path / "plan.json"
    report.write_text(json.dumps(_report()))
    argv = ["plan", str(path), "--profile", str(report), "--out", str(policy)]
    assert main(argv) == 0
    summary = json.loads(report_path(policy).read_text())
    (one,) = summary["calibration"]["candidates"]
    assert (one["policy"], one["time_s"]) == ("N-r0", pytest.approx(0.130))
    times = {c["name"]: c["time_s"] for c in summary["problem"]["candidates"]}
    assert times == {"F-r0": pytest.approx(0.030), "N-r0": pytest.approx(0.130)}
    assert summary["layout"] == "4xF-r0"
    assert "calibrate_s" in summary["timing_s"]
    out = capsys.readouterr().out
    assert "  calibrated (5 steps each): 1 candidate on a 4-layer model: " in out

    assert main([*argv, "--gpu-memory", "40"]) == 0
    summary = json.loads(report_path(policy).read_text())
    assert summary["calibration"] == {"skipped": "planned for another GPU (--gpu-memory)"}
    assert summary["layout"] == "4xN-r0"
