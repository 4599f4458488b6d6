"""``runtime.policy: auto``: a run chooses its own activation layout (and resident layers, its
H2D/D2H chunk, and on several GPUs of one host its routes) before it starts, through the same
pipeline as ``slidedp plan`` (``autopolicy.choose``), and trains with them:
``resolve_auto(cfg, adapter, machine, measure=...)`` returns the config with the chosen
``runtime`` keys and the banner line. A selection is cached (``selection_cache``) and a later
run of the same key takes it without measuring; a resumed run keeps its checkpoint's layout and
routes. ``validate`` and ``estimate`` use caches only (docs/architecture.md, "AutoPolicy").

Example: ``cfg, line = resolve_auto(cfg, adapter, machine, measure=True)``
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from slidedp.autopolicy.choose import ChooseSpec, choose
from slidedp.errors import ConfigError

if TYPE_CHECKING:
    from slidedp.config import TrainConfig
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.plan.machine import Machine

AUTO = "auto"
# the keys auto writes (and routes)
CHOSEN = ("layers", "offload_ratio", "resident_layers", "resident_embeddings")


def check_one_process(rt: RuntimeSection, what: str) -> None:
    """``slidedp plan`` profiles and budgets one process's share of the batch on one device (a
    launcher such as torchrun says how many processes run in ``WORLD_SIZE``)."""
    if rt.launch.world > 1 or rt.launch.nodes > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"{what} chooses the layout of one process for now: for several ranks or nodes "
            "write runtime.layers by hand (slidedp estimate checks it), or let "
            "`slidedp train` choose with runtime.policy=auto (one host)"
        )


def check_auto_launch(rt: RuntimeSection) -> None:
    """``auto`` chooses once, before any rank starts (``slidedp train``'s launcher, the bench's):
    a rank started by another launcher (torchrun: ``WORLD_SIZE``) cannot, and several nodes
    would each choose for themselves."""
    if rt.launch.nodes > 1:
        raise ConfigError(
            "runtime.policy=auto chooses for the GPUs of one host, not for "
            f"{rt.launch.nodes} nodes: "
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
    fixed = [k for k in CHOSEN if rt.get(k) != type(rt)().get(k)]
    if fixed:
        raise ConfigError(
            f"runtime.policy=auto chooses runtime.layers, their offload and the GPU-resident "
            f"layers and embeddings, which the config "
            f"sets ({', '.join(f'{k}={rt.get(k)}' for k in fixed)}): keep one of them"
        )


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
    without ``auto``): ``choose`` with ``runtime.policy: auto``'s spec. ``measure``: profile
    the layer when it is not cached (else check the default layout), validate, take and write
    the selection cache; on several ranks every measurement runs in a child process.
    ``resume``: the checkpoint a run continues from keeps the layout, chunk and routes it ran
    with. ``routes_fixed``: True keeps the config's routes, False lets auto choose both, None
    (``train``) keeps each route key the config sets to another value than its default."""

    rt = cfg.runtime
    if rt.autopolicy.policy != AUTO:
        return cfg, None
    check_auto_launch(rt)
    check_auto_free(rt)
    spec = ChooseSpec(measure=measure, read_cache=True, write_cache=measure, resume=resume,
                      routes_fixed=routes_fixed)  # fmt: skip
    _, report = choose(cfg, adapter, machine, spec)
    return report.cfg, report.line
