"""``F``: full-layer checkpointing. The forward saves the layer's input and keeps nothing else;
the backward replays the layer with grad from it (transformers' own module forward) and
differentiates the replay."""

from __future__ import annotations

import torch

from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations.base import LayerRun, LayerState, leaves


class FullExecutor:
    def __init__(self, policy: LayerPolicy) -> None:
        self.policy = policy

    def forward(self, run: LayerRun, x: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        with torch.no_grad():
            y, extra = run.module_forward(run.params, x)
        return y, LayerState([x], extra=extra)

    def backward(
        self,
        run: LayerRun,
        state: LayerState,
        g: torch.Tensor,
        g_extra: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        x_in = state.tensor(0).detach().requires_grad_(run.input_grad)
        params = leaves(run.params)
        with torch.enable_grad():
            out, extra = run.module_forward(params, x_in)
        return run.differentiate((out, extra), x_in, params, (g, g_extra))
