"""``S<mask>``: segment checkpointing. The forward (no grad) saves the layer input and the state
at every boundary the mask sets (``segments.BOUNDARIES``); the backward replays one span
between saved boundaries at a time, from the last, and differentiates it: the replay of a span
stops at the next saved state, where the later span's gradient is already known."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations.base import LayerRun, LayerState, leaves
from slidedp.runtime.activations.segments import SEGMENTS, run_segments


@dataclass
class _Spans:
    starts: list[int]  # first segment of each span (0 = from the layer input)
    states: list[tuple[int, ...]]  # per span, its start state as indices into state.tensors


class SegmentExecutor:
    def __init__(self, policy: LayerPolicy) -> None:
        self.policy = policy
        saved = [k for k, bit in enumerate(policy.arg) if bit == "1"]
        # a span starts after each saved boundary; the last runs to the end of the layer
        self.starts = [0] + [k + 1 for k in saved]

    def forward(self, run: LayerRun, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        module = run.adapter.layer_module(run.layer)
        mask = run.ctx["masks"][run.layer]
        tensors: list[torch.Tensor | None] = []
        index: dict[int, int] = {}
        states: list[tuple[int, ...]] = []
        state: tuple[torch.Tensor, ...] = (x,)
        ends = [*self.starts[1:], len(SEGMENTS)]
        with torch.no_grad():
            for first, end in zip(self.starts, ends, strict=True):
                for t in state:  # save the span's start state (a tensor once)
                    if id(t) not in index:
                        index[id(t)] = len(tensors)
                        tensors.append(t)
                states.append(tuple(index[id(t)] for t in state))
                state = run_segments(module, run.params, state, run.ctx, mask, first, end - 1)
        return state[0], LayerState(tensors, data=_Spans(self.starts, states))

    def backward(
        self, run: LayerRun, state: LayerState, g: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        spans: _Spans = state.data
        module = run.adapter.layer_module(run.layer)
        mask = run.ctx["masks"][run.layer]
        ends = [*spans.starts[1:], len(SEGMENTS)]
        grads: dict[str, torch.Tensor] = {}
        g_state: tuple[torch.Tensor, ...] = (g,)
        for first, end, idx in reversed(list(zip(spans.starts, ends, spans.states, strict=True))):
            start = tuple(state.tensor(k).detach().requires_grad_(True) for k in idx)
            params = leaves(run.params)
            with torch.enable_grad():
                out = run_segments(module, params, start, run.ctx, mask, first, end - 1)
            got = torch.autograd.grad(out, (*start, *params.values()), g_state, allow_unused=True)
            g_state = tuple(got[: len(start)])
            for name, gp in zip(params, got[len(start) :], strict=True):
                if gp is not None:
                    grads[name] = gp if name not in grads else grads[name] + gp
        assert len(g_state) == 1, "the first span starts from the layer input alone"
        return g_state[0], {name: grads[name] for name in run.params}
