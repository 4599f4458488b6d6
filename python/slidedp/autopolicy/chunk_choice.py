"""The chunk stage of ``runtime.policy: auto`` on GPUs: the H2D/D2H chunk size
(``runtime.chunk_elems``) and its gradient ring (``runtime.grad_slots``), from the chunk probe
(``profile.chunks``), before the layout is solved.

A candidate's cost is its measured ``step_s``. Invariants: the whole layer (the default) is kept
unless a chunk is ``MIN_GAIN`` faster; a chosen chunk runs only where validation ran it faster
than the default and where the run loads as the probe did (with or without the mirror:
``with_chunk``); the ring keeps ``grad_slots`` whole layers (``profile.chunks.ring_slots``). The
step-time model has no chunk term: the probe measures the chunk's effect directly.

Example::

    choice = choose_chunk(report, grad_slots=4)
    choice.chunk_elems, choice.grad_slots, choice.describe()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slidedp.autopolicy.clock import Clock
from slidedp.autopolicy.validate import default_config
from slidedp.plan.machine import update_threads
from slidedp.plan.policy import layer_numel
from slidedp.plan.resolve import resolve_mirror
from slidedp.profile.chunks import BF16_BYTES, cached_chunks, probe_chunks, ring_slots

if TYPE_CHECKING:
    from slidedp.config import TrainConfig
    from slidedp.config_runtime import RuntimeSection
    from slidedp.models.hf import HFAdapter
    from slidedp.plan.machine import Machine

# the H100's probe read one candidate 3% faster, then 4% slower, a chunk 5.8% faster in one run and
# the whole layer fastest in the next (benchmarks/2026-11-25-autopolicy-h100.md, section "`slidedp
# plan` on the GPU")
MIN_GAIN = 0.10


@dataclass(frozen=True)
class ChunkChoice:
    chunk_elems: int  # 0: the whole layer
    grad_slots: int
    cost_s: float  # the chosen candidate's measured host side (``step_s``)
    default_s: float  # the whole layer's
    mirror: bool  # the probe's loads: from the BF16 mirror (else cast on the host)
    source: str  # "measured now" or "cached"

    @property
    def is_default(self) -> bool:
        return self.chunk_elems == 0

    def describe(self) -> str:
        if self.is_default:
            return (
                f"the whole layer (host side {self.default_s * 1e3:.1f} ms, no chunk "
                f"{1 / (1 - MIN_GAIN):.2f}x faster; {self.source})"
            )
        return (
            f"{self.chunk_elems * BF16_BYTES >> 20} MiB, {self.grad_slots} gradient slots "
            f"(host side {self.cost_s * 1e3:.1f} vs {self.default_s * 1e3:.1f} ms for the whole "
            f"layer; {self.source})"
        )


def choose_chunk(report: dict[str, Any], *, grad_slots: int) -> ChunkChoice:
    """The chunk of ``report`` (``profile.chunks``) for a run whose gradient ring holds
    ``grad_slots`` whole layers."""
    rows = report["candidates"]
    default = float(rows[0]["step_s"])
    best = min(rows, key=lambda row: float(row["step_s"]))
    source = "cached" if report.get("cached") else "measured now"
    mirror = bool(report["mirror"])
    if float(best["step_s"]) > default * (1 - MIN_GAIN):
        return ChunkChoice(0, grad_slots, default, default, mirror, source)
    chunk = int(best["chunk_elems"])
    slots = ring_slots(chunk, int(report["layer_numel"]), grad_slots)
    return ChunkChoice(chunk, slots, float(best["step_s"]), default, mirror, source)


def with_chunk(
    cfg: TrainConfig, chunk: ChunkChoice | None, adapter: HFAdapter, machine: Machine
) -> TrainConfig:
    """``cfg`` with ``chunk``'s chunk and gradient ring; unchanged for None, the whole layer,
    or a run that loads otherwise than the probe did (an offloading layout can take the
    mirror's host memory, a sharded route drop the mirror's rule)."""

    if chunk is None or chunk.is_default or resolve_mirror(cfg, adapter, machine) != chunk.mirror:
        return cfg
    runtime = cfg.runtime.with_keys(chunk_elems=chunk.chunk_elems,
                                  grad_slots=chunk.grad_slots)  # fmt: skip
    return dataclasses.replace(cfg, runtime=runtime)


def probe_terms(cfg: TrainConfig, adapter: HFAdapter, machine: Machine) -> tuple[int, int, bool]:
    """The chunk probe's layer size, update threads and mirror for ``cfg`` on ``machine``: the
    mirror of the fixed default (``runtime.policy`` cleared: the probe runs before anything is
    chosen), as the launcher's child, the stage and the selection cache's key all take it."""

    mirror = resolve_mirror(default_config(cfg), adapter, machine)
    return layer_numel(adapter), update_threads(cfg, machine), mirror


def chunk_skipped(rt: RuntimeSection, machine: Machine) -> str | None:
    """Why the chunk stage keeps the config's chunk (None: it chooses one)."""
    if machine.device != "cuda":
        return "the config's (on CPU no copy to cut)"
    if rt.layout.chunk_elems:
        return f"{rt.layout.chunk_elems:,} elements, the config's"
    # the ring a chunk cuts is the default's
    if rt.layout.grad_slots != type(rt)().layout.grad_slots:
        return f"the whole layer (the config sets runtime.grad_slots={rt.layout.grad_slots})"
    return None


def probe_chunk(
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
        choice = choose_chunk(report, grad_slots=cfg.runtime.layout.grad_slots)
        notes.append(choice.describe())
    return choice, choice.describe()
