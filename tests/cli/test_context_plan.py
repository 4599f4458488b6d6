"""A context-parallel run on CUDA may leave its policy to AutoPolicy (the CUDA default, or
``runtime.policy: auto``): the selection prices the all-to-alls (``autopolicy.select``), so
``runtime.context_parallel`` no longer refuses it; a launcher's plan (the key cleared) runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import slidedp.runtime.context_parallel as context_parallel
from engine.tiny import make_model, write_config, write_data
from slidedp.config import load_config
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine
from slidedp.plan.resolve import resolve_plan
from slidedp.runtime.context_parallel import check_context


def test_context_parallel_on_cuda_leaves_its_policy_to_autopolicy(
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
    for policy in ("", "auto", "fixed"):
        check_context(replace(cfg, runtime=cfg.runtime.with_keys(policy=policy)), adapter)
    check_context(ranked, adapter)
