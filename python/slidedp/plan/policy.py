"""The Policy: every choice of how the engine moves data and keeps activations, frozen, resolved
once from the config (``resolve_policy``).

Fields: ``param_route``, ``grad_route``, ``chunk_elems`` (one host slot, H2D and D2H alike), the
window ``slots``, host ``staging_slots``/``grad_slots``, the BF16 ``mirror``, ``layers`` (one
``LayerPolicy`` per decoder layer, ``plan.layout``), ``compute`` (``models.fast``),
``resident_layers`` and ``resident_embeddings``. A policy file (``runtime.policy: path.yaml``)
may set any of them; a key set there and in ``runtime`` to different values is an error.
Invariant: the engine reads these choices only here; the banner and checkpoints record it.

Example::

    policy = resolve_policy(cfg.runtime, adapter, mirror=True, device=torch.device("cuda"))
    print(policy.describe())   # 'replicated/gpu, chunk 52,436,992, 2 slots, ..., 31xF-r0, 5xN-r0'
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import yaml

from slidedp.errors import ConfigError
from slidedp.models.fast import Compute, resolve_compute
from slidedp.plan.layout import LayerPolicy, format_layout, parse_layout
from slidedp.store_layout import Dtype

if TYPE_CHECKING:
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter

PLAN_FILE = "plan.json"  # in output.dir: the plan the run trained with
PLAN_FORMAT = 1
POLICY_FILE_KEYS = (
    "layers",
    "offload_ratio",
    "param_route",
    "grad_route",
    "chunk_elems",
    "slots",
    "staging_slots",
    "grad_slots",
    "bf16_mirror",
    "kernels",
    "compile",
    "resident_layers",
    "resident_embeddings",
)


@dataclass(frozen=True)
class Policy:
    param_route: Literal["replicated", "sharded"]
    grad_route: Literal["gpu", "cpu"]
    chunk_elems: int  # per H2D and D2H transfer (one host slot)
    slots: int  # decoder-layer slots of the device window
    staging_slots: int  # per rank (BF16 H2D ring; unused with the mirror)
    grad_slots: int  # per rank (D2H → AdamW ring)
    mirror: bool  # BF16 mirror in the store (loads are one DMA, no cast)
    layers: tuple[LayerPolicy, ...]
    compute: Compute  # layer kernels and compilation (models.fast)
    # decoder layers 0..resident_layers-1 keep BF16 weights, FP32 master and Adam moments on the
    # device, updated there (runtime.resident); 0 in checkpoints of older runs
    resident_layers: int = 0
    # the embedding and head groups likewise (their update is the host tail of every step);
    # False in checkpoints of older runs
    resident_embeddings: bool = False

    def resident(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is GPU-resident. The FIRST layers are: their
        gradients come last in the backward and their weights first in the next forward, so
        their host updates are the ones no computation hides. Without clipping nothing is
        left to overlap their update with; with clipping the host pass runs in forward order
        after the norm, and the next forward would wait for its first layers at once (resident,
        the pass starts K layers ahead of the forward)."""
        return layer < self.resident_layers

    @property
    def layout(self) -> str:
        return format_layout(self.layers)

    @property
    def offloads(self) -> bool:
        return any(p.ratio > 0 for p in self.layers)

    def describe(self) -> str:
        return (
            f"{self.param_route}/{self.grad_route}, chunk {self.chunk_elems:,} elements, "
            f"{self.slots} slots, {self.staging_slots} staging / {self.grad_slots} gradient "
            f"slots per rank, mirror {'on' if self.mirror else 'off'}, layers {self.layout}, "
            f"{resident_text(self.resident_layers, self.resident_embeddings)}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = self.layout
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        layers = parse_layout(
            d["layers"], num_layers=counted_layers(d["layers"]), default_ratio=0.0
        )
        compute = Compute(**d.get("compute", {"kernels": "eager", "compile": ""}))  # older runs
        return cls(**(d | {"layers": layers, "compute": compute}))


def resident_text(layers: int, embeddings: bool) -> str:
    """What stays on the GPU, as the banner and the reports say it."""
    return f"{layers} GPU-resident" + (" + embeddings" if embeddings else "")


def counted_layers(text: str) -> int:
    """The layer count of a fully counted layout (as ``Policy.to_dict`` writes it);
    ``ValueError`` for an entry without its count."""
    return sum(int(e.strip().split("x", 1)[0]) for e in text.split(",") if e.strip())


def layer_chunk_elems(adapter: HFAdapter) -> int:
    """Slot size that holds the largest decoder layer whole in both store layouts (BF16 params
    padded to 32 elements, F32 state to 16): a layer moves as one chunk, the embedding and the
    LM head as several, so host slots scale with a layer, not with the vocabulary."""
    specs = adapter.group_specs()
    layers = [specs[adapter.layer_group(i)] for i in range(adapter.num_layers)]
    return max(sum(-(-math.prod(p.shape) // 32) * 32 for p in g.params) for g in layers)


def layer_numel(adapter: HFAdapter) -> int:
    """Parameters of the largest decoder layer: the size of the routes' collectives."""
    specs = adapter.group_specs()
    return max(specs[adapter.layer_group(i)].numel for i in range(adapter.num_layers))


def read_policy_file(path: str) -> dict[str, Any]:
    """The keys of a policy file, checked (unknown keys, not a mapping: one line); of a plan
    (``slidedp plan``'s, a run's ``plan.json``), its policy's keys but the BF16 mirror, which
    follows this machine's memory."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"runtime.policy: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"runtime.policy: {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"runtime.policy: {path} must be a mapping of policy keys")
    if "format" in raw:  # a plan
        keys = Plan.from_json(raw, f"runtime.policy: {path}").runtime_keys()
        return {k: v for k, v in keys.items() if k in POLICY_FILE_KEYS and k != "bf16_mirror"}
    unknown = sorted(set(raw) - set(POLICY_FILE_KEYS))
    if unknown:
        raise ConfigError(
            f"runtime.policy: {path} has unknown keys {unknown} (known: {list(POLICY_FILE_KEYS)})"
        )
    return raw


def effective_runtime(rt: RuntimeSection) -> RuntimeSection:
    """``rt`` with the policy file's keys applied (``rt`` itself without one)."""
    # fixed: the config's keys, never auto's (autopolicy.default)
    if rt.autopolicy.policy in ("", "fixed"):
        return rt
    if rt.autopolicy.policy == "auto":  # preflight.check_before_training replaces it by the choice
        raise ConfigError("runtime.policy=auto is chosen by `slidedp train` (or `slidedp plan`)")
    from_file = read_policy_file(rt.autopolicy.policy)
    defaults = type(rt)()
    clash = [k for k, v in from_file.items() if rt.get(k) != defaults.get(k) and rt.get(k) != v]
    if clash:
        raise ConfigError(
            f"runtime.policy {rt.autopolicy.policy} sets {', '.join(clash)}, which the config sets "
            "differently: keep each key in one place"
        )
    return rt.with_checked_keys(from_file, f"runtime.policy {rt.autopolicy.policy}")


def resident_ranks_message(rt: RuntimeSection, world: int) -> str | None:
    """Why GPU-resident layers or embeddings refuse several processes (None: they run, or
    ``rt`` keeps none): the cpu gradient route sums on the host, and a resident group's
    gradient must be reduced on the devices (``runtime.resident``)."""
    if world <= 1 or not (rt.layout.resident_layers or rt.layout.resident_embeddings):
        return None
    if rt.layout.grad_route != "cpu":
        return None
    key = (f"runtime.resident_layers={rt.layout.resident_layers}" if rt.layout.resident_layers
           else "runtime.resident_embeddings=true")  # fmt: skip
    return (
        f"{key} on {world} ranks needs runtime.grad_route=gpu (the cpu route sums gradients "
        "on the host, GPU-resident ones are reduced on the devices): set "
        "runtime.grad_route=gpu, or runtime.resident_layers=0 and "
        "runtime.resident_embeddings=false"
    )


# decoder layers whose last operation scales their output in place (``hidden_states *=
# self.layer_scalar``): an output SAC.noact caches, which torch refuses at the replay
SCALED_IN_PLACE = ("gemma4_text",)


def check_layout_fits(layers: tuple[LayerPolicy, ...], adapter: HFAdapter) -> None:
    """Segment checkpointing (``S<mask>``) cuts the dense Llama-style layer only; ``SAC.noact``
    would cache the buffers a mixture-of-experts layer fills in place (its router's top-k,
    its experts' output), or the output a Gemma 4 layer scales in place, which torch's
    selective checkpointing refuses."""
    model_type = adapter.config.model_type
    for i, policy in enumerate(layers):
        if policy.family == "S" and not adapter.segmentable:
            raise ConfigError(
                f"runtime.layers: layer {i} is S{policy.arg}, but segment checkpointing cuts "
                f"only the dense llama/mistral/qwen2/qwen3 layer, not a {model_type} layer: "
                "use F, SAC or N there"
            )
        if policy.family == "SAC" and policy.arg == "noact" and adapter.moe:
            raise ConfigError(
                f"runtime.layers: layer {i} is SAC.noact, which would cache the buffers a "
                f"{model_type} layer updates in place: use SAC.mm, SAC.attn, F or N there"
            )
        if policy.family == "SAC" and policy.arg == "noact" and model_type in SCALED_IN_PLACE:
            raise ConfigError(
                f"runtime.layers: layer {i} is SAC.noact, which would cache the output a "
                f"{model_type} layer scales in place (its layer_scalar): use SAC.mm, SAC.attn, "
                "F or N there"
            )


def resolve_policy(
    rt: RuntimeSection, adapter: HFAdapter, *, mirror: bool, device: torch.device
) -> Policy:
    """The policy of ``rt`` (the policy file applied) for ``adapter`` on ``device``;
    ``mirror`` as ``plan.resolve.resolve_mirror`` decided."""
    rt = effective_runtime(rt)
    layers = parse_layout(rt.layout.layers, adapter.num_layers, rt.layout.offload_ratio)
    check_layout_fits(layers, adapter)
    if rt.layout.resident_layers > adapter.num_layers:
        raise ConfigError(
            f"runtime.resident_layers={rt.layout.resident_layers} but the model has "
            f"{adapter.num_layers} decoder layers: set 0..{adapter.num_layers}"
        )
    return Policy(
        param_route=rt.layout.param_route,
        grad_route=rt.layout.grad_route,
        chunk_elems=rt.layout.chunk_elems or layer_chunk_elems(adapter),
        slots=rt.layout.slots,
        staging_slots=rt.layout.staging_slots,
        grad_slots=rt.layout.grad_slots,
        mirror=mirror,
        layers=layers,
        compute=resolve_compute(
            rt.layout.kernels, rt.layout.compile, device, adapter, rt.layout.mlp_tile_tokens
        ),
        resident_layers=rt.layout.resident_layers,
        resident_embeddings=rt.layout.resident_embeddings,
    )


def landing_dtype(grad_route: str, *, bf16: bool, processes: int) -> Dtype | None:
    """The dtype of the slots the cpu route's ranks copy their gradients into (the signal
    store's, ``runtime.routes.signal_args``): the compute dtype, so a copy moves the device's
    gradient as it is; None where no host sum runs (one process in all, or the gpu route).
    ``processes``: every node's ranks."""
    if processes == 1 or grad_route != "cpu":
        return None
    return "bf16" if bf16 else "f32"


def store_args(policy: Policy, *, bf16: bool, world: int, nodes: int = 1) -> dict[str, Any]:
    """``HostStore.create``'s arguments for a run with ``policy`` (``Trainer`` creates the
    store, ``estimate`` plans it): the slot rings of the node's ``world`` ranks, the BF16
    mirror when computing in BF16 (it replaces the staging ring). Gradient slots hold what
    AdamW reads: the device's gradient (the compute dtype), or f32 where the host sums the
    ranks' copies (landed in ``landing_dtype``) into them (``Kernels.sum_into``) and
    all-reduces that sum with the other nodes (gloo)."""
    mirror = bf16 and policy.mirror
    summed = landing_dtype(policy.grad_route, bf16=bf16, processes=world * nodes) is not None
    f32_grads = not bf16 or summed
    return {
        "staging_slots": 0 if mirror else policy.staging_slots * world,
        "grad_dtype": "f32" if f32_grads else "bf16",
        "grad_slots": policy.grad_slots * world,
        "chunk_elems": policy.chunk_elems,
        "bf16_mirror": mirror,
    }


@dataclass(frozen=True)
class OptimConfig:
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float  # 0: no clipping


@dataclass(frozen=True)
class Plan:
    """What ``Engine(adapter, store, plan)`` runs: where, in which dtype, with which policy and
    optimizer settings."""

    device: torch.device
    dtype: torch.dtype
    policy: Policy
    optim: OptimConfig
    loss_chunk_tokens: int
    threads: int | None  # host kernel threads (None: all)
    version_timeout_s: float

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON values (``OUTPUT/plan.json``), ``PLAN_FORMAT`` first."""
        return {
            "format": PLAN_FORMAT,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "policy": self.policy.to_dict(),
            "optim": dataclasses.asdict(self.optim),
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "threads": self.threads,
            "version_timeout_s": self.version_timeout_s,
        }

    def runtime_keys(self) -> dict[str, Any]:
        """The ``runtime`` keys that resolve to this plan's policy (``runtime.policy``
        cleared): what a rank started with the plan checks, records and reports it by."""
        return self.runtime_keys_of(self.policy)

    @staticmethod
    def runtime_keys_of(p: Policy) -> dict[str, Any]:
        """``runtime_keys`` of the policy ``p``."""
        return policy_runtime_keys(p.to_dict())

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "plan.json") -> Plan:
        """The plan ``to_json`` wrote; another format is one ``ConfigError`` line."""
        check_plan_format(d, source)
        try:
            optim = d["optim"] | {"betas": tuple(d["optim"]["betas"])}
            return cls(
                device=torch.device(d["device"]),
                dtype=getattr(torch, d["dtype"]),
                policy=Policy.from_dict(d["policy"]),
                optim=OptimConfig(**optim),
                loss_chunk_tokens=int(d["loss_chunk_tokens"]),
                threads=d["threads"],
                version_timeout_s=float(d["version_timeout_s"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise ConfigError(f"{source} does not read as a plan: {e!r}") from None


def check_plan_format(d: Any, source: str) -> None:
    """``d`` is a plan of ``PLAN_FORMAT``; else one ``ConfigError`` line."""
    if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ConfigError(
            f"{source} is not a plan of format {PLAN_FORMAT} (found {found!r}): write it "
            "again with this slidedp (slidedp plan, or a train run)"
        )


def policy_runtime_keys(d: dict[str, Any]) -> dict[str, Any]:
    """The ``runtime`` keys that resolve to the policy ``d`` (``Policy.to_dict``'s form),
    ``runtime.policy`` cleared; the layer compute is not among them."""
    keys = ("resident_layers", "resident_embeddings", "param_route", "grad_route",
            "chunk_elems", "slots", "staging_slots", "grad_slots")  # fmt: skip
    return {"policy": "", "layers": d["layers"], "offload_ratio": 0.0,
            "bf16_mirror": d["mirror"]} | {k: d[k] for k in keys}  # fmt: skip


def write_plan(plan: Plan, out_dir: Path, name: str = PLAN_FILE) -> Path:
    """``out_dir/name`` (``plan.json``), written whole (temp file, then rename)."""
    target, temp = out_dir / name, out_dir / f".{name}.tmp"
    temp.write_text(json.dumps(plan.to_json(), indent=1) + "\n")
    temp.replace(target)
    return target


def read_plan_json(path: Path) -> Any:
    """The JSON at ``path``; unreadable: one line."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the plan {path}: {e}") from None


def read_plan(path: Path) -> Plan:
    """The plan at ``path`` (``write_plan``'s); unreadable or another format: one line."""
    return Plan.from_json(read_plan_json(path), str(path))
