"""Learning-rate schedules: transformers' own ``get_scheduler`` lambdas, evaluated per step.

The value used at 0-based step ``t`` is ``learning_rate * lambda(t)``: what HF Trainer's
optimizer sees at its ``t``-th ``optimizer.step()`` (the scheduler steps after the optimizer).
``constant`` with ``warmup_steps > 0`` is transformers' ``constant_with_warmup``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import get_scheduler

_NAMES = {"constant": "constant", "linear": "linear", "cosine": "cosine"}


def lr_schedule(
    name: str, learning_rate: float, warmup_steps: int, max_steps: int
) -> Callable[[int], float]:
    """``step -> lr`` for the 0-based optimizer step."""
    hf_name = _NAMES[name]
    if hf_name == "constant" and warmup_steps > 0:
        hf_name = "constant_with_warmup"
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=learning_rate)
    scheduler = get_scheduler(
        hf_name, dummy, num_warmup_steps=warmup_steps, num_training_steps=max_steps
    )
    lam = scheduler.lr_lambdas[0]

    def lr_at(step: int) -> float:
        return float(learning_rate * lam(step))

    return lr_at
