"""The DeepSpeed peers: ZeRO-3 with parameter and optimizer offload, ZeRO-2 with optimizer offload.

Configured as DeepSpeed's and transformers' DeepSpeed guides recommend for fine-tuning
(``zero_config``): BF16 compute with FP32 master weights in the optimizer, offload to pinned host
memory, ``overlap_comm``, ``contiguous_gradients``, the buckets sized from the hidden size as
transformers' ``auto`` values are (``hidden²`` reduce bucket, ``0.9·hidden²`` prefetch bucket,
``10·hidden`` persistence threshold), ``sub_group_size`` and the live/reuse limits at 1e9. The
optimizer section is AdamW with our hyperparameters: with the optimizer offloaded DeepSpeed
builds ``DeepSpeedCPUAdam`` (the result records the class it built). Clipping is DeepSpeed's
``gradient_clipping`` at our ``train.max_grad_norm`` (0: off). Every key can be overridden with
``--peer-set zero3-offload.zero_optimization.KEY=VALUE`` (any path of the config), and several
settings compared in one bench as variants (``zero3-offload:LABEL``, ``bench.peers``).

The model is built as the FSDP2 baseline builds it (HF from the config, FP32, the same seed, HF
activation checkpointing per layer) on the host, then handed to ``deepspeed.initialize``, which
casts it to BF16, moves it to the GPU and partitions it (no ``zero.Init``: that would draw other
initial weights on the GPU). The loss is the model's own (full logits). One process: the
rendezvous variables DeepSpeed reads are set here (a free localhost port); NCCL on CUDA, gloo on
CPU (DeepSpeed's CPU accelerator: the same code runs in the tests without a GPU).

DeepSpeed compiles its CPU Adam on first use (``scripts/peers.sh`` installs it with
``DS_BUILD_OPS=0``), under a build lock file that a run killed mid-build leaves behind; the next
run would wait on it forever. The ops are built in the bench's own temporary directory
(``extensions_dir``): once per ``slidedp bench train``, its first DeepSpeed run paying for the
build, every later one (either stage, any variant) loading it (the GPU machines start bare, so a
user-wide cache would not have kept it either).

Example::

    config = zero_config(3, train, batch=16, hidden=2560)
    result = run_zero(spec)  # a RunSpec with system="zero3-offload" or "zero-offload"
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
from slidedp.runtime.launch import free_port

STAGES = {"zero3-offload": 3, "zero-offload": 2}
LARGE = int(1e9)  # transformers' guide: sub_group_size, max live parameters, reuse distance


def zero_config(
    stage: int,
    train: TrainSection,
    batch: int,
    hidden: int,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO ``stage`` (3: parameters and optimizer offloaded; 2: the
    optimizer) for one GPU at ``batch`` sequences, with ``overrides`` merged in."""
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": pinned_cpu,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": hidden * hidden,
    }
    if stage == 3:
        zero |= {
            "offload_param": pinned_cpu,
            "sub_group_size": LARGE,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": LARGE,
            "stage3_max_reuse_distance": LARGE,
        }
    else:
        zero |= {"allgather_partitions": True, "allgather_bucket_size": hidden * hidden}
    config = {
        "train_batch_size": batch,
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


def run_zero(spec: RunSpec) -> dict[str, Any]:
    """Timed steps of a DeepSpeed ZeRO peer: forward, ``engine.backward``, ``engine.step``."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir(Path(spec.config_dir)))
    deepspeed: Any = require(spec.system, spec.device)
    deepspeed.utils.logger.setLevel(logging.WARNING)  # not its config dump and per-step lines
    device = torch.device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    _rendezvous_alone()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    train = TrainSection(**spec.ours["train"])
    config = AutoConfig.from_pretrained(spec.config_dir)
    ds_config = zero_config(
        STAGES[spec.system], train, spec.batch, int(config.hidden_size), spec.peer
    )
    torch.manual_seed(spec.seed)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.train()
    enable_checkpointing(model)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    steps = spec.warmup + spec.steps
    tokens = synthetic_tokens(int(config.vocab_size), spec.batch, spec.seq_len, steps, spec.seed)
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
        torch.distributed.destroy_process_group()
    return {
        "step_times_s": times,
        "tokens_per_step": spec.batch * spec.seq_len,
        "losses": losses[spec.warmup :],
        "kernels": "eager (transformers' model, HF gradient checkpointing)",
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "peer_config": ds_config,
    }
