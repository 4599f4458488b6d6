"""``S<mask>``: segment checkpointing. The layer runs as one checkpoint region per span between
saved boundaries (``segments.BOUNDARIES``; non-reentrant ``torch.utils.checkpoint``): the
forward keeps the layer input and the state at every boundary the mask sets, nothing inside a
span. The backward replays a span when it first needs one of the span's tensors, and the
replay stops as soon as every tensor the span's backward needs is back (torch's early stop):
an operator whose output nobody needs is not run again — e.g. ``down_proj`` at the end of the
MLP, or ``up_proj`` when the gate/up outputs (b4) are saved. A span reads its start state
and the weights when it replays, from the backward's slot and from reloaded tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations.base import KeptGraph, LayerRun, LayerState, leaves
from slidedp.runtime.activations.segments import SEGMENTS, run_segments


@dataclass
class _Spans:
    graph: KeptGraph
    params: dict[str, torch.Tensor]  # what a replay binds (the backward's slot)
    states: list[tuple[int, ...]] = field(default_factory=list)  # start states, into ``inputs``
    inputs: list[torch.Tensor | None] = field(default_factory=list)  # a replay's start tensors


class SegmentExecutor:
    def __init__(self, policy: LayerPolicy) -> None:
        self.policy = policy
        saved = [k for k, bit in enumerate(policy.arg) if bit == "1"]
        # a span starts after each saved boundary; the last runs to the end of the layer
        self.starts = [0] + [k + 1 for k in saved]

    def forward(self, run: LayerRun, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        module = run.adapter.layer_module(run.layer)
        graph, x_in = KeptGraph.start(x, run.params)
        spans = _Spans(graph, graph.leaves)
        tensors: list[torch.Tensor | None] = []
        index: dict[int, int] = {}
        ends = [*self.starts[1:], len(SEGMENTS)]

        def replay(span: int, first: int, last: int) -> tuple[torch.Tensor, ...]:
            start = []
            for k in spans.states[span]:
                t = spans.inputs[k]
                assert t is not None, "a saved boundary is still on the host"
                start.append(t)
            return run_segments(module, spans.params, tuple(start), run.ctx, run.layer, first, last)

        state: tuple[torch.Tensor, ...] = (x_in,)
        with torch.enable_grad():
            for span, (first, end) in enumerate(zip(self.starts, ends, strict=True)):
                for t in state:  # the span's start state, each tensor once
                    if id(t) not in index:
                        index[id(t)] = len(tensors)
                        tensors.append(t)
                spans.states.append(tuple(index[id(t)] for t in state))
                spans.inputs = list(tensors)
                state = checkpoint(replay, span, first, end - 1, use_reentrant=False)
        spans.inputs = []
        y, _ = graph.close(state[0])
        return y, LayerState(tensors, data=spans)

    def backward(
        self,
        run: LayerRun,
        state: LayerState,
        g: torch.Tensor,
        g_extra: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        assert not g_extra, "segments cut dense layers only: no extra outputs"
        spans: _Spans = state.data
        # a replay starts from leaves that require grad, as the forward's tensors did
        spans.inputs = [
            state.tensor(k).detach().requires_grad_(True) for k in range(len(state.tensors))
        ]
        spans.params = leaves(run.params)
        state.data = None
        return spans.graph.differentiate(run, g, ())
