"""Tiny model configs for the benchmark tests (written as HF config.json files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Qwen3Config

from slidedp.bench.measure import RunSpec
from slidedp.bench.train import ours_config

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
