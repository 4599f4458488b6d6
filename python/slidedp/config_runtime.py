"""The ``runtime`` section of the config: launch, layout, AutoPolicy and trace keys in groups.

YAML and ``runtime.key=value`` overrides keep every key flat (``runtime: {gpus: 4}``);
``build_runtime`` sorts them into their groups (an unknown key is the schema's one error line
with the closest name), ``RuntimeSection.flat`` writes them flat again, so ``resolved_config.yaml``,
checkpoints and plans keep the flat form. In code: ``cfg.runtime.launch.gpus``.

Example::

    rt = RuntimeSection.from_keys(gpus=2, layers="F")
    assert rt.launch.gpus == 2 and rt.flat()["layers"] == "F"
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from slidedp.errors import ConfigError, collect_problems
from slidedp.errors import require as _require
from slidedp.plan.layout import parse_entry
from slidedp.schema import build_section, did_you_mean


@dataclass(kw_only=True, frozen=True)
class LaunchSpec:
    """Where and how many processes run: ``runtime``'s launch keys."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    ranks: int = 1  # CPU processes (gloo) sharing one host state; `slidedp train` starts them
    gpus: int = 1  # GPUs (one process each, NCCL) sharing one host state
    # several machines (runtime.dist): one host state per node; `slidedp train` on each node
    # starts that node's ranks and joins node 0 at master_addr:master_port (torchrun: unused)
    nodes: int = 1
    node_rank: int = 0  # this machine's node, 0..nodes-1 (node 0 hosts the rendezvous)
    master_addr: str = ""  # node 0's address as the other nodes reach it (nodes > 1)
    master_port: int = 29500  # a TCP port free on node 0
    version_timeout_s: float = 600.0
    # ranks that split every sequence into contiguous shards (attention over the whole sequence:
    # context_attention); data parallelism runs over the ranks / context_parallel groups
    context_parallel: int = 1
    # how attention spans the shards: ulysses = an all-to-all over heads (the query and
    # key/value heads must divide by context_parallel); allgather = each rank keeps its queries and
    # gathers the key/value shards before it (any heads); auto: ulysses where the heads divide
    context_attention: Literal["auto", "ulysses", "allgather"] = "auto"
    # compile the decoder layer's GPU kernels (Liger's, torch.compile's) on a thread of each
    # rank, on its GPU, while the host builds the store, so that the first step finds them
    # compiled (runtime.kernel_warmup); false: the first step compiles them
    kernel_warmup: bool = True

    @property
    def world(self) -> int:
        """Processes to run: ``ranks`` on CPU, ``gpus`` on CUDA."""
        return max(self.ranks, self.gpus)

    @property
    def data_world(self) -> int:
        """Rank groups that read different rows: ``world`` / ``context_parallel``."""
        return self.world // self.context_parallel

    def __post_init__(self) -> None:
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
            self.context_parallel >= 1,
            f"runtime.context_parallel must be >= 1, got {self.context_parallel}",
        )
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


@dataclass(kw_only=True, frozen=True)
class LayoutSpec:
    """How a step runs (the policy a ``Plan`` carries, and the kernels): ``runtime``'s layout
    keys."""

    slots: int = 2  # decoder-layer slots in the device window (>= 2 for prefetch)
    # per-layer activation layout (plan.layout): [COUNTx]FAMILY[-rRATIO], ... e.g. "31xF, 5xN"
    layers: str = "F"
    offload_ratio: float = 0.0  # ratio of the entries of `layers` that give none (0..1)
    loss_chunk_tokens: int = 1024  # tokens per chunk of the linear + cross-entropy
    # the dense MLP of every decoder layer run by tiles of this many tokens, its intermediates
    # recomputed tile by tile in the backward (models.tiled_mlp); 0: untiled
    mlp_tile_tokens: int = 0
    update_threads: int = 0  # host AdamW threads per rank; 0: its share of the cores, but one
    chunk_elems: int = 0  # elements per H2D/D2H chunk (a store slot); 0: one decoder layer
    staging_slots: int = 2  # BF16 host staging slots (H2D ring)
    grad_slots: int = 4  # host gradient slots (D2H → AdamW ring; 2 serialize the update lane)
    # BF16 copy of every parameter on the host, written by AdamW: loads are one DMA, no cast
    # (+2 B/param host memory); false: cast each chunk into the staging ring on delivery;
    # null (default): on where the run with it fits the host with 8 GiB to spare
    # (plan.resolve.resolve_mirror), and always for several ranks on the replicated route, where
    # every rank would otherwise cast the whole layer again
    bf16_mirror: bool | None = None
    grad_route: Literal["gpu", "cpu"] = "gpu"  # gradients summed on the devices or on the host
    param_route: Literal["replicated", "sharded"] = "replicated"  # whole layer per rank, or 1/R
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

    def __post_init__(self) -> None:
        _require(self.slots >= 1, f"runtime.slots must be >= 1, got {self.slots}")
        _require(self.chunk_elems >= 0, "runtime.chunk_elems must be >= 0 (0: one layer)")
        _require(self.staging_slots >= 1, "runtime.staging_slots must be >= 1")
        _require(self.grad_slots >= 1, "runtime.grad_slots must be >= 1")
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
        _require(
            self.mlp_tile_tokens >= 0,
            f"runtime.mlp_tile_tokens must be >= 0 (0: untiled), got {self.mlp_tile_tokens}",
        )
        _require(self.update_threads >= 0, "runtime.update_threads must be >= 0")


@dataclass(kw_only=True, frozen=True)
class AutoPolicySpec:
    """Whether and how AutoPolicy chooses the layout: ``runtime``'s policy keys."""

    # "": auto on CUDA unless the config names a layout, fixed on CPU (autopolicy.default);
    # auto: select; fixed: these keys as they are; else a file whose policy keys replace them
    # (a plan.json of `slidedp plan` or of a run, or a policy YAML); a resume keeps its
    # checkpoint's plan unless this is fixed or a file (plan.resolve.kept_plan)
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

    def __post_init__(self) -> None:
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


@dataclass(kw_only=True, frozen=True)
class TraceSpec:
    """The step trace: ``runtime``'s trace keys."""

    trace_path: str = ""  # write a Chrome/Perfetto trace of step `trace_step` here ("" = off)
    trace_step: int = 3  # 0-based step to trace (after warm-up)

    def __post_init__(self) -> None:
        _require(self.trace_step >= 0, "runtime.trace_step must be >= 0")


@dataclass(kw_only=True, frozen=True)
class RuntimeSection:
    """The ``runtime`` section, grouped by concern; YAML, overrides and ``config_to_dict`` keep
    its keys flat (``runtime.gpus``): ``from_keys``/``with_keys``/``flat`` map between the two."""

    launch: LaunchSpec = field(default_factory=LaunchSpec)
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    autopolicy: AutoPolicySpec = field(default_factory=AutoPolicySpec)
    trace: TraceSpec = field(default_factory=TraceSpec)

    @classmethod
    def from_keys(cls, **keys: Any) -> RuntimeSection:
        """The section of these flat keys (``gpus=2``), every other key at its default."""
        return cls().with_keys(**keys)

    def with_keys(self, **keys: Any) -> RuntimeSection:
        """This section with the flat keys replaced, each in its group; an unknown key raises
        ``TypeError`` as ``dataclasses.replace`` does."""
        unknown = sorted(set(keys) - set(RUNTIME_GROUP_OF))
        if unknown:
            raise TypeError(f"RuntimeSection has no keys {unknown}")
        groups = {
            group: dataclasses.replace(
                getattr(self, group),
                **{k: v for k, v in keys.items() if RUNTIME_GROUP_OF[k] == group},
            )
            for group in {RUNTIME_GROUP_OF[k] for k in keys}
        }
        return dataclasses.replace(self, **groups)

    def with_checked_keys(self, keys: dict[str, Any], source: str) -> RuntimeSection:
        """``with_keys`` checked as the config's keys are (``build_runtime``: unknown keys,
        types, choices, ranges); the problems are one ``ConfigError`` line naming ``source``."""
        problems: list[str] = []
        built = build_runtime(self.flat() | keys, problems)
        if built is None:
            raise ConfigError(f"{source}: {'; '.join(problems)}")
        return built

    def flat(self) -> dict[str, Any]:
        """Every key by its flat YAML name (``{"gpus": 1, ...}``), groups in field order."""
        return {
            k: v
            for f in dataclasses.fields(self)
            for k, v in dataclasses.asdict(getattr(self, f.name)).items()
        }

    def get(self, key: str) -> Any:
        """The value of one flat key (``rt.get("layers")``)."""
        return getattr(getattr(self, RUNTIME_GROUP_OF[key]), key)


RUNTIME_GROUPS: dict[str, type[Any]] = {
    f.name: typing.get_type_hints(RuntimeSection)[f.name]
    for f in dataclasses.fields(RuntimeSection)
}
# each flat ``runtime`` key -> its group's field in RuntimeSection
RUNTIME_GROUP_OF: dict[str, str] = {
    key.name: group for group, cls in RUNTIME_GROUPS.items() for key in dataclasses.fields(cls)
}


def build_runtime(raw: Any, problems: list[str]) -> RuntimeSection | None:
    """The section from its flat YAML keys, each group checked by ``build_section``; appends one
    line per problem (an unknown key: ``unknown key 'runtime.x'`` with the closest name)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return build_section("runtime", RuntimeSection, raw, problems)  # its one error line
    problems_before = len(problems)
    for key in raw:
        if key not in RUNTIME_GROUP_OF:
            hint = did_you_mean(str(key), RUNTIME_GROUP_OF, "runtime.")
            problems.append(f"unknown key 'runtime.{key}'{hint}")
    groups: dict[str, Any] = {
        group: build_section(
            "runtime",
            cls,
            {k: v for k, v in raw.items() if RUNTIME_GROUP_OF.get(k) == group},
            problems,
        )
        for group, cls in RUNTIME_GROUPS.items()
    }
    if len(problems) != problems_before:
        return None
    with collect_problems() as found:  # checks across groups, if RuntimeSection has any
        built = RuntimeSection(**groups)
    problems.extend(found)
    return None if found else built
