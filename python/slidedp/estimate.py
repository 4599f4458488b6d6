"""The memory a run's ``Plan`` needs before anything is allocated: /dev/shm (the host store's
exact layout), host RAM, pinned memory and the GPU's peak (``estimate_memory``), and the one
line a run the machine cannot hold gets (``check_fits``: ``OutOfSharedMemoryError`` or
``OutOfDeviceMemoryError`` with the numbers). The formulas, their terms and the measurements
they were checked against: ``python/slidedp/ESTIMATE.md``, section "Memory".

Run: ``slidedp estimate CONFIG.yaml`` (the report, ``estimate_report``); ``slidedp train`` and
``slidedp validate`` run the same check.

Example::

    plan = resolve_plan(cfg, adapter, machine)
    check_fits(estimate_memory(cfg, adapter, machine, plan))
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from slidedp.config import TrainConfig
from slidedp.config_runtime import LaunchSpec
from slidedp.errors import OutOfDeviceMemoryError, OutOfSharedMemoryError
from slidedp.models.fast import Compute
from slidedp.models.hf import HFAdapter
from slidedp.plan.context_cost import ContextShape, exchange_bytes
from slidedp.plan.cost import (
    layer_footprint,
    layout_memory,
    resident_rank_bytes,
)
from slidedp.plan.layout import LayerPolicy
from slidedp.plan.machine import GIB, Machine
from slidedp.plan.policy import Plan, Policy, landing_dtype, store_args
from slidedp.runtime.context_parallel import ContextGroup, attention_scheme
from slidedp.runtime.routes import signal_args
from slidedp.store import HostStore
from slidedp.store_layout import StoreLayout

CUDA_PROCESS_BYTES = int(1.6 * GIB)
# one of inductor's compile worker processes, resident: measured on the H100 host (torch 2.11, 16
# cores: 17 processes of ~363 MB beside a run, benchmarks/2026-11-25-autopolicy-h100.md, section
# "The targets re-measured")
COMPILE_WORKER_BYTES = int(0.35 * GIB)
CPU_PROCESS_BYTES = int(0.7 * GIB)
CUDA_CONTEXT_BYTES = int(0.5 * GIB)
ALLOCATOR_BYTES = int(0.4 * GIB)
LOSS_F32_COPIES = 3


@dataclass(frozen=True)
class GpuEstimate:
    window_bytes: int
    loss_bytes: int
    layer_bytes: int  # the largest backward transient of one layer (plan.cost)
    checkpoint_bytes: int  # activations retained on the device + the reload prefetch
    parked_grad_bytes: int
    resident_bytes: int  # the GPU-resident groups, on the rank holding most (plan.cost)
    allocator_bytes: int
    peak_reserved_bytes: int  # what torch.cuda.max_memory_reserved would report
    needed_bytes: int  # peak + CUDA context: compared with the device total


@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    params: int
    layers: int
    device: str
    dtype: str
    batch: int
    seq_len: int
    layout: str  # the per-layer activation layout (Policy.layout)
    layout_rows: list[dict[str, Any]]  # per distinct layer policy and kind: count, bytes/layer
    resident_layers: int  # the first K decoder layers stay on the device (Policy)
    resident_embeddings: bool  # so do the embedding and head groups (Policy)
    resident_bytes: int  # their device bytes (in host RAM on CPU runs)
    clipping: bool
    store_bytes: int
    mirror_bytes: int  # of the store: the BF16 mirror (0: cast on delivery, resolve_mirror)
    signal_bytes: int  # the second store of several processes (routes.share_signals)
    shm_bytes: int
    offload_arena_bytes: int
    process_bytes: int  # every rank's
    compile_workers_bytes: int  # inductor's compile workers, every rank's
    cpu_working_bytes: int  # the device working set, in host RAM on CPU runs
    ram_bytes: int
    pinned_bytes: int
    gpu: GpuEstimate | None
    machine: Machine
    world: int = 1  # processes of the node (runtime.gpus / runtime.ranks)
    route: str = ""  # this run's param_route/grad_route
    trained_params: int = 0  # of ``params``, those that train (train.freeze: the others)
    frozen_saved_bytes: int = 0  # store bytes train.freeze saves (the frozen ones' moments)

    def to_json(self) -> dict[str, Any]:
        """Every field (bytes, seconds, FLOPs as numbers), plus ``fits`` and ``shortages``."""
        short = shortages(self)
        fields = asdict(self)
        if self.machine.device != "cuda":  # Machine counts GPUs only where it runs on one
            fields["machine"]["gpu_count"] = 0
        return fields | {"fits": not short, "shortages": short}


def compile_worker_bytes(backend: str, machine: Machine) -> int:
    """Host memory of one process's inductor compile workers: they compile Triton kernels, so
    only on CUDA with the ``inductor`` backend, and none where torch compiles in one thread."""
    if machine.device != "cuda" or backend != "inductor":
        return 0
    threads = int(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", min(32, machine.cores)))
    return (threads + 1) * COMPILE_WORKER_BYTES if threads > 1 else 0


def estimate_memory(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, plan: Plan
) -> MemoryEstimate:
    """The memory ``plan`` needs on ``machine`` for ``cfg``'s batch and sequence (formulas:
    ESTIMATE.md); the step time is the report's (``estimate_report``)."""
    cuda, bf16 = machine.device == "cuda", machine.dtype == "bfloat16"
    elem = 2 if bf16 else 4
    policy, launch = plan.policy, cfg.runtime.launch
    args = store_args(policy, bf16=bf16, world=launch.world, nodes=launch.nodes)
    layout = HostStore.plan(adapter.group_specs(), **args)
    signals = _signal_bytes(policy, bf16, launch, int(layout.slot_len))
    groups = layout.groups
    params = sum(int(p.numel) for p in layout.params)
    trained = sum(int(p.numel) for p in layout.params if not p.frozen)
    b, s, rt = cfg.train.global_batch_size, cfg.data.seq_len, cfg.runtime
    layers = adapter.num_layers
    # a rank's share (activations, loss): R context ranks read the same rows, S/R tokens each
    # (attention's own: plan.context_cost)
    context = rt.launch.context_parallel
    rows, s_rank = b // (rt.launch.world * rt.launch.nodes // context), s // context
    shape = context_shape(cfg, adapter)
    tokens = rows * s_rank
    largest_layer = max(groups[adapter.layer_group(i)].slot_len for i in range(layers))
    own = groups[adapter.embed_group].slot_len + groups[adapter.head_group].slot_len
    slots = rt.layout.slots if policy.resident_layers < layers else 0  # every layer resident: none
    window = (slots * largest_layer + own) * elem
    loss = min(rt.layout.loss_chunk_tokens, tokens) * adapter.vocab_size * 4 * LOSS_F32_COPIES
    dtype = torch.bfloat16 if elem == 2 else torch.float32
    kernels = policy.compute  # Liger's kernels save less for the backward, a tiled MLP less
    acts = layout_memory(adapter, policy.layers, rows, s_rank, dtype, kernels, shape)
    layer = acts.transient_bytes + exchange_bytes(adapter, rows, s_rank, elem, shape)
    checkpoints = acts.retained_bytes + acts.prefetch_bytes
    clipping = cfg.train.max_grad_norm > 0
    world, route = rt.launch.world, rt.layout.grad_route
    parked = parked_grad_bytes(adapter, elem, world, route) if clipping else 0
    resident = _resident_bytes(adapter, plan, clipping, rt.launch.world)
    working = window + loss + layer + max(checkpoints, parked) + resident
    arena = acts.offloaded_bytes * rt.launch.world  # each rank of this node pins its own
    store = int(layout.regions.total_bytes)
    mirror = int(layout.mirror_len) * 2  # page-locked like the slots
    peak = working + ALLOCATOR_BYTES
    gpu = GpuEstimate(window, loss, layer, checkpoints, parked, resident, ALLOCATOR_BYTES, peak,
                      peak + CUDA_CONTEXT_BYTES) if cuda else None  # fmt: skip
    process, workers, cpu_working = _process_bytes(policy, machine, rt.launch.world, working)
    return MemoryEstimate(
        model=f"{adapter.config.model_type} ({cfg.model.path})",
        params=params,
        layers=layers,
        device=machine.device,
        dtype=machine.dtype,
        batch=b,
        seq_len=s,
        layout=policy.layout,
        layout_rows=_layout_rows(adapter, policy.layers, (rows, s_rank), dtype, kernels, shape),
        resident_layers=policy.resident_layers,
        resident_embeddings=policy.resident_embeddings,
        resident_bytes=resident,
        clipping=clipping,
        store_bytes=store,
        mirror_bytes=mirror,
        signal_bytes=signals,
        shm_bytes=store + signals,
        offload_arena_bytes=arena,
        process_bytes=process,
        compile_workers_bytes=workers,
        cpu_working_bytes=cpu_working,
        ram_bytes=store + signals + arena + process + workers + cpu_working,
        pinned_bytes=_pinned_slot_bytes(layout, elem) + arena if cuda else 0,
        gpu=gpu,
        machine=machine,
        world=rt.launch.world,
        route=f"{rt.layout.param_route}/{rt.layout.grad_route}",
        trained_params=trained,
        frozen_saved_bytes=_unfrozen_store_bytes(adapter, args) - store,
    )


def _pinned_slot_bytes(layout: StoreLayout, elem: int) -> int:
    """What the ranks' copies page-lock in the store: every rank's gradient slots it copies
    into (the cpu route: its landing slots), in the compute dtype, the staging slots and the
    BF16 mirror."""
    slots = 2 * int(layout.staging_slots) + elem * int(layout.grad_slots)
    return int(layout.slot_len) * slots + int(layout.mirror_len) * 2


def _process_bytes(
    policy: Policy, machine: Machine, world: int, working: int
) -> tuple[int, int, int]:
    """Host memory beside the store: every rank is a process of its own, with its own torch
    (and CUDA) runtime (benchmarks/2026-11-22-two-gpus-h200.md, "Host memory, 1 rank vs 2
    ranks": a second CPU rank added 1.6 GiB outside the store), its compile workers, and on
    CPU its working set (each rank's own, in host RAM)."""
    cuda = machine.device == "cuda"
    process = (CUDA_PROCESS_BYTES if cuda else CPU_PROCESS_BYTES) * world
    workers = compile_worker_bytes(policy.compute.compile, machine) * world
    return process, workers, 0 if cuda else working * world


def _signal_bytes(policy: Policy, bf16: bool, launch: LaunchSpec, slot_len: int) -> int:
    """The signal store's exact size where several processes train (none alone): its counters
    and, on the cpu route, every rank's landing slots (``runtime.routes.share_signals``)."""
    processes = launch.world * launch.nodes
    if processes == 1:
        return 0
    landing = landing_dtype(policy.grad_route, bf16=bf16, processes=processes)
    args = signal_args(launch.world, policy.grad_slots, landing, slot_len)
    return int(HostStore.plan(**args).regions.total_bytes)


def parked_grad_bytes(adapter: HFAdapter, elem: int, world: int, grad_route: str) -> int:
    """A clipped step's gradients parked on the rank that parks the most, ``elem`` bytes per
    parameter (``runtime.grad_sync``): on the gpu route a group's gradient is reduced onto
    its owner (group ``g`` on rank ``g % world``) and only the owner parks it; on the cpu
    route (or one rank) every rank parks every group."""
    numels = [int(g.numel) for g in adapter.group_specs()]
    if world == 1 or grad_route != "gpu":
        return sum(numels) * elem
    return max(sum(numels[rank::world]) for rank in range(world)) * elem


def _unfrozen_store_bytes(adapter: HFAdapter, store_args: dict[str, Any]) -> int:
    """The store's bytes with nothing frozen (what ``train.freeze`` saves is the difference)."""
    unfrozen = [replace(g, params=[replace(p, frozen=False) for p in g.params])
                for g in adapter.group_specs()]  # fmt: skip
    return int(HostStore.plan(unfrozen, **store_args).regions.total_bytes)


def _resident_bytes(adapter: HFAdapter, plan: Plan, clipping: bool, ranks: int) -> int:
    """The GPU-resident layers' and embeddings' device bytes on the rank that holds the most
    (``plan.cost.resident_rank_bytes``: each owner holds its groups' FP32 state)."""
    policy = plan.policy
    return resident_rank_bytes(adapter, plan.dtype, clipping=clipping,
                               layers=policy.resident_layers,
                               embeddings=policy.resident_embeddings, ranks=ranks)  # fmt: skip


def context_shape(cfg: TrainConfig, adapter: HFAdapter) -> ContextShape | None:
    """``runtime.context_parallel`` and the attention scheme it runs (None: 1)."""
    return launch_context(cfg.runtime.launch, adapter)


def launch_context(launch: LaunchSpec, adapter: HFAdapter) -> ContextShape | None:
    """``launch.context_parallel`` and the attention scheme it runs on ``adapter``'s model
    (``launch.context_attention`` resolved; None: 1)."""
    r = launch.context_parallel
    if r == 1:
        return None
    group = ContextGroup(0, r, attention=launch.context_attention)
    return ContextShape(r, attention_scheme(adapter.config, group))


def _layout_rows(
    adapter: HFAdapter,
    layers: tuple[LayerPolicy, ...],
    tokens: tuple[int, int],  # rows, sequence length (a context shard's)
    dtype: torch.dtype,
    kernels: Compute,
    context: ContextShape | None,
) -> list[dict[str, Any]]:
    b, s = tokens
    counts: dict[tuple[LayerPolicy, int], int] = {}  # (policy, kind of layer): layers
    for i, p in enumerate(layers):
        key = (p, adapter.layer_kinds[i])
        counts[key] = counts.get(key, 0) + 1
    several_kinds = len(set(adapter.layer_kinds)) > 1
    rows = []
    for (p, kind), n in counts.items():
        fp = layer_footprint(adapter, p, b, s, dtype, kind, kernels, context)
        rows.append(
            {
                "policy": f"{p} (like layer {kind})" if several_kinds else str(p),
                "layers": n,
                "retained_bytes": fp.retained_bytes,
                "offloaded_bytes": fp.offloaded_bytes,
                "transient_bytes": fp.transient_bytes,
            }
        )
    return rows


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def shortages(est: MemoryEstimate) -> list[str]:
    """One clause per resource the machine lacks: what is needed and what there is."""
    m, short = est.machine, []
    if est.shm_bytes > m.shm_free_bytes:
        short.append(f"/dev/shm {gib(est.shm_bytes)} needed, {gib(m.shm_free_bytes)} free")
    if m.mem_available_bytes is not None and est.ram_bytes > m.mem_available_bytes:
        short.append(
            f"host RAM {gib(est.ram_bytes)} needed, {gib(m.mem_available_bytes)} available"
        )
    short += _ulimit_shortages(est)
    gpu = est.gpu
    if gpu is not None and m.gpu_total_bytes is not None and gpu.needed_bytes > m.gpu_total_bytes:
        short.append(f"GPU {gib(gpu.needed_bytes)} needed, {gib(m.gpu_total_bytes)} total")
    return short


def _ulimit_shortages(est: MemoryEstimate) -> list[str]:
    """The shell's per-process limits against what every rank maps: the host store (its
    /dev/shm file). A lower bound: a process maps its own memory besides."""
    m, short = est.machine, []
    left = m.address_space_left_bytes  # beyond what this process maps now (torch imported)
    if left is not None and est.shm_bytes > left:
        short.append(
            f"the host store's {gib(est.shm_bytes)} to map, `ulimit -v` leaves {gib(left)}"
        )
    if m.file_size_limit_bytes is not None and est.shm_bytes > m.file_size_limit_bytes:
        short.append(
            f"a /dev/shm file of {gib(est.shm_bytes)} needed, `ulimit -f` allows "
            f"{gib(m.file_size_limit_bytes)}"
        )
    return short


def _first_host_shortage(est: MemoryEstimate, memory_short: bool) -> tuple[int, int]:
    """(needed, available) bytes of the first host shortage: /dev/shm, RAM, then the limits."""
    m = est.machine
    if est.shm_bytes > m.shm_free_bytes:
        return est.shm_bytes, m.shm_free_bytes
    if memory_short:
        return est.ram_bytes, m.mem_available_bytes or 0
    limits = [v for v in (m.address_space_left_bytes, m.file_size_limit_bytes) if v is not None]
    return est.shm_bytes, min(limits)


def check_fits(est: MemoryEstimate) -> None:
    """Raise one line with the numbers when the machine cannot hold the run: host shortages as
    ``OutOfSharedMemoryError`` (the first one's bytes as attributes), else the GPU's as
    ``OutOfDeviceMemoryError``."""
    short = shortages(est)
    if not short:
        return
    host = [c for c in short if not c.startswith("GPU")]
    limits = _ulimit_shortages(est)
    memory = [c for c in host if c not in limits]  # /dev/shm or RAM
    fixes = []
    if memory:
        fixes.append(
            "enlarge it (e.g. `mount -o remount,size=... /dev/shm`), free memory, or train a "
            "smaller model"
        )
    if limits:
        fixes.append("raise the limit (`ulimit -v unlimited`, `ulimit -f unlimited`)")
    if len(host) < len(short):
        fixes.append(
            "lower train.global_batch_size or data.seq_len, keep fewer activations on the GPU "
            "(runtime.layers: more F layers, runtime.offload_ratio=1), or runtime.slots=2"
        )
    message = (
        f"not enough space in this machine for the run (slidedp estimate): {'; '.join(short)}; "
        f"{'; '.join(fixes)}"
    )
    m = est.machine
    if host:
        error: OutOfSharedMemoryError | OutOfDeviceMemoryError = OutOfSharedMemoryError(message)
        error.needed_bytes, error.available_bytes = _first_host_shortage(
            est, memory_short=bool(memory)
        )
    else:
        assert est.gpu is not None
        assert m.gpu_total_bytes is not None
        error = OutOfDeviceMemoryError(message)
        error.needed_bytes, error.available_bytes = est.gpu.needed_bytes, m.gpu_total_bytes
    raise error
