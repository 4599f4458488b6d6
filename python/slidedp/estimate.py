"""What a run needs — /dev/shm, host RAM, pinned memory, GPU peak, step time — before allocating.

Run: ``slidedp estimate CONFIG.yaml [section.key=value ...] [--json]``; ``slidedp train`` and
``slidedp validate`` refuse a run the machine cannot hold (``check_fits``), with the numbers.

The model comes from ``HFAdapter.from_dir`` (meta device: no weight is read or allocated). ``L``
decoder layers, hidden ``H``, intermediate ``I``, ``d_q = heads * head_dim``, ``d_kv = kv_heads *
head_dim``, vocabulary ``V``, ``N`` parameters; ``B = train.global_batch_size`` rows of ``S =
data.seq_len`` tokens (an upper bound: unpacked rows are padded to the batch's longest), of which
each of ``R`` ranks (``runtime.gpus``/``ranks``) holds ``B/R``: the device terms below are one
rank's at ``B/R`` rows, the offload arena and a CPU rank's working set count ``R`` times; ``e`` the
compute dtype's bytes (2 for bf16 on CUDA, 4 for f32 on CPU); the per-layer activation layout
is the run's ``Policy`` (``plan.policy``), its memory ``plan.cost`` (measured by running the
engine's own executors on the meta device).

Host (``/dev/shm`` and RAM):

- store: its exact ``total_bytes``, from the layout the trainer would create (``HostStore.plan``
  with the trainer's own arguments: staging/gradient slots of ``runtime.chunk_elems`` or one
  decoder layer, gradients in the compute dtype; the BF16 mirror, 2 B/param, where
  ``resolve_mirror`` puts it). It lives in ``/dev/shm`` and counts in RAM.
- activation offload arenas: every layer's offloaded bytes (``plan.cost``), pinned.
- process: 1.6 GiB with CUDA (BENCHMARKS.md "Qwen3-4B shape, host memory": PSS minus store and
  arena), 0.7 GiB on CPU (PSS after importing torch, transformers and the trainer, measured on the
  2-core dev machine); per rank, each its own process.
- inductor's compile workers (CUDA, compiled decoder layers: ``runtime.compile``): a sidecar
  and one process per compile thread (torch's own count: ``TORCHINDUCTOR_COMPILE_THREADS``, else
  the cores, 32 at most), ``COMPILE_WORKER_BYTES`` each while they live (from the first
  compiled step, when the store and the arena are in place; newer torch retires idle workers
  after a minute), per rank.
- on CPU the "device" working set below is host RAM too.

Pinned (CUDA only): the store's staging and gradient slots plus the offload arena.

GPU peak, as ``torch.cuda.max_memory_reserved`` reports it::

    window + loss + layer + max(checkpoints, parked) + resident + allocator

- window: ``runtime.slots`` x the largest decoder layer + embedding + head, in the compute dtype
  (the groups' slot lengths of the store layout: exactly what ``runtime/window.py`` allocates;
  no slots when every layer is resident);
- loss: ``min(loss_chunk_tokens, B*S) * V * 4 B * 3`` (f32 logits, softmax, their gradient);
- layer: the largest backward transient of one layer (``plan.cost``: the tensors its replay
  saves and the gradients alive with them; for full checkpointing ``2.13 GiB`` per 8 rows of
  1024 tokens on Qwen3-4B, as the earlier hand formula ``2 * B * S * (8H + 4I + 2d_q + 2d_kv)
  * e`` that was validated below);
- checkpoints: the activations every layer keeps on the device (its layout's retained share:
  the F input ``B * S * H * e``, more for S, SAC and N) plus the largest layer's offloaded
  share (reloaded one layer ahead); parked gradients (``max_grad_norm > 0``): ``N * e``. The
  backward frees activations as it parks gradients, so the larger one counts;
- resident: the GPU-resident layers (``runtime.resident_layers``, the first K): their weights
  (``e`` B/param), FP32 master and Adam moments (12 B/param) and, without clipping, their
  gradients (``e`` B/param; with clipping they are among the parked ones) — exactly the
  buffers ``runtime/resident.py`` allocates (``plan.cost.resident_layer_bytes``); on CPU they
  are host RAM, like the rest of the working set; resident embeddings
  (``runtime.resident_embeddings``) add the embedding and head groups' master and moments
  (``plan.cost.resident_embedding_bytes``);
- allocator: 0.4 GiB (block rounding, cuBLAS workspaces). With ``plan.cost``'s
  ``REPLAY_PEAK_FACTOR`` (1.64) the two constants fitted to the measurements below.

The layer terms count what the run's layer kernels save (``Policy.compute.kernels``): with
Liger's, what its Functions save (``models.liger_twins``) at ``LIGER_REPLAY_PEAK_FACTOR``
(1.90), fitted to the H100 with Liger at 64K and 128K tokens: Qwen3-4B 128K 53.12 vs 53.07 GiB,
64K 28.18 vs 27.80, Qwen3-8B 64K 40.07 vs 39.82, 128K without clipping 74.97 vs 67.38 (+11%),
Qwen3-4B B=32 S=1024 17.58 vs 15.04 (+17%); eager modules' counts were 12-28% high there.

Against BENCHMARKS.md (Qwen3-4B, S=1024, 2 slots, H100), GPU reserved: B=16 clip r=1 14.99 vs
15.0 GiB (-0.1%), B=16 clip r=0 14.99 vs 15.1 (-0.7%), B=16 no clip r=1 7.66 vs 7.6 (+0.8%), B=8
clip r=1 12.86 vs 12.9 (-0.3%); the batch slope of the layer term (2.13 GiB per 8 rows) matches
the measured 2.1. Other layouts: BENCHMARKS.md "Elastic Checkpointing". Host RAM vs PSS:
50.12 vs 50.15 GiB (B=16 r=1), 47.31 vs 47.30 (r=0), 48.71 vs
48.71 (B=8); the store 45.71 vs 45.73 GiB of shm. CPU (the demo: SmolLM2-135M, B=8, S=128, f32):
3.53 GiB vs a peak PSS of 3.60 (-2%). Compared with the device total, the GPU peak adds the CUDA
context (0.5 GiB, outside torch's allocator: a typical figure, not measured here).

Step time, a range::

    compute = flops_per_token(S) * B * S * 4/3 / (efficiency * peak)
    host    = 28 B/param * N / AdamW bandwidth(update threads)
    step    = [max(compute at the high efficiency, host), max(compute at the low one, host)]

``4/3``: the recompute forward of full-layer checkpointing. GPU: the dense bf16 peak of the
device kind (``GPU_PEAK_FLOPS``), efficiency 15%..50%: 15% is this engine's measured utilization
on H100 (Qwen3-4B B=8, 1.75 s), 50% a compute-bound run; the measured 2.47 s (B=16) and 1.75 s
(B=8) lie in their ranges (1.11-3.69 s, 0.66-1.84 s). CPU: torch's matmul FLOP/s in the compute
dtype, measured when estimating (one thread's best 512³ product, times torch's threads),
efficiency 25%..90%: the demo on the 2-core dev machine (median step 17.1 s) lies in its range
(about 7-25 s; single steps of that noisy machine spread over 7.7-54.6 s). AdamW bandwidth
(``host_rate``): this machine's ``slidedp profile host`` at the run's update threads where it
is cached (beside a GPU, the rate under concurrent H2D/D2H copies), else BENCHMARKS.md's
kernel table from a 16-core Sapphire Rapids (1-16 threads, interpolated; linear in threads
beyond 16); the output says which. Estimating never measures it (``plan`` and
``runtime.policy: auto`` do). The bound that dominates is the larger one at the fast end. It is
an estimate, labelled as one.

Example::

    cfg = load_config("run.yaml")
    adapter = HFAdapter.from_dir(cfg.model.path, cfg.model.config_overrides())
    est = estimate_run(cfg, adapter, Machine.probe(cfg))
    print(format_estimate(est))
    check_fits(est)   # raises OutOfSharedMemoryError / OutOfDeviceMemoryError, one line
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from slidedp.config import TrainConfig
from slidedp.envinfo import meminfo_bytes
from slidedp.errors import OutOfDeviceMemoryError, OutOfSharedMemoryError
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import (
    layer_footprint,
    layout_memory,
    resident_embedding_bytes,
    resident_layer_bytes,
)
from slidedp.plan.device import pick_device, pick_dtype
from slidedp.plan.layout import LayerPolicy
from slidedp.plan.policy import Policy, resolve_policy, store_args
from slidedp.plan.timing import (
    ADAMW_BYTES_PER_PARAM,
    CAST_GBPS,
    Links,
    Ranks,
    layer_times,
    predict_step,
    spec_from_shapes,
)
from slidedp.profile.host import cached_host, engine_update_threads, model_gbps, probe_host
from slidedp.runtime.flops import model_flops_per_token
from slidedp.store import HostStore

GIB = 2**30
SHM_DIR = Path("/dev/shm")
CUDA_PROCESS_BYTES = int(1.6 * GIB)
# one of inductor's compile worker processes, resident: measured on the H100 host (torch 2.11,
# 16 cores: 17 processes of ~363 MB beside a run, BENCHMARKS.md issue #16)
COMPILE_WORKER_BYTES = int(0.35 * GIB)
# RAM an automatic BF16 mirror leaves free beyond the run (page cache, the data, other processes)
MIRROR_HEADROOM_BYTES = 8 * GIB
CPU_PROCESS_BYTES = int(0.7 * GIB)
CUDA_CONTEXT_BYTES = int(0.5 * GIB)
ALLOCATOR_BYTES = int(0.4 * GIB)
LOSS_F32_COPIES = 3
RECOMPUTE_FACTOR = 4 / 3
GPU_EFFICIENCY = (0.15, 0.50)
CPU_EFFICIENCY = (0.25, 0.90)
# AdamW GB/s by host threads, BENCHMARKS.md "Host kernels" (16-core Sapphire Rapids, AVX-512)
ADAMW_GBPS = ((1, 18.0), (2, 31.6), (4, 62.8), (8, 100.5), (16, 170.4))
# Dense bf16 tensor-core FLOP/s by device name (first match wins: the PCIe H100 before H100)
GPU_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


@dataclass(frozen=True)
class Machine:
    """What the run would get: device kind, cores, free /dev/shm, MemAvailable, the GPU."""

    device: Literal["cuda", "cpu"]
    dtype: Literal["bfloat16", "float32"]
    cores: int
    shm_free_bytes: int
    mem_available_bytes: int | None
    gpu_name: str | None = None
    gpu_total_bytes: int | None = None
    cpu_flops: float | None = None  # measured torch matmul FLOP/s in ``dtype`` (CPU runs)
    gpu_count: int = 1  # GPUs visible to this process (``estimate --gpus`` may predict more)

    @classmethod
    def probe(cls, cfg: TrainConfig, shm_dir: Path = SHM_DIR, measure: bool = True) -> Machine:
        """This machine, for the device and dtype ``cfg`` resolves to (as the trainer does);
        ``measure=False`` skips the CPU matmul timing (no step time: the memory checks only)."""
        device = pick_device(cfg.runtime.device)
        dtype = pick_dtype(cfg.train.dtype, device)
        stat = os.statvfs(shm_dir)
        facts: dict[str, Any] = {}
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device.index or 0)
            facts = {
                "gpu_name": props.name,
                "gpu_total_bytes": int(props.total_memory),
                "gpu_count": torch.cuda.device_count(),
            }
        elif measure:
            facts = {"cpu_flops": measure_cpu_flops(dtype)}
        return cls(
            device="cuda" if device.type == "cuda" else "cpu",
            dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
            cores=len(os.sched_getaffinity(0)),
            shm_free_bytes=stat.f_bavail * stat.f_frsize,
            mem_available_bytes=meminfo_bytes().get("mem_available_bytes"),
            **facts,
        )


def measure_cpu_flops(dtype: torch.dtype, n: int = 512, budget_s: float = 0.2) -> float:
    """torch's matmul FLOP/s on this CPU in ``dtype``: one thread's best ``n``³ product within
    ``budget_s`` (at least 3, after a warm-up) times torch's thread count. One thread, because
    a multi-threaded product on cores that other processes hold is ~10x slower (oversubscribed
    OpenMP barriers) and would describe the moment, not the machine."""
    threads = torch.get_num_threads()
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.set_num_threads(1)
    try:
        torch.matmul(a, b)
        best, spent, runs = math.inf, 0.0, 0
        while runs < 3 or spent < budget_s:
            start = time.perf_counter()
            torch.matmul(a, b)
            took = time.perf_counter() - start
            best, spent, runs = min(best, took), spent + took, runs + 1
    finally:
        torch.set_num_threads(threads)
    return 2.0 * n**3 / best * threads


@dataclass(frozen=True)
class GpuEstimate:
    window_bytes: int
    loss_bytes: int
    layer_bytes: int  # the largest backward transient of one layer (plan.cost)
    checkpoint_bytes: int  # activations retained on the device + the reload prefetch
    parked_grad_bytes: int
    resident_bytes: int  # the GPU-resident layers (plan.cost.resident_layer_bytes)
    allocator_bytes: int
    peak_reserved_bytes: int  # what torch.cuda.max_memory_reserved would report
    needed_bytes: int  # peak + CUDA context: compared with the device total


@dataclass(frozen=True)
class StepTimeEstimate:
    flops_per_step: float  # model FLOPs x 4/3 (recompute)
    peak_flops: float | None
    peak_source: str
    efficiency: tuple[float, float]
    compute_s: tuple[float, float] | None  # at the high, then the low efficiency
    host_floor_s: float
    host_threads: int
    host_gbps: float
    host_source: str  # HostRate.source: measured on this machine, or the table's
    range_s: tuple[float, float] | None
    bound: str  # "compute" or "host (AdamW traffic)"


@dataclass(frozen=True)
class Estimate:
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
    shm_bytes: int
    offload_arena_bytes: int
    process_bytes: int  # every rank's
    compile_workers_bytes: int  # inductor's compile workers, every rank's
    cpu_working_bytes: int  # the device working set, in host RAM on CPU runs
    ram_bytes: int
    pinned_bytes: int
    gpu: GpuEstimate | None
    step: StepTimeEstimate
    machine: Machine
    # the step-time model's prediction (plan.timing; CUDA with a known peak only): step_s,
    # busy_s and exposed_s by lane, critical_path, regime
    step_model: dict[str, Any] | None = None
    # several GPUs: the model's step on each route (param/grad) that fits and the launch takes
    route_steps: dict[str, float] | None = None
    world: int = 1  # processes of the node (runtime.gpus / runtime.ranks)
    route: str = ""  # this run's param_route/grad_route

    def to_json(self) -> dict[str, Any]:
        """Every field (bytes, seconds, FLOPs as numbers), plus ``fits`` and ``shortages``."""
        short = shortages(self)
        return asdict(self) | {"fits": not short, "shortages": short}


def compile_worker_bytes(backend: str, machine: Machine) -> int:
    """Host memory of one process's inductor compile workers: they compile Triton kernels, so
    only on CUDA with the ``inductor`` backend, and none where torch compiles in one thread."""
    if machine.device != "cuda" or backend != "inductor":
        return 0
    threads = int(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", min(32, machine.cores)))
    return (threads + 1) * COMPILE_WORKER_BYTES if threads > 1 else 0


def mirror_given(cfg: TrainConfig, machine: Machine) -> bool | None:
    """Whether the store gets the BF16 mirror whatever fits (``resolve_mirror``'s first
    rules), or None where what fits decides."""
    rt = cfg.runtime
    if machine.dtype != "bfloat16":
        return False
    if rt.bf16_mirror is not None:
        return rt.bf16_mirror
    if rt.world > 1 and rt.param_route == "replicated":
        return True
    return None


def resolve_mirror(cfg: TrainConfig, adapter: HFAdapter, machine: Machine) -> bool:
    """Whether the store gets the BF16 mirror: ``runtime.bf16_mirror`` when set; unset, always
    for several ranks on the replicated route (no rank casts a layer) and otherwise where the run
    with the mirror fits ``machine`` with ``MIRROR_HEADROOM_BYTES`` of RAM to spare (the mirror
    is the faster path, casting on delivery the smaller footprint; both train bit-identically).
    Never when computing in f32."""
    rt = cfg.runtime
    given = mirror_given(cfg, machine)
    if given is not None:
        return given
    available = machine.mem_available_bytes
    if available is None:  # cannot tell: the smaller footprint
        return False
    with_mirror = replace(cfg, runtime=replace(rt, bf16_mirror=True))
    est = estimate_run(with_mirror, adapter, machine)
    return est.ram_bytes + MIRROR_HEADROOM_BYTES <= available and not shortages(est)


def plan_store(cfg: TrainConfig, adapter: HFAdapter, machine: Machine) -> dict[str, Any]:
    """The layout of the store ``Trainer`` would create on ``machine`` (same arguments), not
    allocated."""
    bf16, world = machine.dtype == "bfloat16", cfg.runtime.world
    policy = plan_policy(cfg, adapter, machine)
    return HostStore.plan(adapter.group_specs(), **store_args(policy, bf16=bf16, world=world))


def plan_policy(cfg: TrainConfig, adapter: HFAdapter, machine: Machine) -> Policy:
    """The policy ``Trainer`` would resolve on ``machine``."""
    mirror = resolve_mirror(cfg, adapter, machine)
    return resolve_policy(cfg.runtime, adapter, mirror=mirror, device=torch.device(machine.device))


def adamw_gbps(threads: int) -> float:
    """AdamW bandwidth at ``threads`` from ``ADAMW_GBPS``, measured on another machine
    (interpolated; linear beyond the table): where ``slidedp profile host`` has not run."""
    table = ADAMW_GBPS
    if threads >= table[-1][0]:
        return table[-1][1] * threads / table[-1][0]
    for (t0, g0), (t1, g1) in itertools.pairwise(table):
        if t0 <= threads <= t1:
            return g0 + (g1 - g0) * (threads - t0) / (t1 - t0)
    return table[0][1]


@dataclass(frozen=True)
class HostRate:
    """The host AdamW rate the step time takes, and where it comes from; beside a GPU, the
    probe's f32->bf16 cast under DMA too (the cast on delivery without the mirror)."""

    gbps: float
    source: str
    cast_gbps: float | None = None


def update_threads(cfg: TrainConfig, machine: Machine) -> int:
    """The update worker's threads for ``cfg`` on ``machine``, as ``Trainer`` starts it for
    one rank; with several, the node's cores (the host probe's rate is every rank's update
    together, ``engine_update_threads``)."""
    cuda = machine.device == "cuda"
    return cfg.runtime.update_threads or engine_update_threads(machine.cores, cuda)


def host_rate(threads: int, machine: Machine, *, measure: bool = False) -> HostRate:
    """The AdamW rate of ``slidedp profile host`` for ``threads`` on ``machine`` (beside its
    GPU: the rate under DMA) where it is cached, else the table's (``adamw_gbps``).
    ``measure``: probe it when it is not cached (a few seconds: ``plan``, ``runtime.policy:
    auto``); estimating alone never measures."""
    gpu = machine.gpu_name if machine.device == "cuda" else None
    report = cached_host(threads, gpu)
    if report is None and measure:
        report = probe_host(threads, torch.device(machine.device))
    if report is None:
        table = "from the table (not measured on this machine: slidedp profile host)"
        return HostRate(adamw_gbps(threads), table)
    what = "measured under DMA" if report["joint_adamw_gbps"] else "measured"
    source = f"{what} ({'cached' if report['cached'] else 'now'})"
    return HostRate(model_gbps(report), source, report.get("joint_cast_gbps"))


def _gpu_peak(name: str | None) -> tuple[float | None, str]:
    for key, flops in GPU_PEAK_FLOPS:
        if name is not None and key in name:
            return flops, f"{flops / 1e12:.0f} TFLOP/s dense bf16 ({key})"
    return None, f"unknown GPU {name!r}: no peak FLOP/s on record"


def _step_time(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, params: int, rate: HostRate
) -> StepTimeEstimate:
    b, s = cfg.train.global_batch_size, cfg.data.seq_len
    flops = model_flops_per_token(adapter.config, s) * b * s * RECOMPUTE_FACTOR
    if machine.device == "cuda":
        peak, source = _gpu_peak(machine.gpu_name)
        efficiency = GPU_EFFICIENCY
    else:
        peak = machine.cpu_flops
        source = "the CPU matmul rate was not measured"
        if peak is not None:
            source = f"{peak / 1e9:.0f} GFLOP/s torch {machine.dtype} matmul, measured now"
        efficiency = CPU_EFFICIENCY
    host = ADAMW_BYTES_PER_PARAM * params / (rate.gbps * 1e9)
    compute = (
        None if peak is None else (flops / (efficiency[1] * peak), flops / (efficiency[0] * peak))
    )
    span = None if compute is None else (max(compute[0], host), max(compute[1], host))
    bound = "compute" if compute is not None and compute[0] >= host else "host (AdamW traffic)"
    threads = update_threads(cfg, machine)
    return StepTimeEstimate(
        flops, peak, source, efficiency, compute, host, threads, rate.gbps, rate.source, span, bound
    )


def estimate_run(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, *, step_model: bool = True
) -> Estimate:
    """Every number of ``slidedp estimate`` for ``cfg`` on ``machine`` (formulas: module doc);
    ``step_model=False`` leaves out the step-time model's prediction (memory only)."""
    cuda = machine.device == "cuda"
    elem = 2 if machine.dtype == "bfloat16" else 4
    layout = plan_store(cfg, adapter, machine)
    groups = layout["groups"]
    params = sum(int(p["numel"]) for p in layout["params"])
    b, s, layers, rt = (
        cfg.train.global_batch_size,
        cfg.data.seq_len,
        adapter.num_layers,
        cfg.runtime,
    )
    rows = b // (rt.world * rt.nodes)  # a rank's share of the batch: its activations, its loss
    tokens = rows * s
    largest_layer = max(groups[adapter.layer_group(i)]["slot_len"] for i in range(layers))
    own = groups[adapter.embed_group]["slot_len"] + groups[adapter.head_group]["slot_len"]
    policy = plan_policy(cfg, adapter, machine)
    slots = rt.slots if policy.resident_layers < layers else 0  # every layer resident: none
    window = (slots * largest_layer + own) * elem
    loss = min(rt.loss_chunk_tokens, tokens) * adapter.vocab_size * 4 * LOSS_F32_COPIES
    dtype = torch.bfloat16 if elem == 2 else torch.float32
    kernels = policy.compute.kernels  # Liger's kernels save less for the backward
    acts = layout_memory(adapter, policy.layers, rows, s, dtype, kernels)
    layer = acts.transient_bytes
    checkpoints = acts.retained_bytes + acts.prefetch_bytes
    parked = params * elem if cfg.train.max_grad_norm > 0 else 0
    clipping = cfg.train.max_grad_norm > 0
    per_layer = resident_layer_bytes(adapter, dtype, clipping=clipping)
    resident = sum(per_layer[: policy.resident_layers])
    if policy.resident_embeddings:
        resident += resident_embedding_bytes(adapter, dtype, clipping=clipping)
    working = window + loss + layer + max(checkpoints, parked) + resident
    arena = acts.offloaded_bytes * rt.world  # each rank of this node pins its own
    store = int(layout["regions"]["total_bytes"])
    slot_len = int(layout["slot_len"])
    mirror = int(layout["mirror_len"]) * 2  # page-locked like the slots
    slots_bytes = slot_len * (2 * int(layout["staging_slots"]) + elem * rt.grad_slots) + mirror
    gpu = None
    if cuda:
        peak = working + ALLOCATOR_BYTES
        gpu = GpuEstimate(
            window,
            loss,
            layer,
            checkpoints,
            parked,
            resident,
            ALLOCATOR_BYTES,
            peak,
            peak + CUDA_CONTEXT_BYTES,
        )
    # every rank is a process of its own, with its own torch (and CUDA) runtime beside the one
    # shared store (BENCHMARKS.md, "Host memory, 1 rank vs 2 ranks": a second CPU rank added
    # 1.6 GiB outside the store)
    process = (CUDA_PROCESS_BYTES if cuda else CPU_PROCESS_BYTES) * rt.world
    workers = compile_worker_bytes(policy.compute.compile, machine) * rt.world
    cpu_working = 0 if cuda else working * rt.world  # CPU ranks: each its own, in host RAM
    rate = host_rate(update_threads(cfg, machine), machine)
    return Estimate(
        model=f"{adapter.config.model_type} ({cfg.model.path})",
        params=params,
        layers=layers,
        device=machine.device,
        dtype=machine.dtype,
        batch=b,
        seq_len=s,
        layout=policy.layout,
        layout_rows=_layout_rows(adapter, policy.layers, rows, s, dtype, kernels),
        resident_layers=policy.resident_layers,
        resident_embeddings=policy.resident_embeddings,
        resident_bytes=resident,
        clipping=clipping,
        store_bytes=store,
        mirror_bytes=mirror,
        shm_bytes=store,
        offload_arena_bytes=arena,
        process_bytes=process,
        compile_workers_bytes=workers,
        cpu_working_bytes=cpu_working,
        ram_bytes=store + arena + process + workers + cpu_working,
        pinned_bytes=slots_bytes + arena if cuda else 0,
        gpu=gpu,
        step=_step_time(cfg, adapter, machine, params, rate),
        machine=machine,
        step_model=_step_model(cfg, adapter, machine, policy, dtype, rate) if step_model else None,
        route_steps=_route_steps(cfg, adapter, machine, rate) if step_model else None,
        world=rt.world,
        route=f"{rt.param_route}/{rt.grad_route}",
    )


def _route_steps(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, rate: HostRate
) -> dict[str, float] | None:
    """Several GPUs: the model's step on each route (``param/grad``) that the launch accepts
    and ``machine`` holds, as ``runtime.policy: auto`` predicts them (``plan.route_choice``),
    with the rates of ``_step_model``."""
    from slidedp.plan.auto import profile_args
    from slidedp.plan.route_choice import ROUTES, route_name, route_steps
    from slidedp.profile.layer import cached_profile

    peak, _ = _gpu_peak(machine.gpu_name)
    if cfg.runtime.world == 1 or machine.device != "cuda" or peak is None:
        return None
    report = cached_profile(profile_args(cfg))
    links, _ = _links(cfg.runtime.world, adapter, machine)
    steps = route_steps(cfg, adapter, machine, list(ROUTES), links=links, adamw_gbps=rate.gbps,
                        cast_gbps=rate.cast_gbps, peak_flops=peak,
                        measured=layer_times(report) if report else {})  # fmt: skip
    return {route_name(r): s for r, s in steps.items()}


@dataclass(frozen=True)
class Longest:
    seq_len: int  # 0: not even one step of ``step_tokens`` fits
    limit: str  # what the next longer sequence lacks, or the model's position limit


def longest_sequence(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, step_tokens: int = 1024
) -> Longest:
    """The longest ``data.seq_len``, a multiple of ``step_tokens`` up to the model's
    ``max_position_embeddings``, at which the run (its batch, layout, clipping) fits
    ``machine``: a bisection over the estimate, whose memory grows with the sequence."""

    def short(tokens: int) -> list[str]:
        data = replace(cfg.data, seq_len=tokens)
        est = estimate_run(replace(cfg, data=data), adapter, machine, step_model=False)
        return shortages(est)

    cap = getattr(adapter.config, "max_position_embeddings", None) or 2**22
    lo, hi = 0, cap // step_tokens  # lo fits (0: trivially), hi + 1 is past the cap
    if not short(hi * step_tokens):
        return Longest(hi * step_tokens, f"the model's max_position_embeddings {cap:,}")
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not short(mid * step_tokens) else (lo, mid)
    return Longest(
        lo * step_tokens, f"{hi * step_tokens:,} tokens: " + "; ".join(short(hi * step_tokens))
    )


def _step_model(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    policy: Policy,
    dtype: torch.dtype,
    rate: HostRate,
) -> dict[str, Any] | None:
    """The step-time model's prediction with ``plan.timing``'s rates (uncalibrated: FLOPs at
    the measured layer efficiency, PCIe ceilings), AdamW at ``rate``, the layers' times taken
    from the layer profile where this run's is cached (``slidedp profile layer``, ``plan`` or
    ``runtime.policy: auto`` measured it on this GPU). ``calibration`` says which."""
    from slidedp.plan.auto import profile_args
    from slidedp.profile.layer import cached_profile

    peak, _ = _gpu_peak(machine.gpu_name)
    if machine.device != "cuda" or peak is None:
        return None
    report = cached_profile(profile_args(cfg))
    measured = layer_times(report) if report else {}
    rt = cfg.runtime
    b, s = cfg.train.global_batch_size // rt.world, cfg.data.seq_len  # per rank
    offloaded = [
        layer_footprint(adapter, p, b, s, dtype, i, policy.compute.kernels).offloaded_bytes
        for i, p in enumerate(policy.layers)
    ]
    links, links_measured = _links(rt.world, adapter, machine)
    spec = spec_from_shapes(
        adapter,
        policy,
        batch=b,
        seq_len=s,
        peak_flops=peak,
        adamw_gbps=rate.gbps,
        cast_gbps=rate.cast_gbps or CAST_GBPS,
        clipping=cfg.train.max_grad_norm > 0,
        offloaded_bytes=offloaded,
        measured=measured,
        ranks=Ranks(rt.world, rt.grad_route, rt.param_route),
        links=links,
    )
    covered = sum(str(p) in measured for p in policy.layers)
    measured_parts = [f"layer profile: {covered} of {len(policy.layers)} layers"] * bool(covered)
    if rate.source.startswith("measured"):
        measured_parts.append(f"host AdamW {rate.source}")
    measured_parts += links_measured
    calibration = ", ".join(measured_parts) or "uncalibrated rates"
    return predict_step(spec) | {"calibration": calibration}


def _links(world: int, adapter: HFAdapter, machine: Machine) -> tuple[Links, list[str]]:
    """Several GPUs: the layer-sized reduce and all-gather between ``world`` GPUs where
    ``profile.links`` cached them (the rates ``runtime.policy: auto`` predicts the routes
    with), and what was measured, for the calibration line; else, and always for the copies,
    ``plan.timing``'s assumptions (the PCIe ceilings: the host probe's joint copy rates are
    paced by its AdamW passes, not a copy engine's capacity)."""
    from slidedp.plan.measure import layer_numel
    from slidedp.profile.links import cached_links

    probe = None
    if world > 1 and machine.gpu_name is not None:
        probe = cached_links(world, machine.gpu_name, layer_numel(adapter))
    if probe is None:
        return Links(), []
    links = Links(reduce_gbps=probe["reduce_gbps"], gather_gbps=probe["gather_gbps"],
                  source="measured")  # fmt: skip
    return links, ["reduce and all_gather between the GPUs (cached)"]


def _layout_rows(
    adapter: HFAdapter,
    layers: tuple[LayerPolicy, ...],
    b: int,
    s: int,
    dtype: torch.dtype,
    kernels: str,
) -> list[dict[str, Any]]:
    counts: dict[tuple[LayerPolicy, int], int] = {}  # (policy, kind of layer): layers
    for i, p in enumerate(layers):
        key = (p, adapter.layer_kinds[i])
        counts[key] = counts.get(key, 0) + 1
    several_kinds = len(set(adapter.layer_kinds)) > 1
    rows = []
    for (p, kind), n in counts.items():
        fp = layer_footprint(adapter, p, b, s, dtype, kind, kernels)
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


def _resident_what(est: Estimate) -> str:
    what = f"{est.resident_layers} resident layers"
    return what + " and the embeddings" if est.resident_embeddings else what


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def shortages(est: Estimate) -> list[str]:
    """One clause per resource the machine lacks: what is needed and what there is."""
    m, short = est.machine, []
    if est.shm_bytes > m.shm_free_bytes:
        short.append(f"/dev/shm {_gib(est.shm_bytes)} needed, {_gib(m.shm_free_bytes)} free")
    if m.mem_available_bytes is not None and est.ram_bytes > m.mem_available_bytes:
        short.append(
            f"host RAM {_gib(est.ram_bytes)} needed, {_gib(m.mem_available_bytes)} available"
        )
    gpu = est.gpu
    if gpu is not None and m.gpu_total_bytes is not None and gpu.needed_bytes > m.gpu_total_bytes:
        short.append(f"GPU {_gib(gpu.needed_bytes)} needed, {_gib(m.gpu_total_bytes)} total")
    return short


def check_fits(est: Estimate) -> None:
    """Raise one line with the numbers when the machine cannot hold the run: host shortages as
    ``OutOfSharedMemoryError`` (the first one's bytes as attributes), else the GPU's as
    ``OutOfDeviceMemoryError``."""
    short = shortages(est)
    if not short:
        return
    host = [c for c in short if not c.startswith("GPU")]
    fixes = []
    if host:
        fixes.append(
            "enlarge it (e.g. `mount -o remount,size=... /dev/shm`), free memory, or train a "
            "smaller model"
        )
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
        shm_short = est.shm_bytes > m.shm_free_bytes
        error.needed_bytes = est.shm_bytes if shm_short else est.ram_bytes
        error.available_bytes = m.shm_free_bytes if shm_short else m.mem_available_bytes or 0
    else:
        assert est.gpu is not None
        assert m.gpu_total_bytes is not None
        error = OutOfDeviceMemoryError(message)
        error.needed_bytes, error.available_bytes = est.gpu.needed_bytes, m.gpu_total_bytes
    raise error


def format_estimate(est: Estimate) -> str:
    """The human table of ``slidedp estimate``."""
    m, rows = est.machine, []

    def row(what: str, needed: str, have: str = "") -> None:
        rows.append(f"  {what:<34} {needed:>12}  {have}")

    row("/dev/shm (host store)", _gib(est.shm_bytes), f"{_gib(m.shm_free_bytes)} free")
    row("host RAM", _gib(est.ram_bytes), f"{_gib(m.mem_available_bytes)} available")
    row("  store", _gib(est.store_bytes))
    if est.mirror_bytes:
        row("    of which the BF16 mirror", _gib(est.mirror_bytes), "runtime.bf16_mirror")
    if est.offload_arena_bytes:
        row("  activation offload arenas", _gib(est.offload_arena_bytes), "pinned")
    ranks = f", {est.world} processes" if est.world > 1 else ""
    runtime = "torch + CUDA" if est.gpu else "torch"
    row(f"  process ({runtime}{ranks})", _gib(est.process_bytes))
    if est.compile_workers_bytes:
        row("  compile workers (inductor)", _gib(est.compile_workers_bytes), "runtime.compile")
    if est.cpu_working_bytes:
        row("  compute working set (CPU)", _gib(est.cpu_working_bytes))
        if est.resident_bytes:
            row(f"    of which {_resident_what(est)}", _gib(est.resident_bytes))
    if est.gpu is not None:
        g = est.gpu
        row("pinned host memory", _gib(est.pinned_bytes))
        row(
            "GPU (peak reserved + context)",
            _gib(g.needed_bytes),
            f"{_gib(m.gpu_total_bytes)} total",
        )
        for what, n in (
            ("window (slots, embed, head)", g.window_bytes),
            ("chunked loss", g.loss_bytes),
            ("one layer's backward (largest)", g.layer_bytes),
            ("retained activations + prefetch", g.checkpoint_bytes),
            ("parked gradients (clipping)", g.parked_grad_bytes),
            (f"GPU-resident: {_resident_what(est)}", g.resident_bytes),
            ("allocator", g.allocator_bytes),
            ("CUDA context", g.needed_bytes - g.peak_reserved_bytes),
        ):
            if n:
                row(f"  {what}", _gib(n))
    st = est.step
    lo, hi = st.efficiency
    if st.range_s is None:
        row("step time", "?", st.peak_source)
    else:
        row("step time", f"{st.range_s[0]:.2f}-{st.range_s[1]:.2f} s", f"bound: {st.bound}")
    if st.compute_s is not None:
        row(
            "  compute",
            f"{st.compute_s[0]:.2f}-{st.compute_s[1]:.2f} s",
            f"{st.flops_per_step / 1e12:.2f} TFLOP at {lo:.0%}-{hi:.0%} of {st.peak_source}",
        )
    if est.step_model is not None:
        m_ = est.step_model
        exposed = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in m_["exposed_s"].items())
        row(f"  model ({m_['calibration']})", f"{m_['step_s']:.2f} s", f"{m_['regime']}")
        if exposed:
            row("    compute waits for", "", exposed)
    if est.route_steps:
        gpus = f"{est.world} GPUs" + (
            f", a prediction: this machine has {m.gpu_count}" if est.world > m.gpu_count else ""
        )
        row(f"  model on each route ({gpus})", "", "runtime.param_route/grad_route")
        for route, step_s in est.route_steps.items():
            chosen = " (this run's)" if route == est.route else ""
            row(f"    {route}{chosen}", f"{step_s:.2f} s")
    row(
        "  host AdamW floor",
        f"{st.host_floor_s:.2f} s",
        f"28 B/param at {st.host_gbps:.0f} GB/s ({st.host_threads} threads), {st.host_source}",
    )
    head = (
        f"slidedp estimate: {est.model}, {est.params:,} parameters, {est.layers} layers; "
        f"{est.device} {est.dtype}, B={est.batch} x S={est.seq_len}, layers {est.layout}, "
        f"{est.resident_layers} resident, clipping {'on' if est.clipping else 'off'} "
        "(an estimate; nothing allocated)"
    )
    rows.append(
        f"  activation layout, per layer: {'retained':>10} {'offloaded':>10} {'backward':>10}"
    )
    for r in est.layout_rows:
        rows.append(
            f"    {r['layers']:>3} x {r['policy']:<22} {_gib(r['retained_bytes']):>10} "
            f"{_gib(r['offloaded_bytes']):>10} {_gib(r['transient_bytes']):>10}"
        )
    verdict = shortages(est)
    tail = "fits this machine" if not verdict else "DOES NOT FIT: " + "; ".join(verdict)
    return "\n".join([head, f"  {'':<34} {'needed':>12}  this machine", *rows, f"  {tail}"])
