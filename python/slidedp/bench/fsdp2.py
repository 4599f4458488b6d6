"""The FSDP2 baselines: how one would fine-tune the model with stock PyTorch.

The HF model from its config (f32 on the host), HF activation checkpointing per layer,
``fully_shard`` on every decoder layer and the root with bf16 ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy(pin_memory=True)``, fused ``torch.optim.AdamW`` on the host parameters,
``clip_grad_norm_`` at our ``train.max_grad_norm``; the model's own loss (full logits). One
process or ``spec.world`` ranks (``bench.ranks``), rank ``r`` on rows ``[r*B, (r+1)*B)``.
Invariant: each of ``world`` GPU ranks runs its host AdamW on cores / ``world`` threads (torch's
default oversubscribes the host, torchrun's starves it).

Example::

    result = run_fsdp2(spec)  # a RunSpec with system="fsdp2"
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp.bench.measure import RunSpec, synthetic_tokens, timed_steps
from slidedp.config import TrainSection
from slidedp.runtime.dist import Dist, rank_device
from slidedp.runtime.launch import free_port


def enable_checkpointing(model: Any) -> None:
    """HF activation checkpointing per decoder layer, non-reentrant (FSDP2 and DeepSpeed's
    ZeRO-3 hooks want it)."""
    non_reentrant = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (old name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)


def build_fsdp2_model(
    config: Any, device: torch.device, world: int = 1, offload: bool = True
) -> nn.Module:
    """The HF model, checkpointed per layer, fully sharded over ``world`` ranks, with CPU offload
    or (``offload=False``) every state on ``device``, where ``fully_shard`` moves it (process
    group up)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415  the FSDP2 peer only
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415  the FSDP2 peer only

    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.train()
    enable_checkpointing(model)
    mesh = init_device_mesh(device.type, (world,))
    policies: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    if offload:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, **policies)
    fully_shard(model, **policies)
    return cast(nn.Module, model)


def _join_alone(device: torch.device) -> None:
    """A process group of this process alone (FSDP2 needs one even on one GPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )


def run_fsdp2(spec: RunSpec) -> dict[str, Any]:
    """Timed steps of the FSDP2 baseline: forward, backward, clip, fused AdamW on the host
    (``fsdp2-resident``: on the GPU)."""
    ctx = Dist.from_env()  # launched ranks, or None: one process
    if ctx is None:
        device, rank, world = torch.device(spec.device), 0, 1
        _join_alone(device)
    else:  # the group is left by bench.ranks (a failed rank must not wait in its teardown)
        device, rank, world = rank_device(ctx, spec.device), ctx.rank, ctx.world
        ctx.init(device, timeout_s=spec.ours["runtime"]["version_timeout_s"])
        if device.type == "cuda":  # (on CPU rank_device has shared the cores already)
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
    train = TrainSection(**spec.ours["train"])
    try:
        config = AutoConfig.from_pretrained(spec.config_dir)
        torch.manual_seed(spec.seed)
        model = build_fsdp2_model(config, device, world, offload=spec.system == "fsdp2")
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=train.learning_rate,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_epsilon,
            weight_decay=train.weight_decay,
            fused=True,
        )
        steps = spec.warmup + spec.steps
        tokens = synthetic_tokens(
            int(config.vocab_size), spec.global_batch, spec.seq_len, steps, spec.seed
        )[:, rank * spec.batch : (rank + 1) * spec.batch]  # [steps, B, S]: this rank's rows
        losses: list[float] = []

        def step(t: int) -> None:
            ids = tokens[t].to(device)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            if train.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))

        times = timed_steps(step, warmup=spec.warmup, steps=spec.steps, device=device)
    finally:
        if ctx is None:
            dist.destroy_process_group()
    return {
        "step_times_s": times,
        "tokens_per_step": spec.global_batch * spec.seq_len,
        "losses": losses[spec.warmup :],
        "kernels": "eager (transformers' model, HF gradient checkpointing)",
    }
