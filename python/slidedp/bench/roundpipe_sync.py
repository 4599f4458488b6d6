"""The RoundPipe peer in its synchronous mode (the SlideDP paper's setting).

The HF model (FP32, the common seed) cast to BF16 and wrapped by RoundPipe's Qwen3 preset with
FP32 optimizer copies; RoundPipe's CPU Adam in AdamW mode with our hyperparameters and clipping;
each step ``forward_backward`` (microbatch losses weighted by their rows: the batch's mean)
then ``step(..., is_async=False)``. ``--peer-set roundpipe.KEY=VALUE`` sets
``RoundPipeRunConfig`` fields. RoundPipe 0.1.1's preset was written for transformers 4:
``_adapt_mask_builders`` maps its mask-builder keywords onto the installed signature and
``_adapt_layers`` sets each layer's ``attention_type`` from the config; neither changes a mask
or a weight.

Example::

    result = run_roundpipe(spec)  # a RunSpec with system="roundpipe"
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp.bench.measure import RunSpec, synthetic_tokens, timed_steps
from slidedp.bench.peers import require
from slidedp.config import TrainSection

MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def _keywords_for(builder: Callable[..., Any]) -> Callable[..., Any]:
    """``builder`` (a transformers mask function) taking transformers 4's keywords too: the
    renamed ones mapped, the dropped one left out; any other mismatch still raises."""
    accepted = set(inspect.signature(builder).parameters)

    @functools.wraps(builder)
    def call(**kwargs: Any) -> Any:
        if "input_embeds" in kwargs and "input_embeds" not in accepted:
            kwargs["inputs_embeds"] = kwargs.pop("input_embeds")
        if "cache_position" not in accepted:
            kwargs.pop("cache_position", None)
        if "past_key_values" in kwargs and "cache" in accepted:  # renamed in transformers 5.24
            kwargs["cache"] = kwargs.pop("past_key_values")
        return builder(**kwargs)

    call._slidedp_adapted = True  # type: ignore[attr-defined]
    return call


def _adapt_mask_builders(preset: ModuleType) -> None:
    """The mask builders ``preset`` (a RoundPipe model module) imported, adapted in place."""
    for name in MASK_BUILDERS:
        builder = getattr(preset, name, None)
        if builder is not None and not getattr(builder, "_slidedp_adapted", False):
            setattr(preset, name, _keywords_for(builder))


def _adapt_layers(model: Any, config: Any) -> None:
    """Each decoder layer's ``attention_type`` from ``config.layer_types``, where it lacks one."""
    kinds = getattr(config, "layer_types", None)
    if kinds is None:  # no kinds in the config: nothing the preset could read
        return
    for layer, kind in zip(model.model.layers, kinds, strict=True):
        if not hasattr(layer, "attention_type"):
            layer.attention_type = kind


def run_roundpipe(spec: RunSpec) -> dict[str, Any]:
    """Timed synchronous RoundPipe steps: ``forward_backward``, then clip and AdamW on the host."""
    roundpipe: Any = require(spec.system, spec.device)
    device = torch.device(spec.device, 0)
    train = TrainSection(**spec.ours["train"])
    config = AutoConfig.from_pretrained(spec.config_dir)
    preset = f"roundpipe.models.{config.model_type}"  # its preset for this model, if any
    if importlib.util.find_spec(preset) is not None:
        _adapt_mask_builders(importlib.import_module(preset))
    torch.manual_seed(spec.seed)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model = model.to(torch.bfloat16).train()
    _adapt_layers(model, config)
    run_config = roundpipe.RoundPipeRunConfig(**spec.peer)
    wrapped = roundpipe.wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=run_config,
        optim_dtype=torch.float32,
        name="bench",
    )
    params = list(wrapped.optim_parameters())
    optimizer = roundpipe.optim.Adam(
        params,
        lr=train.learning_rate,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_epsilon,
        weight_decay=train.weight_decay,
        decoupled_weight_decay=True,
    )
    steps = spec.warmup + spec.steps
    tokens = synthetic_tokens(int(config.vocab_size), spec.batch, spec.seq_len, steps, spec.seed)
    losses: list[float] = []

    def loss_of(outputs: Any, rows: torch.Tensor) -> torch.Tensor:
        # ``rows``: this microbatch's slice of the batch's ids, split as the inputs are
        return outputs.loss * (rows.shape[0] / spec.batch)  # type: ignore[no-any-return]

    def update() -> None:
        if train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()

    def step(t: int) -> None:
        ids = tokens[t]
        loss = wrapped.forward_backward(
            input_kwargs={"input_ids": ids, "labels": ids, "return_logits": False},
            label=ids,
            loss_fn=loss_of,
        )
        wrapped.step(update, is_async=False)
        losses.append(float(loss))

    times = timed_steps(step, warmup=spec.warmup, steps=spec.steps, device=device)
    return {
        "step_times_s": times,
        "tokens_per_step": spec.batch * spec.seq_len,
        "losses": losses[spec.warmup :],
        "kernels": "RoundPipe's Qwen3 preset (transformers' layers, its compiled chunked loss)",
    }
