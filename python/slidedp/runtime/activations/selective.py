"""``SAC.<preset>``: selective activation checkpointing through ``torch.utils.checkpoint``
(non-reentrant, ``create_selective_checkpoint_contexts``): the forward runs the layer inside a
checkpoint region that keeps the outputs of the preset's operators and the layer input; the
backward's replay recomputes the rest and reuses the kept outputs. The replay reads the input
and the weights from ``_Region`` at replay time, so it runs on the backward's slot and on a
reloaded input. Offloadable: the layer input (torch keeps the operator outputs in the region's
cache, which has no public hook; they count as ``retained_bytes``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from slidedp.models.tiled_mlp import TILING
from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations.base import KeptGraph, LayerRun, LayerState, leaves

_MATMULS = ("mm", "addmm", "bmm", "matmul", "linear")
_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def _op_name(op: Any) -> str:
    return str(getattr(op, "__name__", op)).split(".")[0]


def _saves(preset: str) -> Callable[[str], bool]:
    if preset == "mm":
        return lambda name: name in _MATMULS
    if preset == "attn":
        return lambda name: "scaled_dot_product" in name
    if preset == "noact":
        return lambda name: name not in _ACTIVATIONS
    raise ValueError(f"unknown SAC preset {preset!r}")


def _meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    if isinstance(a, torch.device):
        return torch.device("meta")
    if isinstance(a, list | tuple):
        return type(a)(_meta(b) for b in a)
    return a


def _output_bytes(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of ``op``'s output, from the op run on meta copies of its arguments (shapes
    only: nothing is computed or allocated)."""
    out = op(*_meta(args), **{k: _meta(v) for k, v in kwargs.items()})
    outs = out if isinstance(out, tuple | list) else (out,)
    return sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))


@dataclass
class _Region:
    graph: KeptGraph
    x: torch.Tensor | None  # the input the replay starts from (None while offloaded)
    params: dict[str, torch.Tensor]  # what the replay binds
    cache_bytes: int = 0


class SelectiveExecutor:
    """``count_cache``: add up the bytes of the kept operator outputs (``retained_bytes``; the
    cost model's meta runs): each kept operator then runs once more on meta copies, which a
    training step has no use for."""

    def __init__(self, policy: LayerPolicy, *, count_cache: bool = False) -> None:
        self.policy, self.count_cache = policy, count_cache
        saves = _saves(policy.arg)
        # a view (of a weight, say) costs nothing to recompute, and a saved view of a slot
        # would outlive the slot's contents
        self._keep = functools.cache(
            lambda op: saves(_op_name(op)) and not getattr(op, "is_view", False)
        )

    def _context(self, region: _Region) -> Any:
        keep, count = self._keep, self.count_cache

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if not keep(op) or TILING.forward:  # a tiled MLP keeps nothing of its tiles
                return CheckpointPolicy.PREFER_RECOMPUTE
            if count and not ctx.is_recompute:
                region.cache_bytes += _output_bytes(op, args, kwargs)
            return CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(policy_fn)  # type: ignore[no-untyped-call]

    def forward(self, run: LayerRun, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        graph, x_in = KeptGraph.start(x, run.params)
        region = _Region(graph, x_in, graph.leaves)

        def replay() -> tuple[torch.Tensor, ...]:
            assert region.x is not None, "the layer input is still on the host"
            # eager even when layers are compiled: the policy must see every operator, and an
            # inductor kernel reusing a buffer mutates what the policy cached (torch refuses)
            out, extra = run.module_forward(region.params, region.x, eager=True)
            return (out, *extra)

        with torch.enable_grad():
            out, *extra = checkpoint(
                replay,
                use_reentrant=False,
                context_fn=functools.partial(self._context, region),
            )
        y, kept = graph.close(out, extra)
        region.x = None  # state.tensors holds it (offloadable)
        return y, LayerState([x], retained_bytes=region.cache_bytes, data=region, extra=kept)

    def backward(
        self,
        run: LayerRun,
        state: LayerState,
        g: torch.Tensor,
        g_extra: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        region: _Region = state.data
        region.x = state.tensor(0).detach().requires_grad_(True)
        region.params = leaves(run.params)  # the replay reads the backward's slot
        state.data = None
        return region.graph.differentiate(run, g, g_extra)
