"""2 GPUs (NCCL) against 1 GPU at the same global batch, bf16, every route combination.

Run on a 2-GPU machine: ``pytest -m multi_gpu tests/multirank/test_gpu_ranks.py``. Tolerance: the
engine issue's bf16 bound (max |Δloss| <= 1e-3, the FSDP2 comparison's measure): both runs
compute in bf16 and differ by the reduction order of the gradient sum.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import latest_step, start_train, wait_for_steps
from slidedp.cli import main

pytestmark = pytest.mark.e2e  # every test here trains end to end

STEPS = 100
# (grad route, param route, max_grad_norm, BF16 mirror): the replicated routes read the mirror
# (nothing cast per rank), the sharded ones cast their shard on delivery; clipping on every
# route, and the cpu route once without (its updates overlap the backward).
CASES = [("gpu", "replicated", 1.0, True), ("gpu", "sharded", 1.0, False),
         ("cpu", "replicated", 1.0, True), ("cpu", "sharded", 1.0, False),
         ("cpu", "replicated", 0.0, True)]  # fmt: skip


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize(("grad_route", "param_route", "max_grad_norm", "mirror"), CASES)
def test_two_gpus_track_one(
    tmp_path: Path, grad_route: str, param_route: str, max_grad_norm: float, mirror: bool
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=4)
    data = write_data(tmp_path / "data.jsonl", STEPS * 8, min_len=32, max_len=64)
    train = {"max_steps": STEPS, "global_batch_size": 8, "learning_rate": 1e-4,
             "max_grad_norm": max_grad_norm, "dtype": "bfloat16"}  # fmt: skip
    runtime = {"device": "cuda", "grad_route": grad_route, "param_route": param_route,
               "bf16_mirror": mirror}  # fmt: skip
    output = {"tensorboard": False}
    losses = []
    for gpus in (1, 2):
        out = tmp_path / f"g{gpus}"
        config = write_config(tmp_path / f"{gpus}.yaml", model, data, out, train=train,
                              runtime=runtime | {"gpus": gpus}, output=output)  # fmt: skip
        assert main(["train", str(config)]) == 0
        losses.append(torch.tensor([m["loss"] for m in read_metrics(out)]))
    delta = (losses[0] - losses[1]).abs().max().item()
    print(f"{grad_route}/{param_route}: max |dloss| {delta:.2e} over {STEPS} steps")
    assert delta <= 1e-3


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_sigterm_stops_both_gpus_after_one_step_with_a_checkpoint(tmp_path: Path) -> None:
    """The stop agreement is an NCCL all-reduce here (gloo on CPU: tests/multirank/test_stop.py)."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=4)
    data = write_data(tmp_path / "data.jsonl", 64, min_len=32, max_len=64)
    out = tmp_path / "run"
    train = {"max_steps": 100_000, "global_batch_size": 8, "lr_scheduler": "constant",
             "dtype": "bfloat16"}  # fmt: skip
    config = write_config(tmp_path / "c.yaml", model, data, out, train=train,
                          runtime={"device": "cuda", "gpus": 2},
                          output={"tensorboard": False})  # fmt: skip
    proc = start_train(config)
    wait_for_steps(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1, err
    stopped = latest_step(out)
    assert stopped == len(read_metrics(out)) >= 3
    assert (out / f"checkpoint-{stopped}" / "model.safetensors").is_file()
