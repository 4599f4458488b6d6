"""GPU-resident layers and embeddings on 2 GPUs (NCCL, BF16) against the 2-GPU all-host run: each
owner updates its groups with the compiled device pass instead of the host kernel and broadcasts
the weights on its update stream, so the runs differ by that pass's rounding only and must track
each other within the bf16 bound of tests/multirank/test_gpu_ranks.py (max |dloss| <= 1e-3).

Run on a 2-GPU machine: ``pytest -m multi_gpu tests/multirank/test_gpu_resident_ranks.py``.
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
@pytest.mark.parametrize(("max_grad_norm", "param_route"), [(1.0, "sharded"), (0.0, "replicated")])
def test_two_gpus_with_resident_groups_track_the_all_host_two(
    tmp_path: Path, max_grad_norm: float, param_route: str
) -> None:
    model = make_model(tmp_path, "qwen3", tied=False, layers=4)
    data = write_data(tmp_path / "data.jsonl", STEPS * 8, min_len=32, max_len=64)
    train = {"max_steps": STEPS, "global_batch_size": 8, "learning_rate": 1e-4,
             "max_grad_norm": max_grad_norm, "dtype": "bfloat16"}  # fmt: skip
    runtime = {"device": "cuda", "gpus": 2, "param_route": param_route}
    output = {"tensorboard": False, "save_steps": 50}  # a mid-run write-back of every owner
    losses = {}
    for name, resident in (("host", {}), ("resident", {"resident_layers": 3,
                                                        "resident_embeddings": True})):  # fmt: skip
        out = tmp_path / name
        config = write_config(tmp_path / f"{name}.yaml", model, data, out, train=train,
                              runtime=runtime | resident, output=output)  # fmt: skip
        assert main(["train", str(config)]) == 0
        losses[name] = torch.tensor([m["loss"] for m in read_metrics(out)])
    assert losses["host"][0] == losses["resident"][0]  # the same weights before any update
    delta = (losses["host"] - losses["resident"]).abs().max().item()
    print(f"resident on 2 GPUs, clip {max_grad_norm}: max |dloss| {delta:.2e} over {STEPS} steps")
    assert delta <= 1e-3
