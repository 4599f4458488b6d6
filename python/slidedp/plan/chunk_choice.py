"""The chunk stage of ``runtime.policy: auto`` on one GPU: the H2D/D2H chunk size
(``runtime.chunk_elems``) and the gradient ring that goes with it (``runtime.grad_slots``), from
the chunk probe (``profile.chunks``, with the run's BF16 mirror or without it), taken before
the layout is solved, as the paper takes routes and chunks first (§3.6).

A candidate's cost is its measured ``step_s``: the host side of layers streamed as a backward
streams them (loads, gradients back, their AdamW). The whole layer (``chunk_elems`` 0, the
fixed default) is kept unless a chunk is ``MIN_GAIN`` faster: the probe's own noise must not
move the run off the default. A chosen chunk keeps the ring's bytes: ``grad_slots`` whole
layers of the config cut into chunks (``profile.chunks.ring_slots``).

The step-time model has no chunk term: the chunk changes when a layer's update may start and
how many passes it takes, not the lanes' rates, and the probe measures that directly.
Validation (``plan.validate``) runs the choice, chunk included, against the default, whole
layers.

Example::

    choice = choose_chunk(report, grad_slots=4)
    choice.chunk_elems, choice.grad_slots, choice.describe()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slidedp.profile.chunks import BF16_BYTES, ring_slots

if TYPE_CHECKING:
    from slidedp.config import TrainConfig

MIN_GAIN = 0.05  # the H100's probe read candidates up to ~10% apart by noise (BENCHMARKS.md)


@dataclass(frozen=True)
class ChunkChoice:
    chunk_elems: int  # 0: the whole layer
    grad_slots: int
    cost_s: float  # the chosen candidate's measured host side (``step_s``)
    default_s: float  # the whole layer's
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
    if float(best["step_s"]) > default * (1 - MIN_GAIN):
        return ChunkChoice(0, grad_slots, default, default, source)
    chunk = int(best["chunk_elems"])
    slots = ring_slots(chunk, int(report["layer_numel"]), grad_slots)
    return ChunkChoice(chunk, slots, float(best["step_s"]), default, source)


def with_chunk(cfg: TrainConfig, chunk: ChunkChoice | None) -> TrainConfig:
    """``cfg`` with ``chunk``'s chunk and gradient ring (unchanged for None or the whole
    layer)."""
    if chunk is None or chunk.is_default:
        return cfg
    runtime = dataclasses.replace(cfg.runtime, chunk_elems=chunk.chunk_elems,
                                  grad_slots=chunk.grad_slots)  # fmt: skip
    return dataclasses.replace(cfg, runtime=runtime)
