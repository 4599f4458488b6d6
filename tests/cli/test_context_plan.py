"""A rank started with the launcher's plan (``train --plan``: ``runtime.policy`` cleared) runs
context parallelism on CUDA: the cleared key is not read as the CUDA default (AutoPolicy),
which ``runtime.context_parallel`` refuses while the config still has a policy to settle."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import slidedp.runtime.context_parallel as context_parallel
from engine.tiny import make_model, write_config, write_data
from slidedp.config import load_config
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine
from slidedp.plan.resolve import resolve_plan
from slidedp.preflight import check_context_planned


def test_a_given_plan_runs_context_parallel_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path, "qwen3", tied=False)
    data = write_data(tmp_path / "data.jsonl", 8)
    runtime = {"device": "cpu", "ranks": 2, "context_parallel": 2, "kernels": "eager",
               "compile": False}  # fmt: skip
    cfg = load_config(str(write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                                       runtime=runtime)), [])  # fmt: skip
    adapter = HFAdapter.from_dir(str(model))
    # what a rank runs: the config with the plan's keys (the launcher's fixed choice)
    plan = resolve_plan(cfg, adapter, Machine.probe(cfg, measure=False))
    ranked = replace(cfg, runtime=cfg.runtime.with_keys(**plan.runtime_keys()))
    assert ranked.runtime.autopolicy.policy == ""
    monkeypatch.setattr(context_parallel, "pick_device", lambda _: torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"runtime\.policy must be fixed"):
        check_context_planned(ranked, adapter, planned=False)  # still to settle: refused
    check_context_planned(ranked, adapter, planned=True)
