"""The bench's rank launcher carries its plan to the ranks as ``slidedp train --plan`` does: it
decides once, writes ``Plan.to_json``, and every rank runs that file's plan; with ``--routes
auto`` the plan is AutoPolicy's choice (which the launcher of ``slidedp train``'s two CPU ranks
makes end to end in tests/autopolicy/test_auto.py, through the same ``resolve_auto``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from bench.tiny import tiny_spec
from slidedp.bench import ours
from slidedp.bench.measure import RunSpec
from slidedp.bench.ours import ours_raw_config, plan_for_ranks, rank_config
from slidedp.config import TrainConfig, config_from_dict
from slidedp.plan.machine import Machine
from slidedp.plan.policy import read_plan
from slidedp.plan.resolve import resolve_plan
from slidedp.preflight import check_model


def test_the_ranks_run_their_launchers_plan(tmp_path: Path) -> None:
    """The bench's rank launcher decides the plan once and writes it as ``Plan.to_json``; each
    rank runs that file's plan (here edited after the launcher wrote it, so a rank deciding for
    itself would differ), its policy also set as the rank's ``runtime`` keys."""
    spec = dataclasses.replace(tiny_spec(tmp_path / "m", "ours"), world=2)
    path, chosen = plan_for_ranks(spec, tmp_path / "x.spec")
    assert chosen == {}  # nothing to say without runtime.policy=auto
    ranks = RunSpec.from_json(json.loads(path.read_text()))
    assert dataclasses.replace(ranks, plan_file="") == spec
    launcher_cfg = config_from_dict(ours_raw_config(spec, tmp_path / "d", tmp_path / "o"))
    machine = Machine.probe(launcher_cfg, measure=False)
    adapter = check_model(launcher_cfg)[0]
    assert read_plan(Path(ranks.plan_file)) == resolve_plan(launcher_cfg, adapter, machine)
    raw = json.loads(Path(ranks.plan_file).read_text())
    raw["policy"] |= {"layers": "2xN-r0", "chunk_elems": 4096}
    Path(ranks.plan_file).write_text(json.dumps(raw))
    cfg, plan = rank_config(ranks, tmp_path / "d", tmp_path / "o")
    assert (plan.policy.layout, plan.policy.chunk_elems) == ("2xN-r0", 4096)
    assert (cfg.runtime.layout.layers, cfg.runtime.layout.chunk_elems) == ("2xN-r0", 4096)
    assert resolve_plan(cfg, adapter, machine).policy == plan.policy


def test_auto_routes_the_launcher_chooses_once_and_says_what(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--routes auto`` on two ranks: the launcher asks AutoPolicy once, free to choose the
    routes (``routes_fixed=None``, as ``slidedp train`` does), writes its choice as the ranks'
    plan and returns the line and the route for the result. AutoPolicy's own choice on two CPU
    ranks is test_auto_on_two_cpu_ranks_chooses_once_in_the_launcher's (tests/autopolicy)."""
    asked: list[dict[str, Any]] = []
    line = "policy   auto: 2xN-r0, 0 GPU-resident (a fake choice)"

    def choose(cfg: TrainConfig, *args: object, **kwargs: Any) -> tuple[TrainConfig, str]:
        asked.append(kwargs)
        rt = cfg.runtime.with_keys(policy="", layers="2xN-r0", param_route="sharded")
        return dataclasses.replace(cfg, runtime=rt), line

    monkeypatch.setattr(ours, "resolve_auto", choose)
    spec = tiny_spec(tmp_path / "m", "ours", ["runtime.policy=auto"])
    spec = dataclasses.replace(spec, world=2, auto_routes=True)
    path, chosen = plan_for_ranks(spec, tmp_path / "x.spec")
    assert asked == [{"measure": True, "routes_fixed": None}]
    plan = read_plan(Path(RunSpec.from_json(json.loads(path.read_text())).plan_file))
    assert (plan.policy.layout, plan.policy.param_route) == ("2xN-r0", "sharded")
    assert chosen == {"policy": line, "chosen_route": f"sharded/{plan.policy.grad_route}"}
