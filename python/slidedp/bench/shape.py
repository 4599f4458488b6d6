"""The model ``slidedp bench train`` benches: ``--shape`` (a named shape, an HF config.json, or
a model directory with safetensors) cut to ``--layers``, with the ``model.*`` overrides of
``--set``, the same config for every system; its size and what the report says of it.

Example::

    model = bench_model("qwen3-4b", 0, ours)  # ours: our resolved config, model.* cleared
    model.config, model.params, model.report()
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from slidedp.config import ModelSection
from slidedp.errors import ConfigError
from slidedp.io.hf_load import weight_files
from slidedp.models.hf_config import apply_overrides
from slidedp.models.shapes import SHAPES, cut_layers, resolve_shape
from slidedp.runtime.flops import matmul_params


@dataclass(frozen=True)
class BenchModel:
    """The benched model: its config (every system builds it), the ``model.*`` overrides
    applied, the directory whose weights ours starts from ("" for a seeded init) and its
    stored parameters."""

    config: Any
    overrides: dict[str, Any]
    weights: str
    params: int

    def report(self) -> dict[str, Any]:
        """The report's ``model``: its type, size and the ``model.*`` overrides applied."""
        return {
            "type": self.config.model_type,
            "layers": int(self.config.num_hidden_layers),
            "hidden": int(self.config.hidden_size),
            "params": self.params,
            "matmul_params": matmul_params(self.config),
            "overrides": self.overrides,
        }


def bench_model(shape: str, layers: int, ours: dict[str, Any]) -> BenchModel:
    """``--shape`` and ``--layers`` as the bench runs them (``ours``' ``model.*`` overrides
    moved into the config, ``shape_config``)."""
    config, overrides = shape_config(shape, layers, ours)
    return BenchModel(config, overrides, shape_weights(shape, layers, overrides), _params(config))


def shape_config(shape: str, layers: int, ours: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The model config every system builds: ``shape`` cut to ``layers`` (0: all), with the
    ``model.*`` overrides of ``--set`` (RoPE scaling, the position limit, the router loss)
    applied here, so the reference and the peers train the same model as ours. They are
    cleared from ``ours`` in place: ours reads them from the config like every system.
    Returns the config and the overrides applied (the report records them)."""

    config = resolve_shape(shape)
    if layers:
        config = cut_layers(config, layers)
    overrides = ModelSection(**ours["model"]).config_overrides()
    apply_overrides(config, overrides)
    ours["model"].update(dict.fromkeys(overrides))
    return config, overrides


def shape_weights(shape: str, layers: int, overrides: dict[str, Any]) -> str:
    """The model directory whose safetensors ours starts from: ``--shape`` naming a directory
    (or its config.json) that holds weights; "" for a named shape or a config alone. A cut or
    a changed config would no longer match the weights: refused."""
    if shape in SHAPES:
        return ""
    path = Path(shape)
    if not path.is_dir() and path.name != "config.json":  # a config of its own, not the dir's
        return ""
    folder = path if path.is_dir() else path.parent
    if not weight_files(folder):
        return ""
    if layers or overrides:
        changed = "--layers" if layers else f"--set model.{next(iter(overrides))}"
        raise ConfigError(
            f"--shape {shape}: {folder} holds weights for the model as its config.json says, "
            f"and {changed} changes that model; copy config.json alone to a folder of its own "
            "to bench the changed model from a seeded init"
        )
    return str(folder)


def check_seq(config: Any, seq: int) -> None:
    """Refuse ``--seq`` beyond the benched model's positions, before any system runs."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise ConfigError(
            f"--seq {seq} exceeds the model's max_position_embeddings={limit}; lower --seq, or "
            "raise the limit for every system with --set model.max_position_embeddings=N (and "
            "--set model.rope_scaling=... where the model needs RoPE scaling to reach it)"
        )


def _params(config: Any) -> int:
    """Stored parameters (a tied head counted once), from a meta-device model."""

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return sum(p.numel() for p in model.parameters())
