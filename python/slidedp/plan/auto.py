"""``runtime.policy: auto``: the run chooses its own activation layout at start, as ``slidedp
plan`` would (``plan.select``), and trains with it. The choice replaces ``runtime.layers`` in
the run's config, so ``resolved_config.yaml`` and every checkpoint record the layout that ran,
and a resumed run keeps it.

``train`` profiles the layer when the profile is not cached (on the run's device, with the
run's batch and sequence), and probes the host AdamW rate the same way (``slidedp profile
host``: the selector's host lane); ``validate`` and ``estimate`` never run GPU work: they use a
cached profile, or check the default layout and say that ``train`` will choose, and a cached
host rate or else ``estimate.ADAMW_GBPS``'s. A resumed run keeps the layout its checkpoint ran
with.

Example::

    cfg, line = resolve_auto(cfg, adapter, machine, measure=True)
    print(line)   # 'policy   auto: 11xF-r1, 1xS0000100-r0, 24xN-r0, predicted 1.19x ...'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidedp.errors import ConfigError
from slidedp.io.checkpoint import STATE_FILE
from slidedp.plan.layout import parse_layout
from slidedp.profile.layer import FAMILIES, RATIOS, cached_profile, profile_layer

if TYPE_CHECKING:
    from slidedp.config import RuntimeSection, TrainConfig
    from slidedp.estimate import Machine
    from slidedp.models.hf import HFAdapter

AUTO = "auto"


def profile_args(cfg: TrainConfig, **given: Any) -> argparse.Namespace:
    """``slidedp profile layer``'s arguments for the run's own model, batch per rank and
    sequence, on its device and dtype, with its layer compute (``runtime.kernels``,
    ``runtime.compile``); ``given`` replaces any of them."""
    args = {
        "shape": str(Path(cfg.model.path) / "config.json"),
        "batch": cfg.train.global_batch_size // cfg.runtime.world,
        "seq_len": cfg.data.seq_len,
        "families": FAMILIES,
        "ratios": RATIOS,
        "device": cfg.runtime.device,
        "dtype": cfg.train.dtype,
        "warmup": 2,
        "steps": 5,
        "cache_dir": None,  # profile.cache.default_cache_dir
        "force": False,
        "layer_kernels": cfg.runtime.kernels,
        "layer_compile": cfg.runtime.compile,
    }
    return argparse.Namespace(**(args | given))


def device_total_bytes(machine: Machine, cfg: TrainConfig, adapter: HFAdapter) -> int:
    """Memory the layout may plan for: the GPU's total, or on CPU (activations in host memory)
    what MemAvailable leaves after the host state and the process (``estimate``)."""
    if machine.gpu_total_bytes is not None:
        return machine.gpu_total_bytes
    from slidedp.estimate import estimate_run

    if machine.mem_available_bytes is None:
        raise ConfigError("runtime.policy=auto: no GPU and no MemAvailable to plan the layout for")
    est = estimate_run(cfg, adapter, machine, step_model=False)
    return machine.mem_available_bytes - (est.ram_bytes - est.cpu_working_bytes)


def check_one_process(rt: RuntimeSection, what: str) -> None:
    """The selector profiles and budgets one process's share of the batch on one device (a
    launcher such as torchrun says how many processes run in ``WORLD_SIZE``)."""
    if rt.world > 1 or rt.nodes > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"{what} chooses the layout of one process for now: for several ranks or nodes "
            "write runtime.layers by hand (slidedp estimate checks it)"
        )


def _kept_layout(resume: Path | None, layers: int) -> tuple[str, int] | None:
    """The layout and GPU-resident layer count a resumed run's checkpoint ran with
    (``trainer_state.json``), if it has them for this model."""
    if resume is None:
        return None
    try:
        policy = json.loads((resume / STATE_FILE).read_text())["policy"]
        layout, resident = str(policy["layers"]), int(policy.get("resident_layers", 0))
        fits = len(parse_layout(layout, layers, 0.0)) == layers and 0 <= resident <= layers
        return (layout, resident) if fits else None
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None


def resolve_auto(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    *,
    measure: bool,
    resume: Path | None = None,
) -> tuple[TrainConfig, str | None]:
    """``cfg`` with ``runtime.policy: auto`` replaced by the chosen ``runtime.layers``, and the
    line that says what was chosen and why (``cfg`` unchanged and None without ``auto``).
    ``measure``: profile the layer when it is not cached (else check the default layout).
    ``resume``: the checkpoint a run continues from keeps the layout it ran with."""
    from slidedp.estimate import host_rate, update_threads
    from slidedp.plan.select import MIN_GAIN, select_layout

    rt = cfg.runtime
    if rt.policy != AUTO:
        return cfg, None
    check_one_process(rt, "runtime.policy=auto")
    chosen = ("layers", "offload_ratio", "resident_layers")
    fixed = [k for k in chosen if getattr(rt, k) != getattr(type(rt)(), k)]
    if fixed:
        raise ConfigError(
            f"runtime.policy=auto chooses runtime.layers, their offload and the GPU-resident "
            f"layers, which the config "
            f"sets ({', '.join(f'{k}={getattr(rt, k)}' for k in fixed)}): keep one of them"
        )
    default = dataclasses.replace(cfg, runtime=dataclasses.replace(rt, policy=""))
    kept = _kept_layout(resume, adapter.num_layers)
    if kept is not None:
        layers = dataclasses.replace(default.runtime, layers=kept[0], resident_layers=kept[1])
        line = (
            f"policy   auto: {kept[0]}, {kept[1]} GPU-resident "
            f"(kept from {resume.name if resume else ''})"
        )
        return dataclasses.replace(default, runtime=layers), line
    start = time.perf_counter()
    args = profile_args(cfg)
    report = profile_layer(args) if measure else cached_profile(args)
    if report is None:
        return default, (
            "policy   auto: the layer is not profiled yet, so the default layout is checked; "
            "`slidedp train` profiles it and chooses"
        )
    profiled = time.perf_counter() - start
    host = host_rate(update_threads(cfg, machine), machine, measure=measure)
    total = device_total_bytes(machine, default, adapter)
    start = time.perf_counter()
    # GPU-resident layers where there is a GPU (on CPU they would move nothing)
    choice = select_layout(default, adapter, machine, report, total_bytes=total,
                           update_gbps=host.gbps,
                           resident=machine.gpu_total_bytes is not None)  # fmt: skip
    solved = time.perf_counter() - start
    source = "cached profile" if report.get("cached") else f"profiled in {profiled:.1f} s"
    verdict = (
        f" kept: the best layout, {choice.program_layout}, is predicted {choice.gain:.2f}x, "
        f"below the {1 + MIN_GAIN:.2f}x that leaving the default needs"
        if choice.kept_default
        else f", predicted {choice.gain:.2f}x the default all-F layout"
    )
    line = (
        f"policy   auto: {choice.layout}, {choice.resident_layers} GPU-resident{verdict} "
        f"(layers and host update {choice.solution['step_s']:.3f} vs "
        f"{choice.default['step_s']:.3f} s, "
        f"activations {choice.solution['memory_bytes'] / 2**30:.2f} of "
        f"{choice.budget_bytes / 2**30:.2f} GiB; {source}, host AdamW {host.gbps:.0f} GB/s "
        f"{host.source}, solved in {solved:.2f} s)"
    )
    layers = dataclasses.replace(
        default.runtime, layers=choice.layout, resident_layers=choice.resident_layers
    )
    return dataclasses.replace(default, runtime=layers), line
