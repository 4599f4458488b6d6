"""BF16 on one GPU against FSDP2 mixed precision (bf16 params, fp32 master and reduction).

Run on the GPU machine: ``pytest -m "gpu and slow" tests/engine/test_gpu_parity.py``; set
``SLIDEDP_PARITY_JSON=FILE`` to keep both loss curves.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3Config

from engine.tiny import read_metrics, reference_batches, write_config, write_data
from slidedp.config import load_config
from slidedp.runtime.trainer import Trainer

STEPS = 200
TRAIN: dict[str, Any] = {
    "max_steps": STEPS,
    "global_batch_size": 8,
    "learning_rate": 1e-4,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "lr_scheduler": "cosine",
    "warmup_steps": 10,
    "dtype": "bfloat16",
}


def _small_qwen3(root: Path) -> Path:
    config = Qwen3Config(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = root / "qwen3-small"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # type: ignore[no-untyped-call]
    return path


def _fsdp2_losses(model_dir: Path, data: Path) -> list[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = model.cuda().train()  # type: ignore[call-arg]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        named = list(model.named_parameters())
        groups = [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": TRAIN["weight_decay"]},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=TRAIN["learning_rate"])
        from transformers import get_scheduler

        sched = get_scheduler("cosine", opt, num_warmup_steps=10, num_training_steps=STEPS)
        losses = []
        for batch in reference_batches(data, TRAIN["global_batch_size"], STEPS):
            loss = model(**{k: v.cuda() for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["max_grad_norm"])
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.slow
def test_bf16_losses_track_fsdp2_mixed_precision(tmp_path: Path) -> None:
    model_dir = _small_qwen3(tmp_path)
    # A fine-tuning regime: every step sees new sequences (no memorisation), full-FT learning
    # rate. At lr 1e-3 on 64 cycled sequences (loss 5.6 -> 0.03 in 200 steps) both runs agree to
    # 1e-5 for 20 steps, then rounding differences are amplified by the fast memorisation (max
    # 2.4e-2 around step 100), as between any two bf16 runs; see BENCHMARKS.md.
    data = write_data(tmp_path / "data.jsonl", STEPS * 8, min_len=64, max_len=128)
    runs = {}
    for mirror in (False, True):  # cast on delivery, and the BF16 mirror written by AdamW
        out = tmp_path / f"out-{mirror}"
        config = write_config(
            tmp_path / f"c-{mirror}.yaml",
            model_dir,
            data,
            out,
            train=TRAIN,
            runtime={"device": "cuda", "offload_ratio": 1, "bf16_mirror": mirror},
        )
        Trainer(load_config(str(config), ["data.seq_len=128"]), log=False).run()
        runs[mirror] = [r["loss"] for r in read_metrics(out)]
    assert runs[True] == runs[False], "the mirror is the same rounding as the cast"
    ours = runs[True]
    ref = _fsdp2_losses(model_dir, data)
    deltas = [abs(a - b) for a, b in zip(ours, ref, strict=True)]
    summary = {
        "steps": STEPS,
        "max_abs_delta_loss": max(deltas),
        "mean_abs_delta_loss": sum(deltas) / len(deltas),
        "first_loss": [ours[0], ref[0]],
        "last_loss": [ours[-1], ref[-1]],
        "ours": ours,
        "fsdp2": ref,
    }
    if path := os.environ.get("SLIDEDP_PARITY_JSON"):
        Path(path).write_text(json.dumps(summary))
    print({k: v for k, v in summary.items() if k not in ("ours", "fsdp2")})
    # The paper reports 5.2e-4 against FSDP2; the bound is 1e-3 over >= 200 steps.
    assert max(deltas) <= 1e-3
