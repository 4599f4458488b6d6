"""The BF16 parity runs' two sides, on either device: FSDP2 mixed precision (bf16 parameters,
fp32 master weights and reduction, transformers' whole model, one rank) and our trainer, on
the same model directory, data and training config.

Example::

    ref = fsdp2_losses(model_dir, data, train_config(200), device="cuda")
    ours = our_losses(tmp_path, model_dir, data, train_config(200), "cuda", layers="F-r1")
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, get_scheduler

from engine.tiny import read_metrics, reference_batches, write_config, write_data
from slidedp.config import load_config
from slidedp.runtime.trainer import Trainer

SEQ_LEN = 128


def train_config(steps: int, dtype: str = "bfloat16") -> dict[str, Any]:
    """A fine-tuning regime: new sequences every step, full-FT learning rate, clipping on."""
    return {
        "max_steps": steps,
        "global_batch_size": 8,
        "learning_rate": 1e-4,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "lr_scheduler": "cosine",
        "warmup_steps": 10,
        "dtype": dtype,
    }


def parity_data(root: Path, steps: int) -> Path:
    # Every step sees new sequences (no memorisation). At lr 1e-3 on 64 cycled sequences
    # (loss 5.6 -> 0.03 in 200 steps) both runs agree to 1e-5 for 20 steps, then rounding
    # differences are amplified by the fast memorisation (max 2.4e-2 around step 100), as
    # between any two bf16 runs; see BENCHMARKS.md.
    return write_data(root / "data.jsonl", steps * 8, min_len=64, max_len=SEQ_LEN)


def fsdp2_losses(
    model_dir: Path,
    data: Path,
    train: dict[str, Any],
    *,
    device: str,
    param_dtype: torch.dtype = torch.bfloat16,
) -> list[float]:
    """FSDP2 on one rank (NCCL on CUDA, gloo on CPU) with ``param_dtype`` compute: float32 is
    the exact trajectory the bf16 runs approximate."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = model.to(device).train()  # type: ignore[arg-type]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        named = list(model.named_parameters())
        groups = [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": train["weight_decay"]},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=train["learning_rate"])
        steps = train["max_steps"]
        sched = get_scheduler("cosine", opt, num_warmup_steps=train["warmup_steps"],
                              num_training_steps=steps)  # fmt: skip
        losses = []
        for batch in reference_batches(data, train["global_batch_size"], steps):
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["max_grad_norm"])
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses
    finally:
        dist.destroy_process_group()


def our_losses(
    tmp_path: Path,
    model_dir: Path,
    data: Path,
    train: dict[str, Any],
    name: str,
    **runtime: Any,
) -> list[float]:
    """Our trainer's losses; ``runtime`` holds ``device`` and any other runtime keys."""
    out = tmp_path / f"out-{name}"
    config = write_config(tmp_path / f"c-{name}.yaml", model_dir, data, out, train=train,
                          runtime=runtime)  # fmt: skip
    Trainer(load_config(str(config), [f"data.seq_len={SEQ_LEN}"]), log=False).run()
    return [r["loss"] for r in read_metrics(out)]


def mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def max_abs(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
