"""What the AutoPolicy stage tests share: a layer profile's row, a run on the tiny Qwen3, and
``runtime.policy: auto``'s resolution of it (its config and banner line)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.tiny import make_model, write_config, write_data
from host_profile.fake import cache_rate
from slidedp.autopolicy import auto
from slidedp.config import TrainConfig, load_config
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import Machine, update_threads
from slidedp.plan.policy import read_plan

MIB = 2**20
BATCH, SEQ = 4, 32


def profile_row(policy: str, time_ms: float, retained_mib: float) -> dict[str, Any]:
    """A Pareto candidate of ``slidedp profile layer``'s report: a third of the time forward."""
    return {"policy": policy, "pareto": True, "forward_s": time_ms / 3e3,
            "backward_s": 2 * time_ms / 3e3, "reload_s": 0.0, "retained_bytes": None,
            "estimated_retained_bytes": int(retained_mib * MIB), "offloaded_bytes": 0,
            "estimated_offloaded_bytes": 0, "transient_bytes": None,
            "estimated_transient_bytes": 4 * MIB}  # fmt: skip


def run_config(tmp_path: Path, layers: int, runtime: dict[str, object]) -> Path:
    """A clipped 2-step run of the tiny Qwen3 with ``layers`` decoder layers."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=layers)
    data = write_data(tmp_path / "data.jsonl", 16, min_len=SEQ, max_len=SEQ)
    return write_config(tmp_path / "run.yaml", model, data, tmp_path / "out",
                        train={"max_steps": 2, "global_batch_size": BATCH, "max_grad_norm": 1.0},
                        runtime=runtime, output={"tensorboard": False})  # fmt: skip


def resolve(path: Path, *overrides: str) -> tuple[TrainConfig, str]:
    """``train``'s selection for the run at ``path``: the config it trains and its line."""
    cfg = load_config(path, list(overrides))
    adapter = HFAdapter.from_dir(cfg.model.path)
    chosen, line = auto.resolve_auto(cfg, adapter, Machine.probe(cfg, measure=False),
                                     measure=True)  # fmt: skip
    assert line is not None
    return chosen, line


def on_a_gpu(path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """The run at ``path`` planned as on an 80 GiB GPU (``Machine.probe``'s size faked), its
    caches under ``cache``, the host AdamW rate cached (1000 GB/s): no probe runs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    cfg = load_config(path, [])
    cache_rate(update_threads(cfg, Machine.probe(cfg, measure=False)), None, 1000.0)
    probe = Machine.probe

    def with_gpu(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Machine:
        return dataclasses.replace(probe(cfg, *args, **kwargs), gpu_total_bytes=80 * 2**30)

    monkeypatch.setattr(Machine, "probe", with_gpu)


def selection_stages(line: str) -> list[str]:
    """The stages an auto banner line's selection clause times, in order
    (``...; selection 1.2 s (profile 0.4, host 0.1, solve 0.0, ...), break-even ...``)."""
    stages = line.split("; selection ")[1].split(" s (")[1].split(")")[0]
    return [s.split(" ")[0] for s in stages.split(", ")]


def written_policy(path: Path) -> dict[str, Any]:
    """The layout and residency of the plan ``slidedp plan`` wrote at ``path``."""
    policy = read_plan(path).policy
    return {"layers": policy.layout, "resident_layers": policy.resident_layers,
            "resident_embeddings": policy.resident_embeddings}  # fmt: skip
