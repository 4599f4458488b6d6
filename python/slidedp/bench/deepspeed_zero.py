"""The DeepSpeed peers: ZeRO-3 offloading parameters and optimizer, or the optimizer only; ZeRO-2.

``zero_config`` follows DeepSpeed's and transformers' fine-tuning guides (BF16 compute, FP32
master in the optimizer, pinned offload, buckets sized from the hidden size as transformers'
``auto`` values are, AdamW with our hyperparameters, ``gradient_clipping`` at our
``train.max_grad_norm``); every key can be overridden with ``--peer-set``. The model is built as
the FSDP2 baseline builds it, then handed to ``deepspeed.initialize``; each rank trains its rows
of the global batch, bound to its share of the host's cores. Invariant: DeepSpeed's CPU Adam is
built in the bench's own temporary directory (``extensions_dir``), so a killed build's lock
never blocks a later run.

Example::

    result = run_zero(spec)  # a RunSpec with system "zero3-offload", "zero3-optim-offload", ...
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp.bench.fsdp2 import enable_checkpointing
from slidedp.bench.measure import RunSpec, synthetic_tokens, timed_steps
from slidedp.bench.peers import merged, require
from slidedp.config import TrainSection
from slidedp.runtime.dist import Dist, rank_device
from slidedp.runtime.launch import free_port

# each peer's ZeRO stage and whether its parameters are offloaded too
STAGES = {"zero3-offload": (3, True), "zero3-optim-offload": (3, False), "zero-offload": (2, False)}
LARGE = int(1e9)  # transformers' guide: sub_group_size, max live parameters, reuse distance


def zero_config(
    stage: int,
    train: TrainSection,
    batch: int,
    hidden: int,
    overrides: dict[str, Any] | None = None,
    *,
    world: int = 1,
    offload_param: bool | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO ``stage`` (3: parameters and optimizer offloaded, or
    ``offload_param=False`` the optimizer only; 2: the optimizer) for ``world`` GPUs at ``batch``
    sequences each, with ``overrides`` merged in."""
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": pinned_cpu,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": hidden * hidden,
    }
    if stage == 3:
        if offload_param is not False:
            zero["offload_param"] = pinned_cpu
        zero |= {
            "sub_group_size": LARGE,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": LARGE,
            "stage3_max_reuse_distance": LARGE,
        }
    else:
        zero |= {"allgather_partitions": True, "allgather_bucket_size": hidden * hidden}
    config = {
        "train_batch_size": world * batch,
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": train.max_grad_norm,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": train.learning_rate,
                "betas": [train.adam_beta1, train.adam_beta2],
                "eps": train.adam_epsilon,
                "weight_decay": train.weight_decay,
            },
        },
        "zero_optimization": zero,
        "steps_per_print": LARGE,
        "wall_clock_breakdown": False,
    }
    return merged(config, overrides or {})


def extensions_dir(bench_dir: Path) -> Path:
    """``TORCH_EXTENSIONS_DIR`` for DeepSpeed's just-in-time ops: ``bench_dir/torch_extensions``,
    without the build locks a killed run left there. torch's lock (``FileBaton``: an empty file,
    its path) names no owner, so in a shared directory (``~/.cache/torch_extensions``) a stale
    lock cannot be told from another process's build; in this one it can: the bench runs one
    system at a time, each run's whole process group gone before the next starts
    (``runtime.lifetime.stop_group``), and a DeepSpeed peer is one process, so when it starts no
    other process can be building here and every lock is stale."""
    root = bench_dir / "torch_extensions"
    for lock in root.glob("*/lock"):
        lock.unlink(missing_ok=True)
    return root


def _rendezvous_alone() -> None:
    """The variables ``deepspeed.init_distributed`` reads, for one process on one GPU."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
        LOCAL_RANK="0",
    )  # fmt: skip


def bind_cores(local_rank: int, local_world: int) -> list[int]:
    """Binds this process to its share of the cores it may use (``local_rank``'s slice of
    ``local_world`` equal slices, as DeepSpeed's ``--bind_cores_to_rank``) and sizes torch's
    threads to it; returns the cores."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // local_world)
    mine = cores[local_rank * share : (local_rank + 1) * share] or cores[-share:]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine


def _join(spec: RunSpec, deepspeed: Any) -> tuple[torch.device, int, int, int]:
    """(device, rank, world, cores) of this process, its process group joined."""
    ctx = Dist.from_env()  # launched ranks, or None: one process
    device, rank, world = torch.device(spec.device), 0, 1
    if ctx is None:
        _rendezvous_alone()
        cores = len(os.sched_getaffinity(0))
    else:
        rank, world = ctx.rank, ctx.world
        device = torch.device(spec.device) if spec.device != "cuda" else rank_device(ctx, "cuda")
        cores = len(bind_cores(ctx.local_rank, ctx.local_world))
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    return device, rank, world, cores


def run_zero(spec: RunSpec) -> dict[str, Any]:
    """Timed steps of a DeepSpeed ZeRO peer: forward, ``engine.backward``, ``engine.step``."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir(Path(spec.config_dir)))
    deepspeed: Any = require(spec.system, spec.device)
    deepspeed.utils.logger.setLevel(logging.WARNING)  # not its config dump and per-step lines
    device, rank, world, cores = _join(spec, deepspeed)
    train = TrainSection(**spec.ours["train"])
    config = AutoConfig.from_pretrained(spec.config_dir)
    stage, offload_param = STAGES[spec.system]
    ds_config = zero_config(stage, train, spec.batch, int(config.hidden_size), spec.peer,
                            world=world, offload_param=offload_param)  # fmt: skip
    torch.manual_seed(spec.seed)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.train()
    enable_checkpointing(model)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    steps = spec.warmup + spec.steps
    tokens = synthetic_tokens(
        int(config.vocab_size), spec.global_batch, spec.seq_len, steps, spec.seed
    )[:, rank * spec.batch : (rank + 1) * spec.batch]  # [steps, B, S]: this rank's rows
    losses: list[float] = []

    def step(t: int) -> None:
        ids = tokens[t].to(device)
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))

    try:
        times = timed_steps(step, warmup=spec.warmup, steps=spec.steps, device=device)
    finally:
        if world == 1:  # launched ranks: bench.ranks leaves the group
            torch.distributed.destroy_process_group()
    return {
        "step_times_s": times,
        "tokens_per_step": spec.global_batch * spec.seq_len,
        "losses": losses[spec.warmup :],
        "kernels": "eager (transformers' model, HF gradient checkpointing)",
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "peer_config": ds_config,
        "cores_per_rank": cores,
    }
