"""Where a run's plan is decided: ``resolve_plan(cfg, adapter, machine) -> Plan``.

One function turns the config (its ``runtime`` keys, a policy file applied), the model and the
machine into the frozen ``Plan`` the engine executes: device and dtype, the ``Policy``, the
BF16 mirror (``resolve_mirror``: on where the run with it fits MemAvailable with
``MIRROR_HEADROOM_BYTES`` to spare), optimizer settings and host kernel threads.
``runtime.policy: auto`` is chosen before it and arrives as plain ``runtime`` keys; a resumed
run keeps the policy its checkpoint ran with (``kept_plan``).
Invariant: pure given the machine facts; nothing is measured, allocated or written.

Example::

    plan = resolve_plan(cfg, adapter, Machine.probe(cfg, measure=False))
    print(plan.policy.describe())
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from slidedp.config import TrainConfig
from slidedp.errors import ConfigError
from slidedp.estimate import estimate_memory, shortages
from slidedp.io.checkpoint import STATE_FILE
from slidedp.models.hf import HFAdapter
from slidedp.plan.machine import GIB, Machine
from slidedp.plan.policy import (
    OptimConfig,
    Plan,
    Policy,
    resident_ranks_message,
    resolve_policy,
    store_args,
)
from slidedp.profile.host import engine_update_threads
from slidedp.store import HostStore
from slidedp.store_layout import StoreLayout

# RAM an automatic BF16 mirror leaves free beyond the run (page cache, the data, other processes)
MIRROR_HEADROOM_BYTES = 8 * GIB


def mirror_given(cfg: TrainConfig, machine: Machine) -> bool | None:
    """Whether the store gets the BF16 mirror whatever fits (``resolve_mirror``'s first
    rules), or None where what fits decides."""
    rt = cfg.runtime
    if machine.dtype != "bfloat16":
        return False
    if rt.layout.bf16_mirror is not None:
        return rt.layout.bf16_mirror
    if rt.launch.world > 1 and rt.layout.param_route == "replicated":
        return True
    return None


def resolve_mirror(cfg: TrainConfig, adapter: HFAdapter, machine: Machine) -> bool:
    """Whether the store gets the BF16 mirror: ``runtime.bf16_mirror`` when set; unset, always
    for several ranks on the replicated route (no rank casts a layer) and otherwise where the run
    with the mirror fits ``machine`` with ``MIRROR_HEADROOM_BYTES`` of RAM to spare (the mirror
    is the faster path, casting on delivery the smaller footprint; both train bit-identically).
    Never when computing in f32."""
    given = mirror_given(cfg, machine)
    if given is not None:
        return given
    available = machine.mem_available_bytes
    if available is None:  # cannot tell: the smaller footprint
        return False
    est = estimate_memory(cfg, adapter, machine, resolve_plan(cfg, adapter, machine, mirror=True))
    return est.ram_bytes + MIRROR_HEADROOM_BYTES <= available and not shortages(est)


def plan_policy(cfg: TrainConfig, adapter: HFAdapter, machine: Machine) -> Policy:
    """The policy ``Trainer`` would run on ``machine``."""
    return resolve_plan(cfg, adapter, machine).policy


def plan_store(cfg: TrainConfig, adapter: HFAdapter, machine: Machine) -> StoreLayout:
    """The layout of the store ``Trainer`` would create on ``machine`` (same arguments), not
    allocated."""
    bf16, launch = machine.dtype == "bfloat16", cfg.runtime.launch
    policy = plan_policy(cfg, adapter, machine)
    args = store_args(policy, bf16=bf16, world=launch.world, nodes=launch.nodes)
    return HostStore.plan(adapter.group_specs(), **args)


def resolve_plan(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, *, mirror: bool | None = None
) -> Plan:
    """The plan of ``cfg`` for ``adapter`` on ``machine``; ``mirror`` given: that BF16 mirror
    instead of ``resolve_mirror``'s (a store already made, a what-if)."""
    rt, tc = cfg.runtime, cfg.train
    device = torch.device(machine.device)
    if mirror is None:
        mirror = resolve_mirror(cfg, adapter, machine)
    cuda = machine.device == "cuda"
    return Plan(
        device=device,
        dtype=torch.bfloat16 if machine.dtype == "bfloat16" else torch.float32,
        policy=resolve_policy(rt, adapter, mirror=mirror, device=device),
        optim=OptimConfig(
            betas=(tc.adam_beta1, tc.adam_beta2),
            eps=tc.adam_epsilon,
            weight_decay=tc.weight_decay,
            max_grad_norm=tc.max_grad_norm,
        ),
        loss_chunk_tokens=rt.layout.loss_chunk_tokens,
        # this rank's share of the cores, but one beside a GPU (``engine_update_threads``)
        threads=rt.layout.update_threads
        or engine_update_threads(machine.cores, cuda, rt.launch.world),
        version_timeout_s=rt.launch.version_timeout_s,
    )


def checkpoint_plan(checkpoint: Path) -> Plan | None:
    """The plan a checkpoint's run trained with (``trainer_state.json``), None for a
    checkpoint written before it was recorded."""
    try:
        return Plan.from_json(json.loads((checkpoint / STATE_FILE).read_text())["plan"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None


def kept_plan(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, resume: Path | None
) -> tuple[TrainConfig, str | None]:
    """``cfg`` with the policy its checkpoint ``resume`` ran with where the config's differs,
    and the line that says so (``cfg`` and None where they agree, the checkpoint has no plan,
    or its policy cannot run here). A config that names its policy on purpose
    (``runtime.policy: fixed`` or a policy file) keeps its own, and the line says the
    checkpoint's was not kept. The mirror and the layer compute stay this machine's: they
    follow its memory and its device, and change no number of the training."""
    ran = None if resume is None else checkpoint_plan(resume)
    if ran is None or resume is None:
        return cfg, None
    ours = resolve_plan(cfg, adapter, machine).policy
    theirs = dataclasses.replace(ran.policy, mirror=ours.mirror, compute=ours.compute)
    fits = len(theirs.layers) == adapter.num_layers and theirs.resident_layers <= len(theirs.layers)
    if theirs == ours or not fits:
        return cfg, None
    named = cfg.runtime.autopolicy.policy
    if named not in ("", "auto"):  # the user's word on this run: "fixed" or a policy file
        changes = policy_changes(ours, theirs, f"{resume.name}'s")
        return cfg, f"plan     runtime.policy {named} runs, not {resume.name}'s plan: {changes}"
    keys = Plan.runtime_keys_of(theirs) | {"bf16_mirror": cfg.runtime.layout.bf16_mirror}
    runtime = cfg.runtime.with_keys(**keys)
    # refused on several ranks
    if resident_ranks_message(runtime, runtime.launch.world) is not None:
        return cfg, None
    changes = policy_changes(theirs, ours, "the config's")
    line = f"plan     kept from {resume.name}: {changes}; runtime.policy=fixed runs the config's"
    return dataclasses.replace(cfg, runtime=runtime), line


def given_plan_line(plan: Plan, source: str, resume: Path | None) -> str | None:
    """The line a run given ``plan`` (``slidedp train --plan source``) says where it resumes
    from a checkpoint that ran another policy: the given plan runs, the checkpoint's is not
    kept (None where they agree or the checkpoint has no plan)."""
    ran = None if resume is None else checkpoint_plan(resume)
    if ran is None or resume is None:
        return None
    theirs = dataclasses.replace(ran.policy, mirror=plan.policy.mirror, compute=plan.policy.compute)
    if theirs == plan.policy:
        return None
    changes = policy_changes(plan.policy, theirs, f"{resume.name}'s")
    return f"plan     {source} runs, not {resume.name}'s plan: {changes}"


def policy_changes(runs: Policy, other: Policy, whose: str) -> str:
    """What differs between the policy that ``runs`` and ``other`` (``whose``): ``key value
    (whose value)``, comma-separated."""
    now, was = runs.to_dict(), other.to_dict()
    return ", ".join(f"{k} {now[k]} ({whose} {was[k]})" for k in now if now[k] != was[k])
