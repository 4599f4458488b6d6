"""The run's one on-disk plan: ``Plan.to_json``/``from_json`` round-trip every field, another
format is one line, and ``slidedp train`` writes ``OUTPUT/plan.json``: the plan it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine
from slidedp.plan.policy import PLAN_FILE, Plan, read_plan, write_plan
from slidedp.plan.resolve import resolve_plan


def _run(tmp_path: Path, **runtime: object) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "train.jsonl", 8)
    return write_config(tmp_path / "run.yaml", model, data, tmp_path / "out",
                        train={"max_steps": 2, "global_batch_size": 4, "learning_rate": 1e-3},
                        runtime=runtime)  # fmt: skip


def test_a_plan_round_trips_through_json(tmp_path: Path) -> None:
    cfg = load_config(_run(tmp_path, layers="1xN-r0.5, 1xSAC.mm, F-r1", resident_layers=1), [])
    adapter = HFAdapter.from_dir(cfg.model.path)
    plan = resolve_plan(cfg, adapter, Machine.probe(cfg, measure=False))
    text = json.dumps(plan.to_json())
    assert Plan.from_json(json.loads(text)) == plan
    path = write_plan(plan, tmp_path)
    assert read_plan(path) == plan


def test_another_format_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a plan of format 1"):
        Plan.from_json({"layers": "F"}, "old.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the plan"):
        read_plan(tmp_path / "bad.json")


@pytest.mark.e2e
def test_train_writes_the_plan_it_ran(tmp_path: Path) -> None:
    path = _run(tmp_path, layers="2xN, F")
    assert main(["train", str(path)]) == 0
    cfg = load_config(path, [])
    ran = read_plan(Path(cfg.output.dir) / PLAN_FILE)
    adapter = HFAdapter.from_dir(cfg.model.path)
    resolved = resolve_plan(cfg, adapter, Machine.probe(cfg, measure=False))
    assert ran.policy == resolved.policy
    assert ran.optim == resolved.optim
    assert ran.policy.layout == "2xN-r0, 1xF-r0"
