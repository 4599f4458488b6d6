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
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from slidedp.data.config import DataSection
from slidedp.errors import ConfigError, collect_problems
from slidedp.errors import require as _require
from slidedp.plan.layout import parse_entry
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
        _require(self.global_batch_size >= 1, "train.global_batch_size must be >= 1")
        _require(self.learning_rate >= 0, "train.learning_rate must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"train.{name} must be in [0, 1), got {value}")
        _require(self.adam_epsilon > 0, "train.adam_epsilon must be > 0")
        _require(self.max_grad_norm >= 0, "train.max_grad_norm must be >= 0 (0 disables)")
        _require(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        _require(self.max_consecutive_skips >= 1, "train.max_consecutive_skips must be >= 1")
        _require(self.eval_steps >= 0, "train.eval_steps must be >= 0 (0: only at the end)")
        _require(
            self.on_nonfinite == "stop" or self.max_grad_norm > 0,
            "train.on_nonfinite=skip needs train.max_grad_norm > 0: without clipping, updates "
            "overlap the backward and part of a step is applied before its norm is known",
        )


@dataclass(kw_only=True)
class RuntimeSection:
    slots: int = 2  # decoder-layer slots in the device window (>= 2 for prefetch)
    # per-layer activation layout (plan.layout): [COUNTx]FAMILY[-rRATIO], ... e.g. "31xF, 5xN"
    layers: str = "F"
    offload_ratio: float = 0.0  # ratio of the entries of `layers` that give none (0..1)
    # "": auto on CUDA unless the config names a layout, fixed on CPU (autopolicy.default);
    # auto: select; fixed: these keys as they are; else a file whose policy keys replace them
    # (a plan.json of `slidedp plan` or of a run, or a policy YAML)
    policy: str = ""
    # runtime.policy=auto: training steps each of the choice and the fixed default run before
    # training, the faster one wins (autopolicy.validate; the first step is a warm-up); 0: off
    policy_validate_steps: int = 3
    # runtime.policy=auto: training steps of each calibration trial (autopolicy.calibrate: the
    # shortlisted candidates' layer times measured on a reduced model, then solved again; the median
    # of all but the first: with 3, one slow step of two moved a candidate's time, and three
    # calibrations on the H100 read F-r1 at 0.020-0.064 s, benchmarks/2026-11-25-autopolicy-h100.md,
    # section "The resident update in the program"); 0: off
    policy_calibrate_steps: int = 5
    # runtime.policy=auto: select again though a cached selection matches
    policy_force: bool = False
    loss_chunk_tokens: int = 1024  # tokens per chunk of the linear + cross-entropy
    device: Literal["auto", "cpu", "cuda"] = "auto"
    update_threads: int = 0  # host AdamW threads per rank; 0: its share of the cores
    version_timeout_s: float = 600.0
    chunk_elems: int = 0  # elements per H2D/D2H chunk (a store slot); 0: one decoder layer
    staging_slots: int = 2  # BF16 host staging slots (H2D ring)
    grad_slots: int = 4  # host gradient slots (D2H → AdamW ring; 2 serialize the update lane)
    # BF16 copy of every parameter on the host, written by AdamW: loads are one DMA, no cast
    # (+2 B/param host memory); false: cast each chunk into the staging ring on delivery;
    # null (default): on where the run with it fits the host with 8 GiB to spare
    # (plan.resolve.resolve_mirror), and always for several ranks on the replicated route, where
    # every rank would otherwise cast the whole layer again
    bf16_mirror: bool | None = None
    ranks: int = 1  # CPU processes (gloo) sharing one host state; `slidedp train` starts them
    gpus: int = 1  # GPUs (one process each, NCCL) sharing one host state
    # several machines (runtime.dist): one host state per node; `slidedp train` on each node
    # starts that node's ranks and joins node 0 at master_addr:master_port (torchrun: unused)
    nodes: int = 1
    node_rank: int = 0  # this machine's node, 0..nodes-1 (node 0 hosts the rendezvous)
    master_addr: str = ""  # node 0's address as the other nodes reach it (nodes > 1)
    master_port: int = 29500  # a TCP port free on node 0
    grad_route: Literal["gpu", "cpu"] = "gpu"  # gradients summed on the devices or on the host
    param_route: Literal["replicated", "sharded"] = "replicated"  # whole layer per rank, or 1/R
    trace_path: str = ""  # write a Chrome/Perfetto trace of step `trace_step` here ("" = off)
    trace_step: int = 3  # 0-based step to trace (after warm-up)
    # decoder-layer kernels (models.fast): liger = Liger Kernel's fused RMSNorm/RoPE/SwiGLU
    # (the slidedp[fast] extra, CUDA, Llama-family layers); eager = transformers' modules;
    # auto: liger where it can run, else eager (one banner line says why)
    kernels: Literal["auto", "eager", "liger"] = "auto"
    # torch.compile of the decoder layer (one graph shared by every layer); null (default):
    # on on CUDA where the kernels are eager, off on CPU and with liger (models.fast)
    compile: bool | None = None
    # decoder layers kept on the GPU whole (weights, FP32 master, Adam moments; updated there in
    # one compiled AdamW pass): no H2D, D2H nor host update for them (runtime.resident); one process
    resident_layers: int = 0
    # the embedding and the LM head (with the final norm) kept on the GPU the same way: no
    # host update after the backward for them, the tail every step waits for; one process
    resident_embeddings: bool = False

    @property
    def world(self) -> int:
        """Processes to run: ``ranks`` on CPU, ``gpus`` on CUDA."""
        return max(self.ranks, self.gpus)

    def __post_init__(self) -> None:
        _require(self.slots >= 1, f"runtime.slots must be >= 1, got {self.slots}")
        _require(self.chunk_elems >= 0, "runtime.chunk_elems must be >= 0 (0: one layer)")
        _require(self.staging_slots >= 1, "runtime.staging_slots must be >= 1")
        _require(self.grad_slots >= 1, "runtime.grad_slots must be >= 1")
        _require(self.trace_step >= 0, "runtime.trace_step must be >= 0")
        _require(
            self.policy_validate_steps == 0 or self.policy_validate_steps >= 2,
            "runtime.policy_validate_steps must be 0 (no validation) or >= 2 (a warm-up step, "
            f"then timed ones), got {self.policy_validate_steps}",
        )
        _require(
            self.policy_calibrate_steps == 0 or self.policy_calibrate_steps >= 2,
            "runtime.policy_calibrate_steps must be 0 (no calibration) or >= 2 (a warm-up step, "
            f"then timed ones), got {self.policy_calibrate_steps}",
        )
        _require(
            self.resident_layers >= 0,
            f"runtime.resident_layers must be >= 0, got {self.resident_layers}",
        )
        _require(
            0.0 <= self.offload_ratio <= 1.0,
            f"runtime.offload_ratio must be in [0, 1], got {self.offload_ratio}",
        )
        for entry in self.layers.split(","):  # the layer count is checked against the model
            try:
                parse_entry(entry, 0.0) if entry.strip() else None
            except ConfigError as e:
                _require(False, f"runtime.layers: {e}")
        _require(self.loss_chunk_tokens >= 1, "runtime.loss_chunk_tokens must be >= 1")
        _require(self.update_threads >= 0, "runtime.update_threads must be >= 0")
        _require(self.version_timeout_s > 0, "runtime.version_timeout_s must be > 0 seconds")
        _require(self.ranks >= 1 and self.gpus >= 1, "runtime.ranks and runtime.gpus must be >= 1")
        _require(
            self.ranks == 1 or self.gpus == 1,
            "set runtime.ranks (CPU processes) or runtime.gpus (GPUs), not both",
        )
        _require(
            self.ranks == 1 or self.device == "cpu",
            "runtime.ranks runs CPU processes: set runtime.device=cpu (or runtime.gpus for GPUs)",
        )
        _require(
            self.gpus == 1 or self.device != "cpu",
            "runtime.gpus needs CUDA: set runtime.device=cuda (or runtime.ranks for CPU)",
        )
        _require(self.nodes >= 1, f"runtime.nodes must be >= 1, got {self.nodes}")
        _require(
            self.nodes < 1 or 0 <= self.node_rank < self.nodes,
            f"runtime.node_rank must be in [0, {self.nodes - 1}] (runtime.nodes={self.nodes}), "
            f"got {self.node_rank}",
        )
        _require(
            self.nodes <= 1 or bool(self.master_addr.strip()),
            f"runtime.nodes={self.nodes} needs runtime.master_addr: the address of node 0 "
            "as every node reaches it",
        )
        _require(
            0 < self.master_port < 65536,
            f"runtime.master_port must be in [1, 65535], got {self.master_port}",
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
        _require(self.save_steps >= 0, "output.save_steps must be >= 0 (0: only at the end)")
        _require(self.save_total_limit >= 0, "output.save_total_limit must be >= 0 (0: keep all)")
        _require(self.log_steps >= 1, "output.log_steps must be >= 1")
        _require(
            not self.tensorboard or _tensorboard_installed(),
            "output.tensorboard=true but tensorboard is not installed: pip install tensorboard, "
            "or set output.tensorboard=false",
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
        sections[name] = build_section(name, cls, raw.get(name), problems)
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

    return {
        f.name: plain(dataclasses.asdict(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)
    }


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
