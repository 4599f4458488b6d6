"""The policy selector's layout stage (paper §3.6, Algorithm 1): from the layer profile's
Pareto candidates and the GPU budget, the integer program (``slidedp_core::solve``, through
``_native.solve_layout``) picks how many layers get each candidate, ``plan.layout.place``
orders them (layers of several kinds, ``HFAdapter.layer_kinds``: each kind's own candidates on
its own layers, ``place_by_kind``), and the step-time model and the memory estimate check the
result against the fixed default (all ``F``), which is always a candidate of every kind.

Example::

    report = profile_layer(args)                   # measured or cached
    choice = select_layout(cfg, adapter, machine, report)
    print(choice.layout, choice.solution.step_s)
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from slidedp.autopolicy.program import Candidate, HostLane, Kind, Layout, Problem, Resident, solve
from slidedp.errors import ConfigError, InvalidArgumentError
from slidedp.estimate_report import estimate_run
from slidedp.models.shape import layer_shapes
from slidedp.plan.cost import ResidentTerms, resident_terms
from slidedp.plan.device import pick_dtype
from slidedp.plan.layout import LayerPolicy, format_layout, parse_entry, place_by_kind
from slidedp.plan.machine import HostRate, gpu_peak
from slidedp.plan.policy import resident_text, resolve_policy
from slidedp.plan.predict import Shape, host_rates, links_for
from slidedp.plan.resolve import MIRROR_HEADROOM_BYTES, mirror_given
from slidedp.plan.timing import (
    ADAMW_BYTES_PER_PARAM,
    D2H_GBPS,
    H2D_GBPS,
    NVLINK_GBPS,
    Links,
    Ranks,
    compute_times,
    context_extra_s,
    layer_times,
    step_update_gbps,
)
from slidedp.plan.update_lanes import owner_lane_gbps
from slidedp.profile.pareto import layer_time, memory

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from slidedp.config import TrainConfig
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.plan.machine import Machine

# measured on the H100 (benchmarks/2026-11-23-activation-layouts-h100.md, section "Elastic
# Checkpointing: per-layer layouts on one GPU"): a clipped layout keeping 55 GiB of activations
# reserved 6% more than the estimate (the allocator does not reuse every block freed by the parked
# gradients); the budget keeps that share free
HEADROOM = 0.06
DEFAULT = LayerPolicy("F")
# MemAvailable may shrink between the plan and the store's allocation (the profile's and the
# solver's own process memory): the offload arena keeps this much of it unplanned, so the run
# still gets the BF16 mirror the plan counted on
HOST_SLACK_BYTES = 2**30
# a layout leaves the default only when predicted this much faster: on the H100
# (benchmarks/2026-11-24-autopolicy-h100.md) predicted gains of 9% and 20% measured 0.99x and 0.97x
# where the host update bound the step, and a layout spends GPU memory the default leaves free
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Choice:
    layout: str  # runtime.layers' text form, placed
    layers: tuple[LayerPolicy, ...]
    budget_bytes: int  # device bytes the layout's activations may use
    problem: Problem  # the integer program, as solved
    solution: Layout
    default: Layout  # the fixed default's accounting in the same program
    default_fits: bool  # whether the fixed default fits the budget
    program_layout: str = ""  # the program's own layout, placed, and its resident layers
    resident_layers: int = 0  # runtime.resident_layers: the first ones stay on the GPU
    resident_embeddings: bool = False  # runtime.resident_embeddings: so do embedding and head
    kept_default: bool = False  # the program's layout was not MIN_GAIN faster: all F instead

    @property
    def resident_text(self) -> str:
        return resident_text(self.resident_layers, self.resident_embeddings)

    @property
    def gain(self) -> float:
        """The program's layout's predicted speed over the default's."""
        return self.default.step_s / self.solution.step_s


# the program's candidates with their kind of layer (its first layer's index) and policy
Candidates = list[tuple[int, LayerPolicy, Candidate]]


def profile_candidates(
    report: dict[str, Any], times_s: Mapping[LayerPolicy, float] | None = None
) -> Candidates:
    """The Pareto-efficient candidates of a ``slidedp profile layer`` report, plus ``F-r0``
    (the fixed default), of each kind of layer (its first layer's index, first), as the
    program's ``Candidate`` records (their ``kind`` set by ``select_layout``). ``times_s``:
    layer times that replace the profile's (``autopolicy.calibrate``'s, of one kind of layer)."""
    kinds = sorted(int(k) for k in report.get("kinds") or {"0": 1})
    out: dict[tuple[int, LayerPolicy], Candidate] = {}
    for c in report["candidates"]:
        _, policy = parse_entry(c["policy"], 0.0)
        kind = int(c.get("kind", 0))
        if not (c["pareto"] or policy == DEFAULT):
            continue
        # the larger of the measured and the cost model's bytes: the estimate that checks
        # the run counts the cost model's, the device holds the measured ones
        transient = max(c["transient_bytes"] or 0, c["estimated_transient_bytes"])
        out[kind, policy] = Candidate(
            name=str(policy) if len(kinds) == 1 else f"layer {kind}: {policy}",
            time_s=(times_s or {}).get(policy, layer_time(c)),
            forward_s=max(float(c["forward_s"]), float(c["reload_s"])),
            retained_bytes=float(max(memory(c), c["estimated_retained_bytes"])),
            offloaded_bytes=float(max(c["offloaded_bytes"], c["estimated_offloaded_bytes"])),
            transient_bytes=float(transient),
        )
    missing = [k for k in kinds if (k, DEFAULT) not in out]
    if missing:
        raise ConfigError(
            f"the layer profile has no F-r0 row (the fixed default) for layer {missing[0]}'s "
            "kind: re-profile"
        )
    return [(k, p, c) for (k, p), c in sorted(out.items(), key=lambda kv: kv[0][0])]


def context_candidates(
    cands: Candidates, cfg: TrainConfig, adapter: HFAdapter, machine: Machine
) -> Candidates:
    """``cands`` of a ``runtime.context_parallel: R`` run (R > 1; else as they are), offloaded
    ones too (a rank offloads its shard's saved tensors), each one's times with
    what the profile of the rank's shard (``profile_spec``) leaves out: attention over the
    whole sequence and the exchanges (``plan.timing.context_extra_s``; the link probe's
    all_gather rate where cached, else the node's assumed NVLink), so the program prices
    them and sees each shard's activation bytes."""
    launch = cfg.runtime.launch
    r = launch.context_parallel
    if r == 1:
        return cands
    peak = gpu_peak(machine.gpu_name)[0] or machine.cpu_flops
    if peak is None:
        raise ConfigError(
            f"runtime.policy=auto with runtime.context_parallel={r}: no FLOP rate is known for "
            f"this device ({machine.gpu_name}) to price attention over the whole sequence; set "
            "runtime.policy=fixed"
        )
    gbps = (links_for(launch.world, adapter, machine) or Links()).gather_gbps
    shapes = layer_shapes(adapter.config, cfg.data.seq_len)
    rows = cfg.train.global_batch_size // launch.data_world
    shape = Shape.of_run(cfg, adapter)
    ranks = Ranks(launch.world, context=r, scheme=shape.scheme)
    out = []
    for kind, policy, c in cands:
        forward_s, time_s = context_extra_s(shapes[kind], policy, rows=rows,
                                            seq_len=cfg.data.seq_len, ranks=ranks,
                                            peak_flops=peak, gbps=gbps)  # fmt: skip
        out.append((kind, policy, replace(c, time_s=c.time_s + time_s,
                                          forward_s=c.forward_s + forward_s)))  # fmt: skip
    return out


def all_f(rt: RuntimeSection) -> RuntimeSection:
    """``rt`` with the fixed default's policy: every layer ``F``, nothing offloaded, nothing
    GPU-resident."""
    return rt.with_keys(layers="F", offload_ratio=0.0, policy="", resident_layers=0,
                   resident_embeddings=False)  # fmt: skip


@dataclass(frozen=True)
class Budget:
    bytes: int  # device bytes for the activations (retained, prefetch pool, transient)
    parked_bytes: int  # the parked gradients of a clipped step, beside the transient


def activation_budget(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, total_bytes: int
) -> Budget:
    """Device bytes left for activations: ``total_bytes`` less what no layout changes (the
    window, the chunked loss, the allocator's reserve, the CUDA context: ``estimate``'s terms
    for the same run), less ``HEADROOM``; and the parked gradients, which take the retained
    activations' place once the clipped backward has freed them."""

    probe = replace(machine, device="cuda", gpu_total_bytes=total_bytes)
    gpu = estimate_run(replace(cfg, runtime=all_f(cfg.runtime)), adapter, probe,
                       step_model=False).gpu  # fmt: skip
    assert gpu is not None
    fixed = gpu.needed_bytes - gpu.layer_bytes - max(gpu.checkpoint_bytes, gpu.parked_grad_bytes)
    if fixed >= total_bytes:
        raise ConfigError(
            f"the window, the loss and the CUDA context alone need {fixed / 2**30:.2f} GiB of "
            f"the GPU's {total_bytes / 2**30:.2f} GiB: no activation layout fits"
        )
    return Budget(int((total_bytes - fixed) * (1.0 - HEADROOM)), gpu.parked_grad_bytes)


def offload_host_budget(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, *, mirror: bool = True
) -> float | None:
    """Host bytes one process's offloaded activations may pin (the offload arena): what
    MemAvailable leaves after the run with the all-F layout (``estimate``: the store, the
    process) with its BF16 mirror and the mirror's headroom (``MIRROR_HEADROOM_BYTES``) where
    the mirror is decided by what fits the host and it fits there, less ``HOST_SLACK_BYTES``;
    shared by the node's ranks (on several, for the config's routes). An arena that took the
    mirror's room would cost more than it saves: without the mirror every streamed layer is
    cast on the host before its H2D (1.39 s a step on Qwen3-8B, B=16:
    benchmarks/2026-11-25-autopolicy-h100.md, section "The targets re-measured").
    ``mirror=False``: the budget without the mirror's room (where no layout fits beside it).
    None on CPU (activations are in host memory, in the device budget) or where MemAvailable
    is unknown."""

    available = machine.mem_available_bytes
    if machine.device != "cuda" or available is None:
        return None
    rt = all_f(cfg.runtime)
    given = mirror_given(replace(cfg, runtime=rt), machine)

    def spare(with_mirror: bool, headroom: int) -> float:
        run = replace(cfg, runtime=rt.with_keys(bf16_mirror=with_mirror))
        ram = estimate_run(run, adapter, machine, step_model=False).ram_bytes
        return (available - ram - headroom - HOST_SLACK_BYTES) / cfg.runtime.launch.world

    if given is not None:
        return max(0.0, spare(given, 0))
    if mirror and (kept := spare(True, MIRROR_HEADROOM_BYTES)) >= 0:
        return kept
    return max(0.0, spare(False, 0))


def program_update_gbps(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, host: HostRate, report: dict[str, Any]
) -> float:
    """The host AdamW rate the program prices every candidate's update at, the fixed
    default's included: the step-time model's for the default run of ``cfg`` (``base``) with
    the profile's layer times (``plan.timing.step_update_gbps``: under the copies for the
    share of the update the ranks' copies overlap, alone for the rest). The default's share
    for every candidate: a candidate's own depends on the counts the program picks (its
    resident layers copy nothing, its offloaded activations copy more), circular inside the
    program. ``host.gbps`` where the probe has no rate alone (CPU, the table) or the GPU no
    peak on record to time the step's compute. Several ranks: every owner's lane together
    (R x ``plan.update_lanes.owner_lane_gbps``: the program's one host lane stands for them)."""
    ranks = Shape.of_run(cfg, adapter).world
    node_gbps = _node_update_gbps(cfg, adapter, machine, host, report)
    return ranks * owner_lane_gbps(node_gbps, ranks, host.pool_gbps, host.alone_gbps)


def _node_update_gbps(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, host: HostRate, report: dict[str, Any]
) -> float:
    """``program_update_gbps``'s node rate: the blend for the default run, else ``host.gbps``."""
    peak, _ = gpu_peak(machine.gpu_name)
    if host.alone_gbps is None or peak is None:
        return host.gbps
    shape = Shape.of_run(cfg, adapter)
    links = links_for(shape.world, adapter, machine) or Links()
    rates = host_rates(peak, host, links, layer_times(report))
    # the mirror changes no copy the share counts
    policy = resolve_policy(all_f(cfg.runtime), adapter, mirror=True, device=torch.device("cuda"))
    ranks = Ranks(shape.world, policy.grad_route, policy.param_route, shape.context, shape.scheme)
    forward, backward, head = compute_times(
        adapter, policy, batch=shape.rows, seq_len=shape.seq_len, rates=rates, ranks=ranks
    )
    compute_s = sum(forward) + sum(backward) + head
    return step_update_gbps(adapter, policy, rates, ranks, [0] * adapter.num_layers, compute_s)


def host_update_s_per_layer(adapter: HFAdapter, gbps: float) -> float:
    """A decoder layer's host AdamW pass at ``gbps`` (the kernel's measured bandwidth), the
    mean over the layers: the program counts it once per layer."""
    layers = range(adapter.num_layers)
    params = sum(p.numel() for i in layers for p in adapter.layer_module(i).parameters())
    return ADAMW_BYTES_PER_PARAM * params / adapter.num_layers / (gbps * 1e9)


def host_update_s_of_layer(adapter: HFAdapter, layer: int, gbps: float) -> float:
    """Decoder layer ``layer``'s host AdamW pass at ``gbps``."""
    params = sum(p.numel() for p in adapter.layer_module(layer).parameters())
    return ADAMW_BYTES_PER_PARAM * params / (gbps * 1e9)


def program_kinds(adapter: HFAdapter, report: dict[str, Any], gbps: float) -> tuple[Kind, ...]:
    """The program's ``Kind`` records (none for one kind of layer), in the order of
    ``profile_candidates``; the profile must be of the model's own kinds."""
    layers = collections.Counter(adapter.layer_kinds)
    profiled = sorted(int(k) for k in report.get("kinds") or {"0": 1})
    if profiled != sorted(layers):
        raise ConfigError(
            f"the layer profile measured the kinds of layers {profiled}, the model's are of "
            f"layers {sorted(layers)}: profile this model (slidedp profile layer)"
        )
    if len(layers) == 1:
        return ()
    return tuple(Kind(name=f"layer {k}", layers=layers[k],
                      update_s_per_layer=host_update_s_of_layer(adapter, k, gbps))
                 for k in profiled)  # fmt: skip


def host_tail_s(adapter: HFAdapter, gbps: float, dtype: torch.dtype) -> float:
    """What ends every step on the host's side while the embedding and head are streamed: the
    embedding's gradient copied out after the last backward (the head's leaves during it), the
    two groups' host AdamW pass at ``gbps``, and the embedding's weights copied in before the
    next forward, which starts with them; the copies in ``dtype`` at the PCIe ceilings
    (``plan.timing``). On the H100, Qwen3-4B B=16 with every layer resident: 15 ms D2H, 77 ms
    AdamW, 14 ms H2D (benchmarks/2026-11-24-autopolicy-h100.md)."""
    specs = adapter.group_specs()
    params = specs[adapter.embed_group].numel + specs[adapter.head_group].numel
    copied = specs[adapter.embed_group].numel * dtype.itemsize
    update_s = ADAMW_BYTES_PER_PARAM * params / (gbps * 1e9)
    return update_s + copied / (D2H_GBPS * 1e9) + copied / (H2D_GBPS * 1e9)


def with_resident_embeddings(
    problem: Problem, embedding_bytes: int, embedding_update_s: float
) -> Problem:
    """``problem`` with the embedding and head GPU-resident: their bytes off the budget, their
    host update (the lane's tail after the backward) off the host lane, and their device
    update (``embedding_update_s``) on the compute lane."""
    assert problem.host is not None  # select_layout's programs always have their host lane
    budget = max(0.0, problem.budget_bytes - embedding_bytes)
    fixed = problem.fixed_s + embedding_update_s
    return replace(problem, budget_bytes=budget, host=replace(problem.host, tail_s=0.0),
                   fixed_s=fixed)  # fmt: skip


def solve_residency(
    problem: Problem, embedding_bytes: int, embedding_update_s: float
) -> tuple[Problem, Layout, bool]:
    """The faster of ``problem`` solved as it is and with resident embeddings (``problem``
    must have its ``resident`` term): (the problem solved, its solution, whether the embeddings
    are resident). Where they leave no layout room, the embeddings stay on the host."""
    solution = solve(problem)
    alternative = with_resident_embeddings(problem, embedding_bytes, embedding_update_s)
    try:
        resident = solve(alternative)
    except InvalidArgumentError:  # no layout fits beside them
        return problem, solution, False
    if resident.step_s < solution.step_s:
        return alternative, resident, True
    return problem, solution, False


def _solved(problem: Problem, terms: ResidentTerms | None) -> tuple[Problem, Layout, bool]:
    """``problem`` solved, with ``terms`` (resident embeddings allowed) the faster of it and
    resident embeddings (``solve_residency``): (the problem solved, its solution, whether the
    embeddings are resident)."""
    if terms is None:
        return problem, solve(problem), False
    return solve_residency(problem, terms.embedding_bytes, terms.embedding_update_s)


def _default_accounting(
    problem: Problem, cands: Candidates, index: dict[int, int], adapter: HFAdapter
) -> Layout:
    """The fixed default's accounting in the same program, within its own bytes (it may not
    fit the budget), its counts of the program's candidates; a finite bound keeps the
    program well scaled."""
    per_kind = collections.Counter(adapter.layer_kinds)
    fs = tuple(replace(c, kind=index[k]) for k, p, c in cands if p == DEFAULT)
    own = (sum(per_kind[k] * f.retained_bytes for k, f in zip(index, fs, strict=True))
           + max(2 * f.offloaded_bytes + f.transient_bytes for f in fs))  # fmt: skip
    default = solve(replace(problem, candidates=fs, resident=None, budget_bytes=own + 2**30,
                            parked_bytes=0.0))  # fmt: skip
    return replace(default, counts=tuple(per_kind[k] if p == DEFAULT else 0 for k, p, _ in cands))


class _SolveBounds(TypedDict):
    total_bytes: int  # the device memory the layout plans for
    update_gbps: float  # the host AdamW rate


class SolveTerms(_SolveBounds, total=False):
    """``select_layout``'s keywords: the device memory and the host rate (required), whether
    layers (``resident``, default True) and the embeddings (``embeddings``, default True) may
    stay GPU-resident (``ranks``: the node's GPUs sharing their state, default 1), a cut of
    the activations' budget in bytes (``budget_cut_bytes``, default 0) and calibrated layer
    times (``times_s``, default None: the profile's)."""

    resident: bool
    embeddings: bool
    ranks: int
    budget_cut_bytes: int
    times_s: Mapping[LayerPolicy, float] | None


def select_layout(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    report: dict[str, Any],
    **terms: Unpack[SolveTerms],
) -> Choice:
    """The fastest placed layout of the profile's candidates within ``total_bytes`` of device
    memory, the host update at ``update_gbps`` counted (after the backward with clipping), and
    with ``resident`` how many layers stay GPU-resident (their memory against the same budget,
    their update off the host lane), and with ``embeddings`` too whether the embedding and head
    do (``solve_residency``); the offloaded activations within ``offload_host_budget``.
    ``budget_cut_bytes``: taken off the activations' budget (``validate``'s feedback: what
    a validated choice reserved beyond the device).
    ``times_s``: calibrated layer times (``autopolicy.calibrate``) in the profile's place."""
    total_bytes, update_gbps = terms["total_bytes"], terms["update_gbps"]
    resident, embeddings = terms.get("resident", True), terms.get("embeddings", True)
    budget_cut_bytes, times_s = terms.get("budget_cut_bytes", 0), terms.get("times_s")
    cands = context_candidates(profile_candidates(report, times_s), cfg, adapter, machine)
    kinds = program_kinds(adapter, report, update_gbps)
    index = {k: i for i, k in enumerate(sorted({k for k, _, _ in cands}))}
    budget = activation_budget(cfg, adapter, machine, total_bytes)
    if budget_cut_bytes:
        budget = replace(budget, bytes=max(0, budget.bytes - budget_cut_bytes))
    clipping = cfg.train.max_grad_norm > 0
    dtype = pick_dtype(cfg.train.dtype, torch.device("cuda"))
    problem = Problem(
        layers=adapter.num_layers,
        budget_bytes=float(budget.bytes),
        parked_bytes=float(budget.parked_bytes),
        candidates=tuple(replace(c, kind=index[k]) for k, _, c in cands),
        host=HostLane(
            update_s_per_layer=host_update_s_per_layer(adapter, update_gbps),
            serial=clipping,
            tail_s=host_tail_s(adapter, update_gbps, dtype),
        ),
        kinds=kinds,
        host_budget_bytes=offload_host_budget(cfg, adapter, machine),
    )
    kept = None
    if resident:  # several ranks: the owners' share, and one layer's state in reserve
        kept = resident_terms(adapter, dtype, clipping=clipping, ranks=terms.get("ranks", 1),
                              gather_gbps=NVLINK_GBPS)  # fmt: skip
        problem = replace(
            problem,
            budget_bytes=max(0.0, problem.budget_bytes - kept.reserve_bytes),
            resident=Resident(bytes_per_layer=float(kept.bytes_per_layer),
                              max_layers=adapter.num_layers,
                              update_s_per_layer=kept.update_s_per_layer),
        )  # fmt: skip
    ends = kept if embeddings else None
    try:
        solved, solution, on_gpu = _solved(problem, ends)
    except InvalidArgumentError:
        if problem.host_budget_bytes is None:
            raise
        # no layout fits the device without offloading more than the mirror leaves room for:
        # the arena takes that room, and the run goes without the mirror (resolve_mirror)
        without = offload_host_budget(cfg, adapter, machine, mirror=False)
        problem = replace(problem, host_budget_bytes=without)
        solved, solution, on_gpu = _solved(problem, ends)
    counts = [(k, p, int(n)) for (k, p, _), n in zip(cands, solution.counts, strict=True)]
    retained = {(k, p): int(c.retained_bytes) for k, p, c in cands}
    layers = place_by_kind(counts, retained, adapter.layer_kinds)
    default = _default_accounting(problem, cands, index, adapter)
    fits = default.memory_bytes <= budget.bytes
    layout = format_layout(layers)
    program = f"{layout}, {resident_text(solution.resident_layers, on_gpu)}"
    choice = Choice(layout, layers, int(solved.budget_bytes), solved, solution, default, fits,
                    program, resident_layers=solution.resident_layers,
                    resident_embeddings=on_gpu)  # fmt: skip
    all_f = (DEFAULT,) * adapter.num_layers
    if (
        (layers, choice.resident_layers, on_gpu) != (all_f, 0, False)
        and fits
        and (choice.gain < 1 + MIN_GAIN)
    ):
        return replace(choice, layout=format_layout(all_f), layers=all_f, resident_layers=0,
                       resident_embeddings=False, kept_default=True)  # fmt: skip
    return choice
