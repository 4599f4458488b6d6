"""The one policy selection: ``choose(cfg, adapter, machine, spec) -> (Plan, SelectionReport)``,
called by ``runtime.policy: auto`` (``autopolicy.auto``) and by ``slidedp plan``
(``autopolicy.command``); they differ only in their ``ChooseSpec``.

``STAGES`` run in order over one ``Selecting`` state, each timed by its ``Clock``: the checkpoint's
choice kept, the selection cache, the measurements in a child process (several GPUs), the layer
profile, the host probe, the chunk probe, the solve, the calibration, the validation, the choice
and its banner line, the estimate's check (``slidedp plan``), the cache write. On one GPU the
trials of calibration and validation share one child process (``trial_child``), started before
a layer profile that measures and ended with the selection. A stage that
settles the choice early (kept, cached, not profiled) ends the run of stages.
Invariant: every entry point selects through this list; nothing else runs trial steps.

Example::

    plan, report = choose(cfg, adapter, machine, ChooseSpec(measure=True, read_cache=True))
    print(report.line)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slidedp.autopolicy import measure as measurements
from slidedp.autopolicy import select
from slidedp.autopolicy.calibrate import Calibration, calibrate_choice, clause
from slidedp.autopolicy.chunk_choice import ChunkChoice, probe_chunk, with_chunk
from slidedp.autopolicy.clock import Clock
from slidedp.autopolicy.kept import kept_line, kept_policy
from slidedp.autopolicy.route_choice import candidate_routes, routes_for
from slidedp.autopolicy.said import (
    head,
    host_said,
    selection,
    validated,
    why_not_calibrated_here,
    why_not_validated,
)
from slidedp.autopolicy.selection_cache import (
    KeyTerms,
    from_cache,
    read_selection,
    selection_key,
    store_selection,
)
from slidedp.autopolicy.trial_child import TrialChild, runner_for
from slidedp.autopolicy.validate import (
    Runner,
    Validation,
    default_config,
    limit_bytes,
    needs_validation,
    validate_choice,
    with_choice,
)
from slidedp.errors import ConfigError
from slidedp.estimate import shortages
from slidedp.estimate_report import Estimate, estimate_run
from slidedp.plan.device import pick_dtype
from slidedp.plan.layout import LayerPolicy
from slidedp.plan.machine import HostRate, Machine, host_rate, update_threads
from slidedp.plan.policy import Plan, layer_chunk_elems
from slidedp.plan.predict import CalibratedPrediction, Route, route_name
from slidedp.plan.resolve import resolve_plan
from slidedp.profile.layer import (
    ProfileSpec,
    cached_profile,
    profile_layer,
    profile_spec,
    read_profile_file,
)

if TYPE_CHECKING:
    from slidedp.autopolicy.select import Choice
    from slidedp.config import TrainConfig
    from slidedp.models.hf import HFAdapter


@dataclass(frozen=True)
class ChooseSpec:
    """How one selection runs: what ``slidedp plan`` and ``runtime.policy: auto`` set apart."""

    measure: bool  # run what is not cached (profile, probes, trials); False: caches only
    read_cache: bool = False  # take a cached selection of the same key (unless policy_force)
    write_cache: bool = False  # cache the choice under its key
    resume: Path | None = None  # the checkpoint a run continues from: its choice is kept
    routes_fixed: bool | None = None  # route_choice.candidate_routes's ``fixed``
    profile: ProfileSpec | None = None  # the layer profile's terms (None: the run's own)
    profile_file: str | None = None  # a `slidedp profile layer --json` report given by hand
    target_bytes: int | None = None  # plan for another GPU of this size: no trial runs here
    check: bool = False  # check the choice with the estimate on the target (raise if short)
    origin: str = ""  # said after the profile's source in the banner line
    clock: Clock | None = None  # the stages' clock (None: one saying ``policy   auto STAGE``)


@dataclass
class Selecting:
    """The state the stages share: the inputs, then what each stage found."""

    cfg: TrainConfig  # as given
    base: TrainConfig  # the fixed default (``validate.default_config``)
    adapter: HFAdapter
    machine: Machine
    spec: ChooseSpec
    clock: Clock
    candidates: list[Route]  # the routes chosen among (several ranks), else []
    resident: bool  # layers may stay GPU-resident (one GPU)
    measure_here: bool  # this process measures (False once a child process measured)
    done: bool = False  # the choice is settled: the remaining stages do not run
    chosen: TrainConfig | None = None
    line: str | None = None
    measured_s: float | None = None  # the child process's measurements
    report: dict[str, Any] | None = None  # the layer profile
    host: HostRate | None = None
    update_gbps: float = 0.0  # the host rate the program prices the updates at (``host``)
    chunk: ChunkChoice | None = None
    chunk_said: str = ""
    total_bytes: int = 0  # the device memory the layout plans for
    calibrated: dict[LayerPolicy, float] = field(default_factory=dict)
    solved: Choice | None = None  # the solver's choice (after calibration)
    shown: Choice | None = None  # what runs: the solved choice or validation's winner
    calibration: Calibration | None = None
    not_calibrated: str | None = None
    validation: Validation | None = None
    not_validated: str | None = None
    other_chunk: bool = False  # the chunk stage chose another chunk than the whole layer
    route_said: str = ""
    estimate: Estimate | None = None
    # the step-time model of the chosen run and of the default ("chosen", "default")
    step_model: dict[str, CalibratedPrediction | None] | None = None
    runner: Runner | None = None  # every trial's (on one GPU: one child process for all)

    @property
    def several(self) -> bool:
        return self.cfg.runtime.launch.world > 1

    @property
    def terms(self) -> KeyTerms:
        return KeyTerms(self.resident, self.candidates, self.spec.profile)

    @property
    def target(self) -> Machine:
        """The machine the plan is for (another GPU's size with ``target_bytes``), computing
        in the GPU's dtype (``train.dtype``; auto: BF16), which its estimate prices and its
        plan runs."""
        if not self.spec.check:
            return self.machine
        bf16 = pick_dtype(self.cfg.train.dtype, torch.device("cuda")) == torch.bfloat16
        return dataclasses.replace(self.machine, device="cuda", gpu_total_bytes=self.total_bytes,
                                   dtype="bfloat16" if bf16 else "float32")  # fmt: skip

    def trials(self) -> Runner:
        """The runner of the selection's trials, calibration's and validation's alike."""
        if self.runner is None:
            self.runner = runner_for(self.machine, self.cfg.runtime.launch.world)
        return self.runner

    def settle(self, chosen: TrainConfig, line: str) -> None:
        """The choice made before the stages that measure: the rest do not run."""
        self.chosen, self.line, self.done = chosen, line, True

    def solve_at(self, cut_bytes: int = 0) -> Choice:
        assert self.report is not None
        assert self.host is not None
        return select.select_layout(
            self.base, self.adapter, self.machine, self.report, total_bytes=self.total_bytes,
            update_gbps=self.update_gbps, resident=self.resident, budget_cut_bytes=cut_bytes,
            times_s=self.calibrated, ranks=self.cfg.runtime.launch.world)  # fmt: skip

    def configured(self, base: TrainConfig, choice: Choice) -> tuple[TrainConfig, str]:
        """``base`` running ``choice`` with the chunk, on several ranks on the routes chosen
        for it (and what the route stage said of them)."""
        run, said = with_choice(base, choice), ""
        if self.several:
            assert self.report is not None
            assert self.host is not None
            run, said = routes_for(run, self.adapter, self.machine, self.candidates, self.report,
                                   self.host)  # fmt: skip
        return with_chunk(run, self.chunk, self.adapter, self.machine), said


@dataclass(frozen=True)
class SelectionReport:
    """What a selection found, for its reports (``slidedp plan``'s JSON, the banner)."""

    cfg: TrainConfig  # the config that runs the choice (``runtime.policy`` cleared)
    line: str  # the banner line: what runs and why
    state: Selecting  # every stage's finding (None where the stage did not run)


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
    ) // cfg.runtime.launch.world


def _say(line: str) -> None:
    print(line, flush=True)


def _say_stage(line: str) -> None:
    print(f"policy   auto {line}", flush=True)


def kept(s: Selecting) -> None:
    """A resumed run keeps the layout, chunk and routes its checkpoint ran with."""
    resume = s.spec.resume
    found = kept_policy(resume, s.adapter.num_layers, layer_chunk_elems(s.adapter))
    if found is not None and resume is not None:
        s.settle(*kept_line(s.base, found, s.candidates, resume))


def cached(s: Selecting) -> None:
    """A selection of the same key, cached, is taken as it is."""
    if not (s.spec.read_cache and s.spec.measure) or s.cfg.runtime.autopolicy.policy_force:
        return
    facts = selection_key(s.base, s.adapter, s.machine, s.terms)
    hit = facts and read_selection(facts, layers=s.adapter.num_layers, routes=s.candidates,
                                   say=_say)  # fmt: skip
    if hit:
        s.settle(*from_cache(s.base, *hit, layer_chunk_elems(s.adapter)))


def measure(s: Selecting) -> None:
    """Several GPUs: a child process measures (the launcher stays free of device state)."""
    if s.measure_here and s.several:
        with s.clock.stage("measure"):
            s.measured_s, s.measure_here = measurements.measure_in_child(s.cfg), False


def profile(s: Selecting) -> None:
    """The layer profile: measured where it is not cached (``measure``), else the cache's."""
    spec = s.spec.profile or profile_spec(s.cfg)
    with s.clock.stage("profile") as notes:
        if s.spec.profile_file:
            s.report = read_profile_file(s.spec.profile_file, s.cfg, spec.batch)
        else:
            if s.measure_here and cached_profile(spec) is None:
                _start_trials(s)
            s.report = profile_layer(spec) if s.measure_here else cached_profile(spec)
        if s.report is not None:
            source = s.spec.profile_file or ("cached" if s.report.get("cached") else "measured")
            notes.append(f"{len(s.report['candidates'])} candidates, {source}")
    if s.report is None:
        what = "the default layout and routes are" if s.several else "the default layout is"
        s.settle(s.base, f"policy   auto: the layer is not profiled yet, so {what} checked; "
                 "`slidedp train` profiles it and chooses")  # fmt: skip


def _start_trials(s: Selecting) -> None:
    """On one GPU, where trials may run: their child process started before the layer is
    profiled, its imports beside the profile's GPU work (the host probe waits for them)."""
    rt = s.cfg.runtime.autopolicy
    if s.spec.target_bytes is None and (rt.policy_calibrate_steps or rt.policy_validate_steps):
        runner = s.trials()
        if isinstance(runner, TrialChild):
            runner.start()


def host(s: Selecting) -> None:
    """The host AdamW rate (probed where it is not cached and this process measures), never
    beside the trials' child process importing, and the rate the program prices the updates
    at (``select.program_update_gbps``)."""
    if isinstance(s.runner, TrialChild):
        with s.clock.stage("trials") as notes:
            s.runner.wait_ready()
            notes.append("their process ready")
    with s.clock.stage("host") as notes:
        threads, ranks = update_threads(s.cfg, s.machine), s.cfg.runtime.launch.world
        s.host = host_rate(threads, s.machine, ranks=ranks, measure=s.measure_here)
        assert s.report is not None
        s.update_gbps = select.program_update_gbps(s.base, s.adapter, s.machine, s.host, s.report)
        notes.append(f"AdamW {host_said(s.host, s.update_gbps)}")


def chunks(s: Selecting) -> None:
    """The H2D/D2H chunk on this machine's GPU (not for another GPU's plan)."""
    if s.spec.target_bytes is not None:
        s.chunk_said = "the config's (planned for another GPU: --gpu-memory)"
        return
    s.chunk, s.chunk_said = probe_chunk(s.base, s.adapter, s.machine, measure=s.measure_here,
                                        clock=s.clock)  # fmt: skip
    s.other_chunk = s.chunk is not None and not s.chunk.is_default


def solve(s: Selecting) -> None:
    """The integer program over the profile's candidates within the device's memory."""
    s.total_bytes = s.spec.target_bytes or device_total_bytes(s.machine, s.base, s.adapter)
    with s.clock.stage("solve") as notes:
        s.solved = choice = s.solve_at()
        notes.append(
            f"{choice.layout}, {choice.resident_text} (the program's "
            f"{choice.program_layout}, predicted {choice.gain:.2f}x the default)"
        )


def calibrate(s: Selecting) -> None:
    """The shortlisted candidates timed on a reduced model, then solved again."""
    assert s.solved is not None
    steps = s.cfg.runtime.autopolicy.policy_calibrate_steps
    s.not_calibrated = why_not_calibrated_here(
        steps, s.solved, elsewhere=s.spec.target_bytes is not None, several=s.several,
        measuring=s.spec.measure)  # fmt: skip
    if s.not_calibrated is not None:
        return
    with s.clock.stage("calibrate") as notes:
        s.calibration = calibrate_choice(s.base, s.solved, steps=steps, runner=s.trials())
        s.calibrated.update(s.calibration.times_s())
        s.solved = s.solve_at()
        notes.append(f"{s.calibration.describe()}; solved again: {s.solved.program_layout}")


def _route(cfg: TrainConfig) -> Route:
    return cfg.runtime.layout.param_route, cfg.runtime.layout.grad_route


def validate(s: Selecting) -> None:
    """The choice and the default each run a few training steps: the faster one runs. A chunk
    not validated is not applied."""
    assert s.solved is not None
    rt = s.cfg.runtime
    other_route = s.several and _route(s.configured(s.base, s.solved)[0]) != _route(s.base)
    differs = needs_validation(s.solved) or other_route or s.other_chunk
    s.not_validated = why_not_validated(
        rt.autopolicy.policy_validate_steps, elsewhere=s.spec.target_bytes is not None,
        measuring=s.spec.measure, differs=differs)  # fmt: skip
    if s.not_validated is None:
        with s.clock.stage("validation") as notes:
            s.validation = validate_choice(
                s.base, s.solved, s.solve_at, steps=rt.autopolicy.policy_validate_steps,
                limit_bytes=limit_bytes(s.machine), runner=s.trials(),
                configure=lambda cfg, c: s.configured(cfg, c)[0])  # fmt: skip
            notes.append(s.validation.describe())
    elif s.other_chunk:  # a chunk runs only where validation ran it faster (chunk_choice)
        s.chunk_said = f"the whole layer ({s.chunk_said}; not applied unvalidated: "
        s.chunk_said += f"{s.not_validated})"
        s.chunk, s.other_chunk = None, False


def result(s: Selecting) -> None:
    """The config that runs the choice (validation's winner) and the banner line."""
    assert s.solved is not None
    assert s.report is not None
    assert s.host is not None
    s.shown = s.solved if s.validation is None else s.validation.result(s.solved)
    if s.validation is not None and s.validation.choice is None:  # the default, on its routes
        s.chosen = with_choice(s.base, s.shown)
        s.route_said = f"{route_name(_route(s.base))}, the config's (validated)"
        if s.other_chunk:
            s.chunk_said += ", not run: the default won validation"
    else:
        s.chosen, s.route_said = s.configured(s.base, s.shown)
        if (
            s.chunk is not None
            and s.other_chunk
            and (s.chosen.runtime.layout.chunk_elems != s.chunk.chunk_elems)
        ):
            s.chunk_said += ", not run: the chosen layout loads without the mirror probed"
    s.line = head(s.solved, s.shown, _source(s), host_said(s.host, s.update_gbps),
                  s.clock.seconds["solve"])  # fmt: skip
    if s.several:
        s.line += f"; routes {s.route_said}"
    summary = s.calibration.summary() if s.calibration else {"skipped": s.not_calibrated}
    s.line += f"; chunk {s.chunk_said}; {clause(summary)}"
    steps = s.cfg.runtime.autopolicy.policy_validate_steps
    s.line += f"; {validated(s.validation, steps, s.not_validated)}"
    if s.spec.measure:  # from a cache alone (validate, estimate) the seconds say nothing
        s.line += f"; {selection(s.clock, s.validation)}"


def _source(s: Selecting) -> str:
    """Where the layer profile came from, as the banner line says it."""
    assert s.report is not None
    if s.spec.profile_file:
        source = f"the profile {s.spec.profile_file}"
    elif s.measured_s is not None:
        source = f"measured in a child process in {s.measured_s:.1f} s"
    elif s.report.get("cached"):
        source = "cached profile"
    else:
        source = f"profiled in {s.clock.seconds['profile']:.1f} s"
    return f"{source}, {s.spec.origin}" if s.spec.origin else source


def check(s: Selecting) -> None:
    """``slidedp plan``: the estimate of the chosen run on the target, beside the default's; a
    GPU shortage is refused (the host's where the plan is for this machine)."""
    if not s.spec.check:
        return
    assert s.chosen is not None
    assert s.shown is not None
    with s.clock.stage("check"):
        est = estimate_run(s.chosen, s.adapter, s.target)
        # the step-time model ranks the choice against the default (on a GPU: it needs its peak)
        est_f = estimate_run(s.base, s.adapter, s.target)
    s.estimate, s.step_model = est, {"chosen": est.step_model, "default": est_f.step_model}
    short = [x for x in shortages(est) if x.startswith("GPU") or s.spec.target_bytes is None]
    if short:
        raise ConfigError(f"the chosen layout {s.shown.layout} does not fit: {'; '.join(short)}")


def store(s: Selecting) -> None:
    """The choice cached under its key (the measurements it rests on, as cached now)."""
    if s.spec.write_cache and s.chosen is not None and s.line is not None:
        store_selection(s.base, s.chosen, s.adapter, s.machine, s.line, s.clock, s.validation,
                        s.terms)  # fmt: skip


Stage = Callable[[Selecting], None]
STAGES: tuple[Stage, ...] = (kept, cached, measure, profile, host, chunks, solve, calibrate,
                             validate, result, check, store)  # fmt: skip


def start(cfg: TrainConfig, adapter: HFAdapter, machine: Machine, spec: ChooseSpec) -> Selecting:
    """The state before the first stage."""
    several = cfg.runtime.launch.world > 1
    on_gpu = spec.target_bytes is not None or machine.gpu_total_bytes is not None
    routes = candidate_routes(cfg, spec.routes_fixed) if several else []
    clock = spec.clock or Clock(say=_say_stage if spec.measure else None)
    return Selecting(
        cfg=cfg,
        base=default_config(cfg),
        adapter=adapter,
        machine=machine,
        spec=spec,
        clock=clock,
        candidates=routes,
        # GPU-resident layers on GPUs only (on CPU they would move nothing); on several GPUs
        # only where a gpu gradient route is a candidate (the cpu route refuses them)
        resident=on_gpu and (not several or any(g == "gpu" for _, g in routes)),
        measure_here=spec.measure,
    )


def choose(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, spec: ChooseSpec
) -> tuple[Plan, SelectionReport]:
    """The plan of ``cfg`` (``runtime.policy: auto``) for ``adapter`` on ``machine`` (with
    ``spec.target_bytes``: a GPU of that size), and what the selection found and said."""
    s = start(cfg, adapter, machine, spec)
    try:
        for stage in STAGES:
            stage(s)
            if s.done:
                break
    finally:  # the trials' child process ends with the selection
        if isinstance(s.runner, TrialChild):
            s.runner.close()
    assert s.chosen is not None
    assert s.line is not None
    report = SelectionReport(s.chosen, s.line, s)
    return resolve_plan(s.chosen, adapter, s.target), report


def selection_cached(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, resume: Path | None
) -> bool:
    """Whether ``runtime.policy: auto`` would take its choice without measuring: kept from the
    checkpoint ``resume``, or found in the selection cache."""
    if resume is not None and kept_policy(resume, adapter.num_layers, 0) is not None:
        return True
    s = start(cfg, adapter, machine, ChooseSpec(measure=False))
    facts = selection_key(s.base, adapter, machine, s.terms)
    found = facts and read_selection(facts, layers=adapter.num_layers, routes=s.candidates,
                                     say=lambda line: None)  # fmt: skip
    return bool(found)
