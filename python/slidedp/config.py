"""The YAML configuration of ``slidedp train``: a typed tree of keyword-only dataclasses.

Run: ``slidedp train examples/tiny-qwen3.yaml train.max_steps=5 output.dir=/tmp/run``.

Each section validates itself in ``__post_init__``; an unknown key (in the file or in an
override) is an error that names the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slidedp.data.config import DataSection
from slidedp.errors import ConfigError
from slidedp.errors import require as _require


@dataclass(kw_only=True)
class ModelSection:
    path: str  # a local HF model directory: config.json (+ safetensors, tokenizer)

    def __post_init__(self) -> None:
        _require(bool(self.path), "model.path is required")


@dataclass(kw_only=True)
class TrainSection:
    max_steps: int
    global_batch_size: int = 8
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping (and enables the update overlap)
    lr_scheduler: str = "linear"  # constant | linear | cosine (transformers' get_scheduler)
    warmup_steps: int = 0
    seed: int = 42
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 on CUDA, f32 on CPU)

    def __post_init__(self) -> None:
        _require(self.max_steps >= 1, f"train.max_steps must be >= 1, got {self.max_steps}")
        _require(self.global_batch_size >= 1, "train.global_batch_size must be >= 1")
        _require(self.learning_rate >= 0, "train.learning_rate must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"train.{name} must be in [0, 1), got {value}")
        _require(self.adam_epsilon > 0, "train.adam_epsilon must be > 0")
        _require(self.max_grad_norm >= 0, "train.max_grad_norm must be >= 0 (0 disables)")
        schedules = ("constant", "linear", "cosine")
        _require(
            self.lr_scheduler in schedules,
            f"train.lr_scheduler must be one of {', '.join(schedules)}, got {self.lr_scheduler!r}",
        )
        _require(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        dtypes = ("auto", "float32", "bfloat16")
        _require(self.dtype in dtypes, f"train.dtype must be one of {dtypes}, got {self.dtype!r}")


@dataclass(kw_only=True)
class RuntimeSection:
    slots: int = 2  # decoder-layer slots in the device window (>= 2 for prefetch)
    offload_ratio: float = 0.0  # 0: checkpointed inputs stay on device, 1: offloaded to host
    loss_chunk_tokens: int = 1024  # tokens per chunk of the linear + cross-entropy
    device: str = "auto"  # auto | cpu | cuda
    update_threads: int = 0  # host AdamW threads; 0: all available
    version_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _require(self.slots >= 1, f"runtime.slots must be >= 1, got {self.slots}")
        _require(
            self.offload_ratio in (0.0, 1.0),
            f"runtime.offload_ratio must be 0 or 1 for now, got {self.offload_ratio}",
        )
        _require(self.loss_chunk_tokens >= 1, "runtime.loss_chunk_tokens must be >= 1")
        _require(self.device in ("auto", "cpu", "cuda"), "runtime.device must be auto|cpu|cuda")
        _require(self.update_threads >= 0, "runtime.update_threads must be >= 0")


@dataclass(kw_only=True)
class OutputSection:
    dir: str
    export: bool = True  # write OUTPUT/final/ (HF-loadable) at the end

    def __post_init__(self) -> None:
        _require(bool(self.dir), "output.dir is required")


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelSection
    data: DataSection
    train: TrainSection
    output: OutputSection
    runtime: RuntimeSection = field(default_factory=RuntimeSection)


_SECTIONS: dict[str, type[Any]] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "output": OutputSection,
    "runtime": RuntimeSection,
}
_REQUIRED = ("model", "data", "train", "output")


def _typed(section: str, key: str, value: Any, default_type: type[Any]) -> Any:
    """Coerce ints to floats where the field is a float; reject anything else mismatched."""
    if default_type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if default_type is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, default_type) or isinstance(value, bool) != (default_type is bool):
        got = type(value).__name__
        raise ConfigError(f"{section}.{key} must be {default_type.__name__}, got {got} {value!r}")
    return value


def _build(section: str, raw: Any) -> Any:
    cls = _SECTIONS[section]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"section '{section}' must be a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key '{section}.{key}' (known: {known})")
        kind = {"str": str, "int": int, "float": float, "bool": bool}[str(fields[key].type)]
        kwargs[key] = _typed(section, key, value, kind)
    missing = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and n not in kwargs
    ]
    if missing:
        raise ConfigError(f"missing key '{section}.{missing[0]}'")
    return cls(**kwargs)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["train.max_steps=5", ...]`` applied onto the raw YAML tree (values parsed as YAML)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ConfigError(f"override '{item}' must look like section.key=value")
        section, name = parts
        if section not in _SECTIONS:
            raise ConfigError(f"unknown section '{section}' in override '{item}'")
        node = raw.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"section '{section}' must be a mapping")
        node[name] = yaml.safe_load(text)
    return raw


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    for section in raw:
        if section not in _SECTIONS:
            raise ConfigError(f"unknown section '{section}' (known: {', '.join(_SECTIONS)})")
    for section in _REQUIRED:
        if section not in raw:
            raise ConfigError(f"missing section '{section}'")
    return TrainConfig(**{s: _build(s, raw.get(s)) for s in _SECTIONS})


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML file, apply ``section.key=value`` overrides, validate."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping of sections")
    return config_from_dict(apply_overrides(raw, overrides or []))
