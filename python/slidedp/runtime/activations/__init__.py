"""Activation executors, one per checkpoint family (``plan.layout``): ``full`` (F), ``segment``
(S), ``selective`` (SAC), ``none`` (N), with ``offload`` moving any of them partly to the host.
The engine, the compute-only reference and the layer profiler run layers through these objects,
and the cost model measures them (``plan.cost``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations.base import LayerRun, LayerState
from slidedp.runtime.activations.full import FullExecutor
from slidedp.runtime.activations.none import NoCheckpointExecutor
from slidedp.runtime.activations.segment import SegmentExecutor
from slidedp.runtime.activations.selective import SelectiveExecutor

__all__ = ["Executor", "LayerRun", "LayerState", "executor_for"]


class Executor(Protocol):
    policy: LayerPolicy

    def forward(self, run: LayerRun, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]: ...

    def backward(
        self,
        run: LayerRun,
        state: LayerState,
        g: torch.Tensor,
        g_extra: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]: ...


def executor_for(policy: LayerPolicy, *, measure: bool = False) -> Executor:
    """``measure``: the state also counts what the family keeps outside ``tensors`` (the cost
    model's runs; a little slower)."""
    if policy.family == "SAC":
        return SelectiveExecutor(policy, count_cache=measure)
    families: dict[str, Callable[[LayerPolicy], Executor]] = {
        "F": FullExecutor,
        "S": SegmentExecutor,
        "N": NoCheckpointExecutor,
    }
    return families[policy.family](policy)
