"""The report of ``slidedp estimate CONFIG.yaml [section.key=value ...] [--json]``: the memory
of the run's plan (``estimate.estimate_memory``), its step time (a FLOP range, and the
step-time model's prediction where the GPU's rates are known: ``plan.predict``), the routes of
several GPUs, and the longest sequence that fits. The range's formula and the runs it was
checked against: ``python/slidedp/ESTIMATE.md``, section "Step time".

Invariant: nothing is measured here (a CPU's matmul rate comes with ``Machine.probe``).

Example::

    est = estimate_run(cfg, adapter, Machine.probe(cfg))
    print(format_estimate(est))
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from slidedp.config import TrainConfig
from slidedp.estimate import MemoryEstimate, estimate_memory, gib, shortages
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import HostRate, Machine, gpu_peak, host_rate, update_threads
from slidedp.plan.predict import (
    ROUTES,
    CalibratedPrediction,
    Shape,
    predict,
    rates_for,
    route_name,
    route_steps,
)
from slidedp.plan.resolve import resolve_plan
from slidedp.plan.timing import ADAMW_BYTES_PER_PARAM
from slidedp.runtime.flops import model_flops_per_token

RECOMPUTE_FACTOR = 4 / 3  # the recompute forward of full-layer checkpointing
# this engine's measured utilization on H100 to a compute-bound run
# (benchmarks/2026-11-22-one-gpu-engine.md)
GPU_EFFICIENCY = (0.15, 0.50)
CPU_EFFICIENCY = (0.25, 0.90)


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
class Estimate(MemoryEstimate):
    """The memory of the run's plan, its step time (a FLOP range), and where the GPU's rates
    are known the step-time model's prediction (``plan.predict``: step_s, busy_s and
    exposed_s by lane, critical_path, regime, calibration) and, on several GPUs, each route's
    predicted step."""

    step: StepTimeEstimate = field(kw_only=True)
    step_model: CalibratedPrediction | None = field(default=None, kw_only=True)
    route_steps: dict[str, float] | None = field(default=None, kw_only=True)


def estimate_run(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, *, step_model: bool = True
) -> Estimate:
    """Every number of ``slidedp estimate`` for ``cfg`` on ``machine``: the memory of its plan
    and its step time; ``step_model=False`` leaves out the step-time model (memory only)."""
    plan = resolve_plan(cfg, adapter, machine)
    memory = estimate_memory(cfg, adapter, machine, plan)
    rate = host_rate(update_threads(cfg, machine), machine, ranks=cfg.runtime.launch.world)
    step = _step_time(cfg, adapter, machine, memory.trained_params, rate)
    est = Estimate(**{f.name: getattr(memory, f.name) for f in fields(memory)}, step=step)
    rates = rates_for(cfg, adapter, machine, rate) if step_model else None
    if rates is None:
        return est
    routes = None
    if cfg.runtime.launch.world > 1:
        steps = route_steps(cfg, adapter, machine, list(ROUTES), rates)
        routes = {route_name(r): s for r, s in steps.items()}
    model = predict(plan, adapter, Shape.of_run(cfg, adapter), rates)
    return replace(est, step_model=model, route_steps=routes)


def _step_time(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, params: int, rate: HostRate
) -> StepTimeEstimate:
    b, s = cfg.train.global_batch_size, cfg.data.seq_len
    flops = model_flops_per_token(adapter.config, s) * b * s * RECOMPUTE_FACTOR
    if machine.device == "cuda":
        peak, source = gpu_peak(machine.gpu_name)
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


@dataclass(frozen=True)
class Longest:
    seq_len: int  # 0: not even one step of ``step_tokens`` fits
    limit: str  # what the next longer sequence lacks, or the model's position limit
    context_parallel: int = 1  # ranks that split each sequence (each holds seq_len / R)

    def describe(self, batch: int, unit: str = "GPUs") -> str:
        """The line ``slidedp estimate --longest-seq`` prints (``unit``: GPUs or CPU ranks)."""
        r = self.context_parallel
        split = "" if r == 1 else f", each split over {r} {unit} ({self.seq_len // r:,} on each)"
        return (f"longest sequence at B={batch} on this machine: {self.seq_len:,} tokens{split} "
                f"(next: {self.limit})")  # fmt: skip


def longest_sequence(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, step_tokens: int = 1024
) -> Longest:
    """The longest ``data.seq_len``, a multiple of ``step_tokens`` up to the model's
    ``max_position_embeddings``, at which the run (its batch, layout, clipping) fits
    ``machine``: a bisection over the estimate, whose memory grows with the sequence. With
    ``runtime.context_parallel: R`` each rank's activations are those of S/R tokens (the
    estimate counts them so) and S is a multiple of R too."""
    r = cfg.runtime.launch.context_parallel
    step_tokens = math.lcm(step_tokens, r)

    def short(tokens: int) -> list[str]:
        data = replace(cfg.data, seq_len=tokens)
        est = estimate_run(replace(cfg, data=data), adapter, machine, step_model=False)
        return shortages(est)

    cap = getattr(adapter.config, "max_position_embeddings", None) or 2**22
    if cap < step_tokens:  # a model of fewer positions than one step: the cap is the step
        step_tokens = max(r, cap // r * r)
    lo, hi = 0, cap // step_tokens  # lo fits (0: trivially), hi + 1 is past the cap
    if not short(hi * step_tokens):
        return Longest(hi * step_tokens, f"the model's max_position_embeddings {cap:,}", r)
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not short(mid * step_tokens) else (lo, mid)
    lacks = "; ".join(short(hi * step_tokens))
    return Longest(lo * step_tokens, f"{hi * step_tokens:,} tokens: {lacks}", r)


def _resident_what(est: Estimate) -> str:
    what = f"{est.resident_layers} resident layers"
    return what + " and the embeddings" if est.resident_embeddings else what


def _step_rows(est: Estimate, row: Callable[..., None]) -> None:
    """The step time's rows of ``format_estimate``: the FLOP range, the model, the routes."""
    m = est.machine
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
        exposed = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in m_.exposed_s.items())
        row(f"  model ({m_.calibration})", f"{m_.step_s:.2f} s", f"{m_.regime}")
        if exposed:
            row("    compute waits for", "", exposed)
        if a2a := m_.busy_s.get("all_to_all"):
            row("    all-to-all (context parallel)", f"{a2a:.2f} s",
                f"{a2a / m_.step_s:.0%} of the step")  # fmt: skip
    if est.route_steps:
        gpus = f"{est.world} GPUs" + (
            f", a prediction: this machine has {m.gpu_count}" if est.world > m.gpu_count else ""
        )
        row(f"  model on each route ({gpus})", "", "runtime.param_route/grad_route")
        for route, step_s in est.route_steps.items():
            chosen = " (this run's)" if route == est.route else ""
            row(f"    {route}{chosen}", f"{step_s:.2f} s")


def format_estimate(est: Estimate) -> str:
    """The human table of ``slidedp estimate``."""
    m, rows = est.machine, []

    def row(what: str, needed: str, have: str = "") -> None:
        rows.append(f"  {what:<34} {needed:>12}  {have}")

    row("/dev/shm (host store)", gib(est.shm_bytes), f"{gib(m.shm_free_bytes)} free")
    row("host RAM", gib(est.ram_bytes), f"{gib(m.mem_available_bytes)} available")
    row("  store", gib(est.store_bytes))
    if est.frozen_saved_bytes:
        frozen = est.params - est.trained_params
        row("    less than with nothing frozen", gib(est.frozen_saved_bytes),
            f"train.freeze: {frozen:,} parameters without Adam moments")  # fmt: skip
    if est.mirror_bytes:
        row("    of which the BF16 mirror", gib(est.mirror_bytes), "runtime.bf16_mirror")
    if est.signal_bytes:
        landing = "the cpu route's landing slots" if est.route.endswith("/cpu") else ""
        row("  signal store", gib(est.signal_bytes), landing)
    if est.offload_arena_bytes:
        row("  activation offload arenas", gib(est.offload_arena_bytes), "pinned")
    ranks = f", {est.world} processes" if est.world > 1 else ""
    runtime = "torch + CUDA" if est.gpu else "torch"
    row(f"  process ({runtime}{ranks})", gib(est.process_bytes))
    if est.compile_workers_bytes:
        row("  compile workers (inductor)", gib(est.compile_workers_bytes), "runtime.compile")
    if est.cpu_working_bytes:
        row("  compute working set (CPU)", gib(est.cpu_working_bytes))
        if est.resident_bytes:
            row(f"    of which {_resident_what(est)}", gib(est.resident_bytes))
    if est.gpu is not None:
        g = est.gpu
        row("pinned host memory", gib(est.pinned_bytes))
        row(
            "GPU (peak reserved + context)",
            gib(g.needed_bytes),
            f"{gib(m.gpu_total_bytes)} total",
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
                row(f"  {what}", gib(n))
    _step_rows(est, row)
    st = est.step
    row(
        "  host AdamW floor",
        f"{st.host_floor_s:.2f} s",
        f"28 B/trained param at {st.host_gbps:.0f} GB/s ({st.host_threads} threads), "
        f"{st.host_source}",
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
            f"    {r['layers']:>3} x {r['policy']:<22} {gib(r['retained_bytes']):>10} "
            f"{gib(r['offloaded_bytes']):>10} {gib(r['transient_bytes']):>10}"
        )
    verdict = shortages(est)
    tail = "fits this machine" if not verdict else "DOES NOT FIT: " + "; ".join(verdict)
    return "\n".join([head, f"  {'':<34} {'needed':>12}  this machine", *rows, f"  {tail}"])


def print_estimate(est: Estimate, found: Longest | None, *, as_json: bool, explain: bool) -> None:
    """What ``slidedp estimate`` prints: the table (with ``--longest-seq``'s line, ``found``,
    and ``--explain``'s) or one JSON object (``found`` under ``longest_seq``)."""
    if as_json:
        report = est.to_json()
        if found is not None:
            report["longest_seq"] = {"seq_len": found.seq_len, "limit": found.limit,
                                     "context_parallel": found.context_parallel}  # fmt: skip
        print(json.dumps(report, indent=2))
        return
    print(format_estimate(est))
    if found is not None:
        print(found.describe(est.batch, "GPUs" if est.machine.device == "cuda" else "ranks"))
    if explain:
        path = est.step_model.critical_path if est.step_model else ()
        print("critical path of a step (model): " + (" -> ".join(path) or "n/a (no GPU model)"))
