"""``N``: no checkpointing. The forward runs with grad and autograd keeps every tensor it saves
until the layer's backward, which only differentiates (no replay). Saved tensors go through
``ParamAliases``: weights are re-read from the backward's slot, activations may be offloaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations.base import (
    LayerRun,
    LayerState,
    ParamAliases,
    capture_input,
    grad_with_extra,
    leaves,
)


@dataclass
class _Graph:
    out: GradientEdge  # the layer output's edge: the graph without the output's memory
    extra: tuple[GradientEdge, ...]  # the extra outputs' edges
    box: dict[str, Any]  # capture_input's: the anchor, then the input's gradient
    leaves: dict[str, torch.Tensor]  # the forward's parameter leaves (the slot it ran on)
    aliases: ParamAliases


class NoCheckpointExecutor:
    def __init__(self, policy: LayerPolicy) -> None:
        self.policy = policy

    def forward(self, run: LayerRun, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        x_in, box = capture_input(x)
        params = leaves(run.params)
        aliases = ParamAliases({id(p): n for n, p in params.items()}, run.shared_ids())
        with torch.enable_grad(), saved_tensors_hooks(aliases.pack, aliases.unpack):
            out, extra = run.module_forward(params, x_in)
        aliases.forget_packed()
        edges = tuple(get_gradient_edge(e) for e in extra)
        graph = _Graph(get_gradient_edge(out), edges, box, params, aliases)
        detached = tuple(e.detach() for e in extra)
        return out.detach(), LayerState(aliases.tensors, data=graph, extra=detached)

    def backward(
        self,
        run: LayerRun,
        state: LayerState,
        g: torch.Tensor,
        g_extra: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        graph: _Graph = state.data
        graph.aliases.params = run.params  # the weights as the backward's slot holds them
        inputs = (graph.box["anchor"], *graph.leaves.values())
        grads = grad_with_extra(graph.out, graph.extra, inputs, g, g_extra)
        state.data = None  # the graph is consumed
        return graph.box.pop("g"), dict(zip(graph.leaves, grads[1:], strict=True))
