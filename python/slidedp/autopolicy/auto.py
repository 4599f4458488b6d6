"""``runtime.policy: auto``: a run chooses its own activation layout (and resident layers, its
H2D/D2H chunk, and on several GPUs of one host its routes) before it starts, as ``slidedp
plan`` does, and trains with them: ``resolve_auto(cfg, adapter, machine, measure=...)`` returns
the config with the chosen ``runtime`` keys and the banner line.

Stages (each timed by ``clock``): the layer profile, the host probe, the chunk probe
(``chunk_choice``), the solve (``select``), on one process a calibration on a reduced model
(``calibrate``) and a validation against the fixed default (``validate``); the routes on
several GPUs (``route_choice``, with ``plan.predict``). A selection is cached
(``selection_cache``) and a later run of the same key takes it without measuring; a resumed run
keeps its checkpoint's layout and routes. ``validate`` and ``estimate`` use caches only
(docs/architecture.md, section "AutoPolicy").

Example: ``cfg, line = resolve_auto(cfg, adapter, machine, measure=True)``
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slidedp.autopolicy import measure as measurements
from slidedp.autopolicy import select
from slidedp.autopolicy.calibrate import calibrate_choice, clause, why_not_calibrated
from slidedp.autopolicy.chunk_choice import (
    ChunkChoice,
    choose_chunk,
    chunk_skipped,
    probe_terms,
    with_chunk,
)
from slidedp.autopolicy.clock import Clock
from slidedp.autopolicy.route_choice import candidate_routes, choose_route
from slidedp.autopolicy.select import MIN_GAIN
from slidedp.autopolicy.selection_cache import (
    KeyTerms,
    from_cache,
    read_selection,
    selection_key,
    store_selection,
)
from slidedp.autopolicy.validate import (
    limit_bytes,
    needs_validation,
    runner_for,
    validate_choice,
    with_choice,
)
from slidedp.errors import ConfigError
from slidedp.estimate_report import estimate_run
from slidedp.io.checkpoint import STATE_FILE
from slidedp.plan.layout import LayerPolicy, parse_layout
from slidedp.plan.machine import gpu_peak, host_rate, update_threads
from slidedp.plan.policy import layer_chunk_elems, resident_text
from slidedp.plan.predict import ROUTES, Rates, Route, links_for, route_name, route_steps
from slidedp.plan.timing import layer_times
from slidedp.profile.chunks import cached_chunks, probe_chunks
from slidedp.profile.layer import cached_profile, profile_layer, profile_spec

if TYPE_CHECKING:
    from slidedp.autopolicy.select import Choice
    from slidedp.autopolicy.validate import Validation
    from slidedp.config import RuntimeSection, TrainConfig
    from slidedp.models.hf import HFAdapter
    from slidedp.plan.machine import HostRate, Machine

AUTO = "auto"
# the keys auto writes (and routes)
CHOSEN = ("layers", "offload_ratio", "resident_layers", "resident_embeddings")


def device_total_bytes(machine: Machine, cfg: TrainConfig, adapter: HFAdapter) -> int:
    """Memory the layout may plan for: the GPU's total, or on CPU (activations in host memory)
    what MemAvailable leaves after the host state and the process (``estimate``)."""
    if machine.gpu_total_bytes is not None:
        return machine.gpu_total_bytes

    if machine.mem_available_bytes is None:
        raise ConfigError("runtime.policy=auto: no GPU and no MemAvailable to plan the layout for")
    est = estimate_run(cfg, adapter, machine, step_model=False)
    # several CPU ranks: each holds its own activations in the same RAM
    return (
        machine.mem_available_bytes - (est.ram_bytes - est.cpu_working_bytes)
    ) // cfg.runtime.world


def chosen_runtime(cfg: TrainConfig) -> dict[str, Any]:
    """The runtime keys that make the ranks run ``cfg``'s resolved policy (the launcher's
    choice), ``runtime.policy`` cleared."""
    rt = cfg.runtime
    return {"policy": "", "layers": rt.layers, "resident_layers": rt.resident_layers,
            "resident_embeddings": rt.resident_embeddings, "param_route": rt.param_route,
            "grad_route": rt.grad_route, "chunk_elems": rt.chunk_elems,
            "grad_slots": rt.grad_slots}  # fmt: skip


def chosen_overrides(cfg: TrainConfig) -> list[str]:
    """``chosen_runtime`` as ``section.key=value`` overrides (``slidedp train``'s launcher)."""
    return [f"runtime.{k}={v}" for k, v in chosen_runtime(cfg).items()]


def check_one_process(rt: RuntimeSection, what: str) -> None:
    """``slidedp plan`` profiles and budgets one process's share of the batch on one device (a
    launcher such as torchrun says how many processes run in ``WORLD_SIZE``)."""
    if rt.world > 1 or rt.nodes > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"{what} chooses the layout of one process for now: for several ranks or nodes "
            "write runtime.layers by hand (slidedp estimate checks it), or let "
            "`slidedp train` choose with runtime.policy=auto (one host)"
        )


def check_auto_launch(rt: RuntimeSection) -> None:
    """``auto`` chooses once, before any rank starts (``slidedp train``'s launcher, the bench's):
    a rank started by another launcher (torchrun: ``WORLD_SIZE``) cannot, and several nodes
    would each choose for themselves."""
    if rt.nodes > 1:
        raise ConfigError(
            f"runtime.policy=auto chooses for the GPUs of one host, not for {rt.nodes} nodes: "
            "write runtime.layers and the routes by hand (slidedp estimate checks them)"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "runtime.policy=auto chooses once, before the ranks start: start them with "
            "`slidedp train CONFIG runtime.gpus=N` (not torchrun), or write the policy by hand"
        )


def check_auto_free(rt: RuntimeSection) -> None:
    """The keys ``auto`` chooses must be left to it (detected as differing from the dataclass
    default: a key set to its default value cannot be told from an unset one)."""
    fixed = [k for k in CHOSEN if getattr(rt, k) != getattr(type(rt)(), k)]
    if fixed:
        raise ConfigError(
            f"runtime.policy=auto chooses runtime.layers, their offload and the GPU-resident "
            f"layers and embeddings, which the config "
            f"sets ({', '.join(f'{k}={getattr(rt, k)}' for k in fixed)}): keep one of them"
        )


@dataclass(frozen=True)
class Kept:
    """What a resumed run's checkpoint ran with (``trainer_state.json``'s policy)."""

    layers: str
    resident_layers: int
    route: Route  # (param_route, grad_route)
    resident_embeddings: bool = False
    chunk_elems: int = 0  # and the gradient ring cut to it (0: the whole layer)
    grad_slots: int = 0


def _kept_policy(resume: Path | None, layers: int, whole_layer: int) -> Kept | None:
    """The layout, GPU-resident layer count, chunk and routes a resumed run's checkpoint ran
    with (``trainer_state.json``), if it has them for this model (``whole_layer``: the chunk of
    one layer, which the checkpoint records for a config's 0)."""
    if resume is None:
        return None
    try:
        policy = json.loads((resume / STATE_FILE).read_text())["policy"]
        layout, resident = str(policy["layers"]), int(policy.get("resident_layers", 0))
        route = (str(policy["param_route"]), str(policy["grad_route"]))
        fits = len(parse_layout(layout, layers, 0.0)) == layers and 0 <= resident <= layers
        embeddings = policy.get("resident_embeddings", False)
        chunk, slots = int(policy.get("chunk_elems", 0)), int(policy.get("grad_slots", 0))
        chunk = 0 if chunk == whole_layer else chunk
        if not fits or route not in ROUTES or not isinstance(embeddings, bool) or chunk < 0:
            return None
        return Kept(layout, resident, route, embeddings, chunk, slots)
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None


def _route(cfg: TrainConfig) -> Route:
    return cfg.runtime.param_route, cfg.runtime.grad_route


def _with(cfg: TrainConfig, **runtime: Any) -> TrainConfig:
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, **runtime))


def _kept_line(
    cfg: TrainConfig, kept: Kept, candidates: list[Route], resume: Path
) -> tuple[TrainConfig, str]:
    """The resumed run keeps its checkpoint's layout and, where auto chooses them, routes; on
    several ranks no layer is GPU-resident (refused there)."""
    rt = cfg.runtime
    resident = kept.resident_layers if rt.world == 1 else 0
    embeddings = kept.resident_embeddings and rt.world == 1
    cfg = _with(cfg, layers=kept.layers, resident_layers=resident, resident_embeddings=embeddings)
    chunk = ""
    if kept.chunk_elems and not rt.chunk_elems and kept.grad_slots > 0:
        cfg = _with(cfg, chunk_elems=kept.chunk_elems, grad_slots=kept.grad_slots)
        chunk = f", chunk {kept.chunk_elems:,} elements"
    routes = ""
    if rt.world > 1:
        route = kept.route if kept.route in candidates else (rt.param_route, rt.grad_route)
        cfg = _with(cfg, param_route=route[0], grad_route=route[1])
        routes = f", routes {route_name(route)}"
    line = (
        f"policy   auto: {kept.layers}, {resident_text(resident, embeddings)}{chunk}{routes} "
        f"(kept from {resume.name})"
    )
    return cfg, line


def selection_cached(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, resume: Path | None
) -> bool:
    """Whether ``runtime.policy: auto`` would take its choice without measuring: kept from the
    checkpoint ``resume``, or found in the selection cache."""
    if resume is not None and _kept_policy(resume, adapter.num_layers, 0) is not None:
        return True
    several = cfg.runtime.world > 1
    candidates = candidate_routes(cfg, None) if several else []
    resident = machine.gpu_total_bytes is not None and not several
    facts = selection_key(cfg, adapter, machine, KeyTerms(resident, candidates))
    found = facts and read_selection(facts, layers=adapter.num_layers, routes=candidates,
                                     say=lambda line: None)  # fmt: skip
    return bool(found)


def resolve_auto(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    *,
    measure: bool,
    resume: Path | None = None,
    routes_fixed: bool | None = None,
) -> tuple[TrainConfig, str | None]:
    """``cfg`` with ``runtime.policy: auto`` replaced by the chosen ``runtime.layers`` (on GPUs
    a validated chunk, ``runtime.chunk_elems`` and ``runtime.grad_slots``, and on several GPUs
    the routes), and the line that says what was chosen and why (``cfg`` unchanged and None
    without ``auto``). ``measure``: profile the layer when it is not cached (else check the
    default layout); on several ranks every measurement runs in a child process
    (``autopolicy.measure``) and the choice is made here from the cache, once for every rank.
    ``resume``: the checkpoint a run continues from keeps the layout, chunk and routes it ran
    with.
    ``routes_fixed``: True keeps the config's routes, False lets auto choose both, None
    (``train``) keeps each route key the config sets to another value than its default."""

    rt = cfg.runtime
    if rt.policy != AUTO:
        return cfg, None
    check_auto_launch(rt)
    check_auto_free(rt)
    default = _with(cfg, policy="")
    several = rt.world > 1
    candidates = candidate_routes(cfg, routes_fixed) if several else []
    kept = _kept_policy(resume, adapter.num_layers, layer_chunk_elems(adapter))
    if kept is not None and resume is not None:
        return _kept_line(default, kept, candidates, resume)
    # GPU-resident layers where there is one GPU (on CPU they would move nothing; several ranks
    # refuse them: their gradients are not reduced across ranks)
    resident = machine.gpu_total_bytes is not None and not several
    if measure and not rt.policy_force:  # validate and estimate show the solver's choice
        facts = selection_key(default, adapter, machine, KeyTerms(resident, candidates))
        hit = facts and read_selection(facts, layers=adapter.num_layers, routes=candidates,
                                       say=_say)  # fmt: skip
        if hit:
            return from_cache(default, *hit)
    measuring, clock = measure, Clock(say=_say_stage if measure else None)
    measured_s = None
    if measure and several:  # the launcher stays free of the measurements' device state
        with clock.stage("measure"):
            measured_s, measure = measurements.measure_in_child(cfg), False
    args = profile_spec(cfg)
    with clock.stage("profile") as notes:
        report = profile_layer(args) if measure else cached_profile(args)
        notes.append("cached" if report is None or report.get("cached") else "measured")
    if report is None:
        what = "the default layout is" if not several else "the default layout and routes are"
        return default, (
            f"policy   auto: the layer is not profiled yet, so {what} checked; "
            "`slidedp train` profiles it and chooses"
        )
    with clock.stage("host") as notes:
        host = host_rate(update_threads(cfg, machine), machine, measure=measure)
        notes.append(f"AdamW {host.gbps:.0f} GB/s {host.source}")
    chunk, chunk_said = chunk_stage(default, adapter, machine, measure=measure, clock=clock)
    if chunk is not None and not chunk.is_default and not (measuring and rt.policy_validate_steps):
        why = "runtime.policy_validate_steps=0" if measuring else "`slidedp train` validates it"
        chunk_said = f"the whole layer ({chunk_said}; not applied unvalidated: {why})"
        chunk = None
    total = device_total_bytes(machine, default, adapter)
    calibrated: dict[LayerPolicy, float] = {}  # the calibration stage's layer times

    def solve_at(cut_bytes: int = 0) -> Choice:
        return select.select_layout(default, adapter, machine, report, total_bytes=total,
                             update_gbps=host.gbps, resident=resident,
                             budget_cut_bytes=cut_bytes, times_s=calibrated)  # fmt: skip

    def configured(base: TrainConfig, choice: Choice) -> tuple[TrainConfig, str]:
        """``base`` running ``choice``, on several ranks on the routes chosen for it (and
        what the route stage said of them)."""
        run = _with(base, layers=choice.layout, resident_layers=choice.resident_layers,
                    resident_embeddings=choice.resident_embeddings)  # fmt: skip
        said = ""
        if several:
            run, said = _routes(run, adapter, machine, candidates, report, host)
        return with_chunk(run, chunk, adapter, machine), said

    with clock.stage("solve") as notes:
        choice = solve_at()
        notes.append(
            f"{choice.layout}, {choice.resident_text} (the program's "
            f"{choice.program_layout}, predicted {choice.gain:.2f}x the default)"
        )
    calibration, not_calibrated = None, _why_not_calibrated(choice, rt, several=several,
                                                             measuring=measuring)  # fmt: skip
    if not_calibrated is None:
        with clock.stage("calibrate") as notes:
            calibration = calibrate_choice(default, choice, steps=rt.policy_calibrate_steps,
                                           runner=runner_for(machine))  # fmt: skip
            calibrated.update(calibration.times_s())
            choice = solve_at()
            notes.append(f"{calibration.describe()}; solved again: {choice.program_layout}")
    steps, validation = rt.policy_validate_steps, None
    other_route = several and _route(configured(default, choice)[0]) != _route(default)
    other_chunk = chunk is not None and not chunk.is_default
    if measuring and steps and (needs_validation(choice) or other_route or other_chunk):
        with clock.stage("validation") as notes:
            validation = validate_choice(
                default,
                choice,
                solve_at,
                steps=steps,
                limit_bytes=limit_bytes(machine),
                runner=runner_for(machine, rt.world),
                configure=lambda cfg, c: configured(cfg, c)[0],
            )
            notes.append(validation.describe())
    if measured_s is not None:
        source = f"measured in a child process in {measured_s:.1f} s"
    else:
        profiled = clock.seconds["profile"]
        source = "cached profile" if report.get("cached") else f"profiled in {profiled:.1f} s"
    shown = choice if validation is None else validation.result(choice)
    line = _head(choice, shown, source, host, clock.seconds["solve"])
    if validation is not None and validation.choice is None:  # the default, on its routes
        chosen = with_choice(default, shown)
        said = f"{route_name(_route(default))}, the config's (validated)"
        if other_chunk:
            chunk_said += ", not run: the default won validation"
    else:
        chosen, said = configured(default, shown)
        if chunk is not None and other_chunk and chosen.runtime.chunk_elems != chunk.chunk_elems:
            chunk_said += ", not run: the chosen layout loads without the mirror probed"
    if several:
        line += f"; routes {said}"
    line += f"; chunk {chunk_said}"
    line += f"; {clause(calibration.summary() if calibration else {'skipped': not_calibrated})}"
    line += f"; {_validated(validation, steps, measuring=measuring)}"
    if measuring:  # from a cache alone (validate, estimate) the seconds say nothing
        line += f"; {_selection(clock, validation)}"
        terms = KeyTerms(resident, candidates)
        store_selection(default, chosen, adapter, machine, line, clock, validation, terms)
    return chosen, line


def chunk_stage(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, *, measure: bool, clock: Clock
) -> tuple[ChunkChoice | None, str]:
    """The chunk for a run on GPUs (``autopolicy.chunk_choice``, timed as the stage ``chunks`` of
    ``clock``) and what to say of it; None where ``chunk_skipped`` says why, or where, not
    measuring, the probe is not cached. On several GPUs the launcher's child process probes
    (``autopolicy.measure``) and this reads its report: one rank's stream, measured alone;
    validation on the ranks has the last word."""

    skipped = chunk_skipped(cfg.runtime, machine)
    if skipped is not None:
        return None, skipped
    with clock.stage("chunks") as notes:
        numel, threads, mirror = probe_terms(cfg, adapter, machine)
        device = torch.device("cuda", torch.cuda.current_device()) if measure else None
        report: dict[str, Any] | None = (
            probe_chunks(numel, threads, device, mirror=mirror)
            if device is not None
            else cached_chunks(threads, machine.gpu_name, numel, mirror)
        )
        if report is None:
            said = "the whole layer (not probed yet: `slidedp train` probes and chooses)"
            notes.append(said)
            return None, said
        choice = choose_chunk(report, grad_slots=cfg.runtime.grad_slots)
        notes.append(choice.describe())
    return choice, choice.describe()


def _say(line: str) -> None:
    print(line, flush=True)


def _head(choice: Choice, shown: Choice, source: str, host: HostRate, solve_s: float) -> str:
    """What runs (``shown``: the solver's ``choice`` or, after validation, the winner) and why,
    with the program's accounting."""

    if shown.kept_default and not choice.kept_default:  # validation kept the default
        verdict = (
            f" kept: the solver's {choice.program_layout}, predicted {choice.gain:.2f}x, "
            "did not run faster in validation"
        )
    elif choice.kept_default:
        verdict = (
            f" kept: the best layout, {choice.program_layout}, is predicted {choice.gain:.2f}x, "
            f"below the {1 + MIN_GAIN:.2f}x that leaving the default needs"
        )
    else:
        verdict = f", predicted {shown.gain:.2f}x the default all-F layout"
    return (
        f"policy   auto: {shown.layout}, {shown.resident_text}{verdict} "
        f"(layers and host update {shown.solution['step_s']:.3f} vs "
        f"{shown.default['step_s']:.3f} s, "
        f"activations {shown.solution['memory_bytes'] / 2**30:.2f} of "
        f"{shown.budget_bytes / 2**30:.2f} GiB; {source}, host AdamW {host.gbps:.0f} GB/s "
        f"{host.source}, solved in {solve_s:.2f} s)"
    )


def _say_stage(line: str) -> None:
    print(f"policy   auto {line}", flush=True)


def _why_not_calibrated(
    choice: Choice, rt: RuntimeSection, *, several: bool, measuring: bool
) -> str | None:
    """Why ``choice`` is not calibrated (None: it is): as validation, only where this process
    can run the trials (``train`` on one process)."""
    if rt.policy_calibrate_steps and several:
        return "several ranks: the profiled times"
    if rt.policy_calibrate_steps and not measuring:
        return "`slidedp train` calibrates"
    return why_not_calibrated(rt.policy_calibrate_steps, choice)


def _validated(validation: Validation | None, steps: int, *, measuring: bool) -> str:
    if validation is not None:
        return f"validated ({steps} steps each): {validation.describe()}"
    if not steps:
        return "not validated (runtime.policy_validate_steps=0)"
    if not measuring:
        return "not validated here (`slidedp train` validates)"
    return "not validated (the default chosen: nothing to compare)"


def _selection(clock: Clock, validation: Validation | None) -> str:
    """The selection's seconds by stage, and the steps after which the choice paid for them."""
    if validation is None:
        return f"{clock.describe()}, break-even unknown (not validated)"
    steps = validation.break_even_steps(clock.total_s)
    even = "never (the default runs)" if steps is None else f"after {steps:,} steps"
    return f"{clock.describe()}, break-even {even}"


def _routes(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    candidates: list[Route],
    report: dict[str, Any],
    host: HostRate,
) -> tuple[TrainConfig, str]:
    """``cfg`` on the routes ``autopolicy.route_choice`` picks among ``candidates``, and what
    it says (the config's routes, and why, where the model cannot predict them)."""
    rt = cfg.runtime
    config_route = (rt.param_route, rt.grad_route)
    peak, _ = gpu_peak(machine.gpu_name)
    links = links_for(rt.world, adapter, machine) if machine.device == "cuda" else None
    why = None
    if machine.device != "cuda":
        why = "the route model is for GPUs"
    elif peak is None:
        why = f"no peak FLOP/s on record for {machine.gpu_name}"
    elif links is None:
        why = "the links between the GPUs are not measured"
    if why is not None or peak is None or links is None:
        return cfg, f"{route_name(config_route)}, the config's ({why})"
    rates = Rates(peak, host.gbps, host.cast_gbps, links, layer_times(report))
    steps = route_steps(cfg, adapter, machine, candidates, rates)
    choice = choose_route(steps, config_route)
    fixed = ", fixed by the config" if len(candidates) == 1 else ""
    said = (
        f"{choice.describe()}{fixed}; reduce {links.reduce_gbps:.0f}, all_gather "
        f"{links.gather_gbps:.0f} GB/s measured, copies at the PCIe ceilings"
    )
    return _with(cfg, param_route=choice.route[0], grad_route=choice.route[1]), said
