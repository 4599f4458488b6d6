"""The plan carried to the ranks and the trainer: ``slidedp train`` on several ranks decides the
plan once and passes its JSON to every rank (``--plan``, no ``runtime.*=`` overrides); a run
given a plan trains it as it is, and ``Trainer`` decides nothing of it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from plan.test_plan_json import _run
from slidedp.cli import main
from slidedp.config import RESOLVED_CONFIG, load_config
from slidedp.io.checkpoint import STATE_FILE
from slidedp.io.resume import ResumeDecision, read_resume_decision
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine
from slidedp.plan.policy import PLAN_FILE, read_plan, write_plan
from slidedp.plan.resolve import given_plan_line, kept_plan, resolve_plan
from slidedp.runtime import launch as launching
from slidedp.runtime import trainer


def test_the_launcher_passes_its_plan_and_no_runtime_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _run(tmp_path)
    given = ["runtime.ranks=2", "runtime.device=cpu", "runtime.layers=2xN, F"]
    seen: dict[str, Any] = {}

    def ranks(world: int, argv: list[str], **kwargs: Any) -> int:
        seen["argv"] = argv
        seen["plan"] = read_plan(Path(argv[argv.index("--plan") + 1]))
        seen["resume"] = read_resume_decision(Path(argv[argv.index("--resume-point") + 1]))
        return 0

    monkeypatch.setattr(launching, "launch", ranks)
    assert main(["train", str(path), *given]) == 0
    argv = seen["argv"]
    assert argv[:-4] == ["train", str(path), *given]  # the user's words, nothing chosen added
    assert [argv[-4], argv[-2]] == ["--plan", "--resume-point"]
    assert not Path(argv[-3]).exists()  # files of the launch, gone with it
    assert not Path(argv[-1]).exists()
    assert seen["resume"] == ResumeDecision(None)  # the launcher's decision: a new run
    cfg = load_config(path, given)
    adapter = HFAdapter.from_dir(cfg.model.path)
    assert seen["plan"] == resolve_plan(cfg, adapter, Machine.probe(cfg, measure=False))
    assert seen["plan"].policy.layout == "2xN-r0, 1xF-r0"


@pytest.mark.e2e
def test_a_run_given_a_plan_trains_it_and_the_trainer_decides_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _run(tmp_path)  # the config's layout: all F
    cfg = load_config(path, ["runtime.layers=2xN, F", "runtime.grad_slots=3"])
    adapter = HFAdapter.from_dir(cfg.model.path)
    plan = resolve_plan(cfg, adapter, Machine.probe(cfg, measure=False))
    plan_file = write_plan(dataclasses.replace(plan, threads=1), tmp_path)

    def decided(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the trainer resolved a plan of its own")

    monkeypatch.setattr(trainer, "resolve_plan", decided)
    assert main(["train", str(path), "--plan", str(plan_file)]) == 0
    out = Path(cfg.output.dir)
    ran = read_plan(out / PLAN_FILE)
    told = dataclasses.replace(plan.policy.compute, reason="")  # its kernels given: no reason
    assert ran.policy == dataclasses.replace(plan.policy, compute=told)
    assert ran.threads == 1  # the plan's, not the trainer's share of the cores
    runtime = yaml.safe_load((out / RESOLVED_CONFIG).read_text())["runtime"]
    assert (runtime["layers"], runtime["grad_slots"], runtime["policy"]) == (
        "2xN-r0, 1xF-r0", 3, "")  # fmt: skip


@pytest.mark.e2e
def test_a_resumed_run_keeps_its_checkpoints_plan_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume keeps its checkpoint's plan over the config's layout; ``runtime.policy=fixed``
    or ``--plan FILE`` given on the resume runs instead; each says so in one line."""
    path = _run(tmp_path, layers="2xN, F")
    assert main(["train", str(path), "output.save_steps=1"]) == 0
    out = Path(load_config(path, []).output.dir)
    kept_layout = read_plan(out / PLAN_FILE).policy.layout
    plan_file = write_plan(read_plan(out / PLAN_FILE), tmp_path)
    resumed = ["train.resume=auto", "runtime.layers=F"]  # another layout
    runs = [
        (["train.max_steps=3"], "plan     kept from checkpoint-2: layers 2xN-r0, 1xF-r0 "
         "(the config's 3xF-r0); runtime.policy=fixed runs the config's", kept_layout),
        (["train.max_steps=4", "runtime.policy=fixed"], "plan     runtime.policy fixed runs, not "
         "checkpoint-3's plan: layers 3xF-r0 (checkpoint-3's 2xN-r0, 1xF-r0)", "3xF-r0"),
        (["train.max_steps=5", "--plan", str(plan_file)], f"plan     {plan_file} runs, not "
         "checkpoint-4's plan: layers 2xN-r0, 1xF-r0 (checkpoint-4's 3xF-r0)", kept_layout),
    ]  # fmt: skip
    for extra, line, layout in runs:
        capsys.readouterr()
        assert main(["train", str(path), *resumed, *extra]) == 0
        said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("plan     ")]
        assert said == [line]
        assert read_plan(out / PLAN_FILE).policy.layout == layout


def test_the_checkpoints_plan_is_kept_unless_the_config_names_its_policy(tmp_path: Path) -> None:
    """``kept_plan`` and ``given_plan_line`` on a checkpoint that ran another layout, without
    training: kept by default, not kept for ``runtime.policy: fixed`` or a given plan."""
    path = _run(tmp_path, layers="2xN, F")
    cfg = load_config(path, [])
    adapter = HFAdapter.from_dir(cfg.model.path)
    machine = Machine.probe(cfg, measure=False)
    ran = resolve_plan(cfg, adapter, machine)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / STATE_FILE).write_text(json.dumps({"plan": ran.to_json()}))
    other = load_config(path, ["runtime.layers=F"])
    kept, line = kept_plan(other, adapter, machine, checkpoint)
    assert resolve_plan(kept, adapter, machine).policy == ran.policy
    assert line == (
        "plan     kept from checkpoint-2: layers 2xN-r0, 1xF-r0 (the config's 3xF-r0); "
        "runtime.policy=fixed runs the config's"
    )
    fixed = load_config(path, ["runtime.layers=F", "runtime.policy=fixed"])
    assert kept_plan(fixed, adapter, machine, checkpoint) == (
        fixed,
        "plan     runtime.policy fixed runs, not checkpoint-2's plan: layers 3xF-r0 "
        "(checkpoint-2's 2xN-r0, 1xF-r0)",
    )
    assert kept_plan(cfg, adapter, machine, checkpoint) == (cfg, None)  # the same plan
    given = resolve_plan(other, adapter, machine)
    assert given_plan_line(given, "p.json", checkpoint) == (
        "plan     p.json runs, not checkpoint-2's plan: layers 3xF-r0 (checkpoint-2's 2xN-r0, "
        "1xF-r0)")  # fmt: skip
    assert given_plan_line(ran, "p.json", checkpoint) is None
    assert given_plan_line(given, "p.json", None) is None

    # a checkpoint written before the plan was recorded: the config's plan, nothing said
    old = tmp_path / "old-checkpoint"
    old.mkdir()
    (old / STATE_FILE).write_text(json.dumps({"policy": {"layers": "2xN-r0, 1xF-r0"}}))
    assert kept_plan(other, adapter, machine, old) == (other, None)
    assert given_plan_line(given, "p.json", old) is None
