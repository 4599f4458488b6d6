"""2 GPUs splitting every sequence (``runtime.context_parallel: 2``, NCCL all-to-all) against
1 GPU reading the rows whole, bf16, 100 steps.

Run on a 2-GPU machine: ``pytest -m multi_gpu tests/multirank/test_gpu_context.py -s``.
Tolerance: the engine's bf16 bound (max |Δloss| <= 1e-3, tests/multirank/test_gpu_ranks.py):
both runs compute in bf16; the split run's attention is the same SDPA call on the gathered
heads, its gradient the sum of two shards' in another order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.cli import main

pytestmark = pytest.mark.e2e  # every test here trains end to end

STEPS = 100


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_splitting_each_sequence_track_one(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=4)
    # rows up to the tiny model's max_position_embeddings (128)
    data = write_data(tmp_path / "data.jsonl", STEPS * 4, min_len=64, max_len=128)
    train = {"max_steps": STEPS, "global_batch_size": 4, "learning_rate": 1e-4,
             "max_grad_norm": 1.0, "dtype": "bfloat16"}  # fmt: skip
    # what context parallelism is checked with: eager layers, not compiled, a fixed layout
    runtime = {"device": "cuda", "kernels": "eager", "compile": False, "policy": "fixed"}
    losses = []
    for gpus in (1, 2):
        out = tmp_path / f"g{gpus}"
        split = {"gpus": gpus, "context_parallel": gpus}
        config = write_config(tmp_path / f"{gpus}.yaml", model, data, out, train=train,
                              data={"seq_len": 128}, runtime=runtime | split,
                              output={"tensorboard": False})  # fmt: skip
        assert main(["train", str(config)]) == 0
        losses.append(torch.tensor([m["loss"] for m in read_metrics(out)]))
    delta = (losses[0] - losses[1]).abs().max().item()
    print(f"context_parallel=2: max |dloss| {delta:.2e} over {STEPS} steps")
    assert delta <= 1e-3
