"""Tiny model configs for the benchmark tests (written as HF config.json files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import Qwen3Config

from slidedp.bench import train as bench_train
from slidedp.bench.measure import RunSpec
from slidedp.bench.train import ours_config
from slidedp.cli import main

TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def tiny_config(**overrides: Any) -> Qwen3Config:
    return Qwen3Config(**{**TINY, "tie_word_embeddings": True, **overrides})


def write_tiny_config(root: Path, **overrides: Any) -> Path:
    """``root/config.json`` of a tiny Qwen3; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    tiny_config(**overrides).to_json_file(path)
    return path


def tiny_spec(root: Path, system: str, overrides: list[str] | None = None) -> RunSpec:
    """A CPU run of ``system`` on the tiny model at ``root`` (batch 2 x 16 tokens, 1 + 2 steps)."""
    write_tiny_config(root)
    return RunSpec(
        system=system,
        config_dir=str(root),
        batch=2,
        seq_len=16,
        warmup=1,
        steps=2,
        device="cpu",
        ours=ours_config(overrides or []),
    )


def fake_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, step_s: dict[str, float], *extra: str
) -> tuple[list[RunSpec], list[Any], Path]:
    """``slidedp bench train --sweep 2,4 ... EXTRA`` on the tiny model, each worker replaced by
    the result one would write (a system's step time from ``step_s``): the specs the runs were
    given, the figures drawn (``--png``) and the JSON report's path."""
    from matplotlib import pyplot

    specs: list[RunSpec] = []

    def fake_child(spec: RunSpec, workdir: Path) -> tuple[dict[str, Any], int]:
        specs.append(spec)
        raw = {"system": spec.full_system, "batch": spec.batch, "status": "ok",
               "step_times_s": [step_s[spec.full_system]],
               "tokens_per_step": spec.batch * spec.seq_len,
               "gpu_peak_reserved_bytes": 2**31}  # fmt: skip
        return raw, 2**30

    figures: list[Any] = []
    monkeypatch.setattr(bench_train, "run_child", fake_child)
    monkeypatch.setattr(pyplot, "close", figures.append)
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "r.json"
    args = ["bench", "train", "--shape", str(config), "--seq", "16", "--device", "cpu"]
    args += ["--sweep", "2,4", "--json", str(out), "--png", str(tmp_path / "r.png")]
    assert main([*args, *extra]) == 0
    return specs, figures, out
