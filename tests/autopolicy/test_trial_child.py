"""The trials of a selection in one child process (``autopolicy.trial_child``): trials follow
each other in the same process, one out of memory ends it and the next starts a fresh one, a
failure is one line, ``choose`` ends the child with the selection. The child's
``validate.run_trial`` is replaced (``sitecustomize``) by one that trains nothing."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from autopolicy.runs import resolve, run_config, selection_stages
from autopolicy.test_calibrate import FakeSteps, _report
from host_profile.fake import cache_rate
from slidedp.autopolicy import choose
from slidedp.autopolicy.trial_child import TrialChild, runner_for
from slidedp.autopolicy.validate import Trial, run_trial
from slidedp.config import TrainConfig, load_config
from slidedp.errors import ConfigError
from slidedp.plan.machine import Machine, update_threads
from slidedp.runtime.zygote import children_forked

# in the child: step_s counts the trials this process ran; layers "N" runs out of memory,
# "1xN, F" fails, "1xF, N" is refused as bad input
FAKE = """
import dataclasses
import os
from slidedp.autopolicy import validate
from slidedp.errors import ConfigError

ran = []

def fake(cfg, steps, **kwargs):
    layers = cfg.runtime.layout.layers
    if layers == "1xN, F":
        raise RuntimeError("the trial broke")
    if layers == "1xF, N":
        raise ConfigError("a bad config, said in one line")
    ran.append(layers)
    step_s = None if layers == "N" else float(len(ran))
    return validate.Trial(layers, 0, step_s, 7 * steps)

validate.run_trial = fake
"""


@pytest.fixture
def faked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE)  # runs first in the child
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return run_config(tmp_path, 2, {})


@pytest.mark.e2e
def test_trials_share_one_child_until_one_runs_out_of_memory_or_fails(
    faked: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trials follow each other in one child until one runs out of memory; a failure or a
    refused config is one line and ends its child too; each next trial starts a fresh one.
    The children fork from one zygote as a launcher's do (its imports, the fake included, are
    paid once); tests/autopolicy/test_auto.py's launcher shows them forked from its own."""

    def trial(layers: str) -> Trial:
        return runner(load_config(faked, [f"runtime.layers={layers}"]), 3)

    children = children_forked(("slidedp.autopolicy.trial_child",), own_process=False)
    with children, TrialChild() as runner:
        runner.start()
        runner.wait_ready()
        assert (runner.trials, runner.processes) == (0, 1)
        assert [trial("F"), trial("F-r1")] == [Trial("F", 0, 1.0, 21), Trial("F-r1", 0, 2.0, 21)]
        assert trial("N") == Trial("N", 0, None, 21)  # the third in that process
        assert runner.processes == 1
        capfd.readouterr()
        with pytest.raises(ConfigError, match=r"validating 1xN, F failed: RuntimeError: "
                                              r"the trial broke$"):  # fmt: skip
            trial("1xN, F")  # the first of a fresh process
        assert runner.processes == 2
        assert "Traceback" in capfd.readouterr().err  # the child's stderr passed on
        with pytest.raises(ConfigError, match=r"failed: a bad config, said in one line$"):
            trial("1xF, N")
        assert runner.processes == 3  # the failure ended its child
        assert trial("F").step_s == 1.0  # the first of a fresh process: the refusal ended one
        assert (runner.trials, runner.processes) == (6, 4)
        child = runner._child
        assert child is not None
    assert child.poll() is not None  # closed with the runner
    importing = TrialChild()  # a fresh interpreter, outside the zygote
    importing.start()
    child = importing._child
    assert child is not None
    importing.close()  # killed at once: no trial will come
    assert child.returncode == -9


def test_the_runner_of_each_machine(tmp_path: Path) -> None:
    cfg = load_config(run_config(tmp_path, 2, {}), [])
    cpu = Machine.probe(cfg, measure=False)
    assert runner_for(cpu) is run_trial
    gpu = runner_for(dataclasses.replace(cpu, device="cuda"))
    assert isinstance(gpu, TrialChild)
    gpu.close()


class OneRunner(TrialChild):
    """The selection's runner, as on one GPU, that trains nothing (``FakeSteps``) and says
    whether it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = FakeSteps({"F": 1.0, "*": 0.5})
        self.events: list[str] = []

    def __call__(self, cfg: TrainConfig, steps: int) -> Trial:
        self.events.append("trial")
        return self.steps(cfg, steps)

    def start(self) -> None:
        self.events.append("start")

    def wait_ready(self, cfg: TrainConfig | None = None) -> Any:
        self.events.append("ready")

    def close(self) -> None:
        self.events.append("close")
        super().close()


def test_one_runner_serves_calibration_and_validation_and_ends_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one GPU a selection makes one runner (one child process) for every trial: started
    before the layer is profiled, ready before the host probe, the calibration's trials on the
    reduced model, then the validation's on the run's, and closed at the end."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = run_config(tmp_path, 6, {"policy": "auto"})
    cfg = load_config(path, [])
    cache_rate(update_threads(cfg, Machine.probe(cfg, measure=False)), None, 1000.0)
    said: list[str] = []

    def profiled(args: Any) -> dict[str, Any]:
        said.extend(made[0].events)
        return _report()

    monkeypatch.setattr(choose, "profile_layer", profiled)
    made: list[OneRunner] = []

    def one_runner(machine: Machine, world: int = 1) -> OneRunner:
        made.append(OneRunner())
        return made[-1]

    monkeypatch.setattr(choose, "runner_for", one_runner)
    chosen, line = resolve(path)
    (runner,) = made
    assert said == ["start"]  # when the profile began
    assert runner.events == ["start", "ready", *["trial"] * 5, "close"]
    stages = ["profile", "trials", "host", "solve", "calibrate", "validation"]
    assert selection_stages(line) == stages  # the wait for the child's imports is timed
    assert runner.steps.model_layers == [4, 4, 4, 6, 6]  # K = 4 layers, then the run's 6
    layouts = [c.runtime.layout.layers for c in runner.steps.ran]
    assert layouts == ["F", "2xF-r0, 2xN-r0", "F", "6xN-r0", "F"]
    assert chosen.runtime.layout.layers == "6xN-r0"
    assert "2.00x faster" in line
