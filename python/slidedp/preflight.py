"""The checks of ``slidedp validate``: a run's inputs, before any GPU work or host allocation.

Run: ``slidedp validate examples/tiny-qwen3.yaml model.path=/models/qwen3-0.6b``.

Checks: the device, the model directory (every safetensors header against the model, no
tensor data read), the batch split, the resume decision (``io.resume``), the memory
(``slidedp.estimate``) against ``/dev/shm``, ``MemAvailable`` and the device, the data, the
output directory (writable, never a model or checkpoint directory, room: ``io.disk_space``).
Invariants: each failure is one typed ``SlidedpError`` naming the problem and the fix;
``slidedp train`` runs the same checks (all but the data) before it allocates or writes anything.

Example::

    for line in validate(load_config("run.yaml")).lines: print(line)
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from slidedp.autopolicy.auto import resolve_auto
from slidedp.autopolicy.choose import selection_cached
from slidedp.autopolicy.default import AUTO, break_even_fallback, default_policy
from slidedp.config import TrainConfig
from slidedp.data.build import ModelFacts, check_model_fit, run_data
from slidedp.errors import ConfigError, ModelLoadError
from slidedp.estimate import check_fits
from slidedp.estimate_report import estimate_run
from slidedp.io.checkpoint import FINAL, checkpoint_dirs
from slidedp.io.disk_space import (
    check_disk_space,
    checkpoint_bytes,
    export_bytes,
    saves_of_run,
)
from slidedp.io.hf_load import check_weight_files, weight_files
from slidedp.io.resume import ResumeDecision, ResumePoint, plan_resume
from slidedp.io.run_lock import DirTimes, check_not_in_use
from slidedp.models.freeze import apply_freeze
from slidedp.models.hf import HFAdapter
from slidedp.models.router_loss import check_router_loss_ranks
from slidedp.plan.device import pick_device, pick_dtype
from slidedp.plan.given import check_plan_model
from slidedp.plan.machine import Machine
from slidedp.plan.policy import Plan
from slidedp.plan.resolve import given_plan_line, kept_plan, resolve_plan
from slidedp.runtime.context_parallel import check_context
from slidedp.runtime.dist import check_config
from slidedp.runtime.trackers import check_trackers

SHM_DIR = Path("/dev/shm")
_GIB = 2**30


def check_device(cfg: TrainConfig) -> str:

    device = pick_device(cfg.runtime.launch.device)
    return f"device   {device} ({str(pick_dtype(cfg.train.dtype, device)).removeprefix('torch.')})"


def check_model(cfg: TrainConfig) -> tuple[HFAdapter, str]:
    """The model's adapter (meta device, no weights) with its weight files' headers checked."""
    path = Path(cfg.model.path)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise ModelLoadError(
            f"model.path {path} {what}; set model.path to a local HF model directory "
            "(config.json + *.safetensors)"
        )
    adapter = apply_freeze(HFAdapter.from_dir(path, cfg.model.config_overrides()), cfg.train.freeze)
    check_router_loss_ranks(adapter, cfg.runtime.launch.world * cfg.runtime.launch.nodes)
    if cfg.data.packing and "linear_attention" in (
        getattr(adapter.config, "layer_types", None) or []
    ):
        raise ConfigError(
            f"data.packing=true with {adapter.config.model_type}'s linear-attention layers "
            "(layer_types): their recurrent state and convolution run along the whole row, "
            "across the packed samples' boundaries; set data.packing=false"
        )
    files = weight_files(path)
    plan = check_weight_files(adapter, files)
    weights = (
        f"{len(files)} safetensors file(s), headers match{plan.describe()}"
        if files
        else "no weights: seeded init"
    )
    of = f" (the text model of a {adapter.multimodal} model)" if adapter.multimodal else ""
    return adapter, (
        f"model    {adapter.config.model_type}{of} at {path}: {adapter.num_layers} layers, "
        f"{parameter_count(adapter):,} parameters{frozen_count(adapter)}, {weights}"
    )


def frozen_count(adapter: HFAdapter) -> str:
    """``" (N frozen: train.freeze)"``, or "" when everything trains."""
    shapes = adapter.shapes()
    frozen = sum(math.prod(shapes[n]) for n in adapter.frozen)
    return f" ({frozen:,} frozen: train.freeze)" if frozen else ""


def parameter_count(adapter: HFAdapter) -> int:
    return sum(math.prod(shape) for shape in adapter.shapes().values())


def check_memory(cfg: TrainConfig, adapter: HFAdapter, shm_dir: Path = SHM_DIR) -> str:
    """The run's memory estimate (``slidedp.estimate``: exact store size, offload arena, process,
    GPU peak) against this machine; raises ``OutOfSharedMemoryError`` (/dev/shm, RAM) or
    ``OutOfDeviceMemoryError`` (GPU), one line with the numbers, before anything is allocated."""

    est = estimate_run(cfg, adapter, Machine.probe(cfg, shm_dir, measure=False))
    check_fits(est)
    m = est.machine
    line = (
        f"host     /dev/shm {est.shm_bytes / _GIB:.2f} of {m.shm_free_bytes / _GIB:.2f} GiB free, "
        f"RAM {est.ram_bytes / _GIB:.2f} GiB"
    )
    if m.mem_available_bytes is not None:
        line += f" of {m.mem_available_bytes / _GIB:.2f} GiB available"
    if est.gpu is not None and m.gpu_total_bytes is not None:
        line += f", GPU {est.gpu.needed_bytes / _GIB:.2f} of {m.gpu_total_bytes / _GIB:.2f} GiB"
    return line + " (slidedp estimate)"


def check_data(cfg: TrainConfig, adapter: HFAdapter) -> str:
    """Read, tokenize and check the whole data set as the trainer will (``run_data``),
    the held-out data too."""

    batches, held = run_data(cfg, adapter.config, adapter.vocab_size)
    line = f"data     {batches.report}"
    if held is not None:  # the held-out rows runtime.evaluate visits
        line += f"; held out: {held.report}"
    return line


def check_run_shape(cfg: TrainConfig, adapter: HFAdapter, *, here: bool = True) -> list[str]:
    """The checks that need neither data, output nor device (``train``, ``validate`` and
    ``estimate`` alike): the sequence against the model (the data's first check), the context
    split (``check_context``) and the ranks' batch split (``check_ranks``: its line, if
    several ranks). ``here=False`` (an estimate, maybe for another machine): node 0's address
    need not resolve on this one."""
    check_model_fit(cfg.data, ModelFacts.from_config(adapter.config, adapter.vocab_size))
    check_context(cfg, adapter)
    several = cfg.runtime.launch.world > 1 or cfg.runtime.launch.nodes > 1
    return [check_ranks(cfg, resolve=here)] if several else []


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").exists() or any(path.glob("*.safetensors"))


def check_output_dir(cfg: TrainConfig) -> str:
    """``output.dir`` can be created and written, and is not a model or checkpoint directory.
    Writes nothing but a probe file, deleted at once, in the directory or its nearest parent,
    whose times are then put back (``access(2)`` cannot tell: root passes it on sysfs)."""
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir {out} exists and is not a directory; choose another path")
    if out.is_dir() and _is_model_dir(out):
        raise ConfigError(
            f"output.dir {out} is a model or checkpoint directory (config.json or *.safetensors); "
            "slidedp never writes into one: choose a new output.dir"
        )
    if cfg.output.export and cfg.runtime.launch.node_rank == 0:  # node 0's rank 0 exports
        check_export_target(out)
    probe_dir = out
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ConfigError(
            f"output.dir {out} cannot be created: {probe_dir} is a file; choose another path"
        )
    times = DirTimes.of(probe_dir)
    try:
        fd, probe = tempfile.mkstemp(prefix=".slidedp-write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"output.dir {out} is not writable ({e.strerror} in {probe_dir}); choose a writable "
            "output.dir or fix its permissions"
        ) from None
    times.restore()
    return f"output   {out}: writable{'' if out.exists() else ' (will be created)'}"


def check_export_target(out: Path) -> None:
    """``out/final`` can take the run's export: absent, or a directory this run's checkpoints
    made (a new run never replaces the export of an earlier one it cannot continue)."""
    final = out / FINAL
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        kind = "a symbolic link" if final.is_symlink() else "not a directory"
        raise ConfigError(
            f"{final} is {kind}: the run exports the trained model there; move it away or set "
            "output.export=false"
        )
    if final.is_dir() and not checkpoint_dirs(out):
        raise ConfigError(
            f"{out} holds {FINAL}/ of an earlier run and no checkpoint to continue from: choose "
            f"another output.dir, or move {FINAL}/ away (a run never overwrites an export it "
            "cannot continue)"
        )


def check_checkpoint_space(cfg: TrainConfig, adapter: HFAdapter, resume: ResumePoint | None) -> str:
    """``output.dir``'s filesystem holds the checkpoints the run has on disk at once
    (``io.disk_space``): ``DiskFullError`` otherwise."""
    out = cfg.output
    start = 0 if resume is None else resume.progress.step
    return check_disk_space(
        Path(out.dir),
        one_bytes=checkpoint_bytes(adapter),
        total_limit=out.save_total_limit,
        saves=saves_of_run(start, cfg.train.max_steps, out.save_steps),
        best=out.save_best,
        final_bytes=export_bytes(adapter) if out.export else 0,
    )


def check_ranks(cfg: TrainConfig, *, resolve: bool = True) -> str:
    """What several ranks (and nodes) need from the config (each rank checks it again);
    ``resolve``: node 0's address resolves here."""

    rt = cfg.runtime
    check_config(rt.launch.world, rt, cfg.train, nodes=rt.launch.nodes)
    if rt.launch.nodes == 1:
        r = rt.launch.context_parallel
        split = f", each sequence split over {r} of them" if r > 1 else ""
        return f"ranks    {rt.launch.world}{split}"
    try:
        if resolve:
            socket.getaddrinfo(rt.launch.master_addr, rt.launch.master_port,
                               type=socket.SOCK_STREAM)  # fmt: skip
    except OSError as e:
        raise ConfigError(
            f"runtime.master_addr '{rt.launch.master_addr}' does not resolve ({e}): set it to node "
            "0's address as every node reaches it"
        ) from None
    return (
        f"ranks    {rt.launch.world} per node x {rt.launch.nodes} nodes, "
        f"this is node {rt.launch.node_rank}; "
        f"rendezvous at {rt.launch.master_addr}:{rt.launch.master_port}"
    )


def check_resume(
    cfg: TrainConfig, adapter: HFAdapter, decided: ResumeDecision | None = None
) -> tuple[ResumePoint | None, str]:
    """``train.resume`` against ``output.dir`` (``io.resume``): the checkpoint to continue from,
    its files checked, or the refusal ``train`` would meet (a new run over checkpoints, a step
    beyond ``train.max_steps``, a damaged checkpoint named by path, ...). ``decided``: the
    launcher's answer to the same question, taken as it is (its files are not read again)."""
    if decided is not None:
        point = decided.point
    else:
        point = plan_resume(cfg.train, cfg.data, Path(cfg.output.dir), adapter)
    if point is None:
        return None, "resume   none: a new run"
    return point, f"resume   from {point.path} (step {point.progress.step}), files intact"


@dataclass(frozen=True)
class Checked:
    """What the checks found: one line per part, the resume decision and its warning."""

    lines: list[str]
    resume: ResumePoint | None
    adapter: HFAdapter
    cfg: TrainConfig  # the config to run: runtime.policy=auto resolved (autopolicy.auto)
    plan: Plan  # the run's plan (plan.resolve.resolve_plan of ``cfg`` on this machine)
    policy_line: str | None = None  # what runtime.policy=auto chose, and why
    selected: bool = False  # AutoPolicy chose the policy (explicitly or by default on CUDA)

    @property
    def warnings(self) -> tuple[str, ...]:
        return () if self.resume is None else self.resume.warnings


def check_before_training(
    cfg: TrainConfig,
    *,
    measure_policy: bool = False,
    plan: Plan | None = None,
    plan_source: str | None = None,
    decided: ResumeDecision | None = None,
) -> Checked:
    """The checks ``slidedp train`` runs before it allocates or writes anything: all but the
    data, which the trainer reads once and checks as it builds the batches. With
    ``runtime.policy: auto`` the layout is chosen first (``autopolicy.auto``; ``measure_policy``:
    profile the layer if it is not cached and validate the choice in a few training steps
    beside the default, as ``train`` does; nothing is written into ``output.dir``) and the rest
    checks the choice. ``plan``: the run's plan, decided before (``slidedp train --plan``):
    ``cfg`` already carries its keys (``plan.given.take_plan``), nothing is chosen again, and
    the plan that runs is ``cfg``'s; ``plan_source``: the user's
    file it came from, which runs on a resume in place of the checkpoint's plan (one line).
    ``decided``: the launcher's resume decision (``check_resume``)."""

    device = check_device(cfg)
    adapter, model = check_model(cfg)
    if plan is not None:
        check_plan_model(plan, plan_source or "the launcher's plan", adapter)
    ranks = check_run_shape(cfg, adapter)
    resume, resumed = check_resume(cfg, adapter, decided)
    output = check_output_dir(cfg)
    check_trackers(cfg.output.trackers())
    # after every refusal that needs no layout: profiling is GPU work and writes its cache
    machine = Machine.probe(cfg, measure=False)
    resume_path = None if resume is None else resume.path
    if plan is None:
        cfg, said, selected = settle_policy(cfg, adapter, machine, resume_path,
                                            measure=measure_policy)  # fmt: skip
    else:  # a plan given: nothing is chosen again
        given = None if plan_source is None else given_plan_line(plan, plan_source, resume_path)
        said, selected = [given] if given else [], False
    memory = check_memory(cfg, adapter)  # the host first: a disk is easier to free
    output += f"; {check_checkpoint_space(cfg, adapter, resume)}"
    lines = [device, *ranks, model, *said, resumed, memory, output]
    # a plan given is in cfg's keys (plan.given): resolved as any config, it is what cfg records
    plan = resolve_plan(cfg, adapter, machine)
    return Checked(lines, resume, adapter, cfg, plan, "\n".join(said) or None, selected)


def settle_policy(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, resume: Path | None, *, measure: bool
) -> tuple[TrainConfig, list[str], bool]:
    """The config whose ``runtime`` keys the run trains, the lines that say how they were
    settled, and whether AutoPolicy chose them: ``runtime.policy: auto`` (explicit, or the
    default on CUDA) chosen (``autopolicy.auto``), and a resumed run's checkpoint policy kept
    (``plan.resolve.kept_plan``)."""
    cfg, fallback = apply_default_policy(cfg, adapter, machine, resume)
    selected = cfg.runtime.autopolicy.policy == AUTO
    cfg, chosen = resolve_auto(cfg, adapter, machine, measure=measure, resume=resume)
    cfg, kept = kept_plan(cfg, adapter, machine, resume)
    return cfg, [x for x in (chosen or fallback, kept) if x], selected


def apply_default_policy(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, resume: Path | None
) -> tuple[TrainConfig, str | None]:
    """``cfg`` with ``runtime.policy: auto`` where AutoPolicy is the default
    (``autopolicy.default``), and the banner's line where it would be but the predicted
    break-even exceeds ``train.max_steps``, or on CPU (the fixed default runs)."""
    rule = default_policy(cfg.runtime, machine.device, int(os.environ.get("WORLD_SIZE", "1")))
    if not rule.implicit:  # said where the run could have selected and nothing asked otherwise
        cpu = machine.device != "cuda" and not cfg.runtime.autopolicy.policy
        said = f"policy   {rule.why}: AutoPolicy is the default on CUDA (runtime.policy: auto "
        return cfg, said + "selects here too)" if cpu else None
    selecting = replace(cfg, runtime=cfg.runtime.with_keys(policy=AUTO))
    if selection_cached(selecting, adapter, machine, resume):
        return selecting, None
    est = estimate_run(cfg, adapter, machine)
    step_s = est.step_model.step_s if est.step_model else None
    fallback = break_even_fallback(cfg.train.max_steps, step_s)
    return (cfg, fallback) if fallback else (selecting, None)


def validate(cfg: TrainConfig) -> Checked:
    """Every check (``slidedp validate``): ``train``'s and the data's; one summary line each.
    First, as ``train`` takes it first: no other run holds ``output.dir``."""
    check_not_in_use(Path(cfg.output.dir))
    checked = check_before_training(cfg)
    return replace(checked, lines=[*checked.lines, check_data(cfg, checked.adapter)])
