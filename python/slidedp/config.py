"""The YAML configuration of ``slidedp train``: a typed tree of keyword-only dataclasses.

Run: ``slidedp train examples/tiny-qwen3.yaml train.max_steps=5 output.dir=/tmp/run``.

One YAML file plus ``section.key=value`` overrides. Invariants: the schema is strict
(``slidedp.schema``: unknown keys with the closest name suggested, wrong types, duplicate keys),
and every problem of the whole config is reported at once in one ``ConfigError``;
``config_to_dict`` gives the resolved tree that ``slidedp train`` prints and saves as
``output.dir/resolved_config.yaml``.

Example::

    cfg = load_config("examples/tiny-qwen3.yaml", ["train.max_steps=5", "model.path=/models/q"])
    print(resolved_yaml(cfg))
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import yaml

from slidedp.config_runtime import RuntimeSection, build_runtime
from slidedp.data.config import DataSection
from slidedp.errors import ConfigError, collect_problems
from slidedp.errors import require as _require
from slidedp.schema import TextValue, build_section, did_you_mean, load_yaml


def _tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


@dataclass(kw_only=True)
class ModelSection:
    path: str  # a local HF model directory: config.json (+ safetensors, tokenizer)
    # config.json overrides, applied before the model is built (null: the file's value)
    # RoPE scaling as transformers reads it, e.g. {rope_type: yarn, factor: 4.0,
    # original_max_position_embeddings: 32768}; merged into the model's rope parameters
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int | None = None  # the longest sequence the model takes
    output_router_logits: bool | None = None  # MoE: add the load-balancing loss (transformers')

    def __post_init__(self) -> None:
        _require(bool(self.path), "model.path is required")
        self.path = os.path.expanduser(self.path)  # as a shell would: ~/models/x
        _require(
            self.max_position_embeddings is None or self.max_position_embeddings >= 1,
            f"model.max_position_embeddings must be >= 1, got {self.max_position_embeddings}",
        )
        _require(
            self.rope_scaling is None or "rope_type" in self.rope_scaling,
            "model.rope_scaling needs rope_type (e.g. yarn, linear, dynamic, llama3)",
        )

    def config_overrides(self) -> dict[str, Any]:
        """The config.json fields this section sets (``HFAdapter.from_dir``'s overrides)."""
        fields = ("rope_scaling", "max_position_embeddings", "output_router_logits")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


F32_MAX = 3.4028234663852886e38  # the largest finite float32


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
    lr_scheduler: Literal["constant", "linear", "cosine"] = "linear"  # transformers' get_scheduler
    warmup_steps: int = 0
    seed: int = 42
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, f32 on CPU
    resume: str = ""  # "": new run | auto: newest checkpoint in output.dir, if any | a checkpoint
    verify_checksums: bool = False  # on resume, every file's CRC-32 too (sizes are always checked)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # skip: count the step, apply no update
    max_consecutive_skips: int = 5  # with skip: stop after this many non-finite steps in a row
    # evaluate the held-out data (data.eval_path / eval_fraction) every N steps (0: only at the
    # end, when there is held-out data): eval_loss and eval_perplexity (runtime.evaluate)
    eval_steps: int = 0
    # parameters that never train (models.freeze): layer ranges (layers.0-9), name parts
    # (embed_tokens, lm_head) or fnmatch globs over the full names; no moments, no update
    freeze: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(self.max_steps >= 1, f"train.max_steps must be >= 1, got {self.max_steps}")
        self.resume = os.path.expanduser(self.resume)  # a checkpoint's path, as the others
        _require(self.global_batch_size >= 1, "train.global_batch_size must be >= 1")
        _require(self.learning_rate >= 0, "train.learning_rate must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"train.{name} must be in [0, 1), got {value}")
        _require(self.adam_epsilon > 0, "train.adam_epsilon must be > 0")
        if 0 <= self.adam_beta1 < 1:  # AdamW's first step size and its decay factor are f32
            step = self.learning_rate / (1 - self.adam_beta1)
            _require(
                max(step, self.learning_rate * self.weight_decay) <= F32_MAX,
                f"train.learning_rate={self.learning_rate} overflows AdamW's f32 step "
                "(learning_rate / (1 - adam_beta1) and learning_rate * weight_decay must stay "
                "under 3.4e38)",
            )
        _require(self.max_grad_norm >= 0, "train.max_grad_norm must be >= 0 (0 disables)")
        _require(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        # numpy's generators (the data's order and split) take no negative seed, torch none >= 2**64
        _require(0 <= self.seed < 2**63, f"train.seed must be in [0, 2**63), got {self.seed}")
        _require(self.max_consecutive_skips >= 1, "train.max_consecutive_skips must be >= 1")
        _require(self.eval_steps >= 0, "train.eval_steps must be >= 0 (0: only at the end)")
        _require(
            self.on_nonfinite == "stop" or self.max_grad_norm > 0,
            "train.on_nonfinite=skip needs train.max_grad_norm > 0: without clipping, updates "
            "overlap the backward and part of a step is applied before its norm is known",
        )


@dataclass(kw_only=True)
class OutputSection:
    dir: str
    export: bool = True  # write OUTPUT/final/ (HF-loadable) at the end
    save_steps: int = 0  # checkpoint every N steps (0: only at the end and on SIGTERM/SIGINT)
    save_total_limit: int = 0  # keep the newest N checkpoints (0: all)
    log_steps: int = 1  # a stdout line every N steps (metrics.jsonl has every step)
    # keep the checkpoint of the lowest eval loss (OUTPUT/best names it) beside the newest:
    # an evaluation that improves on it saves one; save_total_limit never removes it
    save_best: bool = False
    tensorboard: bool = field(default_factory=_tensorboard_installed)  # OUTPUT/tensorboard/
    # experiment trackers (runtime.trackers), each getting the config, the plan and every step
    # record: tensorboard (as output.tensorboard=true), wandb (pip install 'slidedp[wandb]';
    # WANDB_PROJECT, WANDB_MODE=offline... as W&B reads them; its files in OUTPUT/wandb/)
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(bool(self.dir), "output.dir is required")
        self.dir = os.path.expanduser(self.dir)  # never a directory named '~' made here
        _require(self.save_steps >= 0, "output.save_steps must be >= 0 (0: only at the end)")
        _require(self.save_total_limit >= 0, "output.save_total_limit must be >= 0 (0: keep all)")
        _require(self.log_steps >= 1, "output.log_steps must be >= 1")
        _require(
            not self.tensorboard or _tensorboard_installed(),
            "output.tensorboard=true but tensorboard is not installed: pip install tensorboard, "
            "or set output.tensorboard=false",
        )
        _require(  # tensorboard=false is a choice only where it is installed (its default)
            self.tensorboard or "tensorboard" not in self.report_to or not _tensorboard_installed(),
            "output.tensorboard=false but output.report_to has tensorboard: take one out",
        )
        for name, module, fix in (
            ("tensorboard", "tensorboard", "pip install tensorboard"),
            ("wandb", "wandb", "pip install 'slidedp[wandb]'"),
        ):
            _require(
                name not in self.report_to or importlib.util.find_spec(module) is not None,
                f"output.report_to has {name} but it is not installed: {fix}, or take it out "
                "of output.report_to",
            )

    def trackers(self) -> list[str]:
        """The trackers of the run: ``report_to``, and tensorboard with ``tensorboard``."""
        return list(dict.fromkeys([*(["tensorboard"] if self.tensorboard else []),
                                   *self.report_to]))  # fmt: skip


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelSection
    data: DataSection
    train: TrainSection
    output: OutputSection
    runtime: RuntimeSection = field(default_factory=RuntimeSection)

    def __post_init__(self) -> None:
        _require(
            not self.train.eval_steps or self.data.has_eval,
            "train.eval_steps needs held-out data: set data.eval_path or data.eval_fraction",
        )
        _require(
            not self.output.save_best or self.data.has_eval,
            "output.save_best needs held-out data: set data.eval_path or data.eval_fraction "
            "(and train.eval_steps)",
        )


_SECTIONS: dict[str, type[Any]] = typing.get_type_hints(TrainConfig)
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(TrainConfig)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
RESOLVED_CONFIG = "resolved_config.yaml"  # written into output.dir before training


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"cannot read config {path}: {e.strerror} (check the path of the YAML file)"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config {path} is not a text file (byte {e.start} is not UTF-8): give the YAML "
            "config file"
        ) from None
    try:
        raw = load_yaml(text)
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise ConfigError(
            f"config {path} is not valid YAML{where}: {e.problem} (fix the file there)"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e} (fix the file)") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config {path} must be a mapping of sections (model:, data:, train:, output:), "
            f"got {type(raw).__name__}"
        )
    return raw


def _apply_overrides(raw: dict[str, Any], overrides: list[str], problems: list[str]) -> None:
    """``["train.max_steps=5", ...]`` set onto the raw YAML tree (see ``TextValue``)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            problems.append(
                f"override '{item}' must look like section.key=value (e.g. train.max_steps=5)"
            )
            continue
        section, name = parts
        if section not in _SECTIONS:
            hint = did_you_mean(section, _SECTIONS)
            problems.append(f"unknown section '{section}' in override '{item}'{hint}")
            continue
        if raw.get(section) is None:
            raw[section] = {}
        if isinstance(raw[section], dict):  # else build_section reports the section itself
            raw[section][name] = TextValue(text)


def _build_config(raw: dict[str, Any], problems: list[str]) -> TrainConfig:
    for name in raw:
        if name not in _SECTIONS:
            problems.append(f"unknown section '{name}'{did_you_mean(str(name), _SECTIONS)}")
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name not in raw and name in _REQUIRED:
            problems.append(f"missing section '{name}' (required: add '{name}:' with its keys)")
            continue
        build = build_runtime if cls is RuntimeSection else partial(build_section, name, cls)
        sections[name] = build(raw.get(name), problems)
    if problems:
        raise ConfigError(*problems)
    with collect_problems() as found:  # checks across sections, if TrainConfig has any
        cfg = TrainConfig(**sections)
    if found:
        raise ConfigError(*found)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    """A validated config from a mapping of sections; every problem in one ``ConfigError``."""
    return _build_config(copy.deepcopy(raw), [])


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML file, apply ``section.key=value`` overrides, validate as a whole."""
    raw = _read_yaml(Path(path))
    problems: list[str] = []
    _apply_overrides(raw, overrides or [], problems)
    return _build_config(raw, problems)


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Every section with every key, defaults filled in: ``config_from_dict`` of it is ``cfg``."""

    def plain(value: Any) -> Any:  # YAML-safe: tuples as lists
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value

    def flat(section: Any) -> dict[str, Any]:  # runtime's groups: its keys flat, as YAML has them
        return (
            section.flat() if isinstance(section, RuntimeSection) else dataclasses.asdict(section)
        )

    return {f.name: plain(flat(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)}


def resolved_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML text (printed by ``slidedp train``, saved in output.dir)."""
    return str(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def write_resolved_config(cfg: TrainConfig) -> Path:
    """``output.dir/resolved_config.yaml``, written whole (temp file, then rename)."""
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / RESOLVED_CONFIG
    temp = out / f".{RESOLVED_CONFIG}.tmp"
    temp.write_text(resolved_yaml(cfg))
    temp.replace(target)
    return target
