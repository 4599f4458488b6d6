"""``N``: no checkpointing. The forward runs with grad and autograd keeps every tensor it saves
until the layer's backward, which only differentiates (no replay). Saved tensors go through
``ParamAliases``: weights are re-read from the backward's slot, activations may be offloaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations.base import KeptGraph, LayerRun, LayerState, ParamAliases


@dataclass
class _Graph:
    graph: KeptGraph
    aliases: ParamAliases


class NoCheckpointExecutor:
    def __init__(self, policy: LayerPolicy) -> None:
        self.policy = policy

    def forward(self, run: LayerRun, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        graph, x_in = KeptGraph.start(x, run.params)
        params = graph.leaves
        aliases = ParamAliases({id(p): n for n, p in params.items()}, run.shared_ids())
        with torch.enable_grad(), saved_tensors_hooks(aliases.pack, aliases.unpack):
            out, extra = run.module_forward(params, x_in)
        aliases.forget_packed()
        y, extra = graph.close(out, extra)
        return y, LayerState(aliases.tensors, data=_Graph(graph, aliases), extra=extra)

    def backward(
        self,
        run: LayerRun,
        state: LayerState,
        g: torch.Tensor,
        g_extra: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        kept: _Graph = state.data
        kept.aliases.params = run.params  # the weights as the backward's slot holds them
        state.data = None  # the graph is consumed
        return kept.graph.differentiate(run, g, g_extra)
