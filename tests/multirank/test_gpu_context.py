"""2 (or 4) GPUs splitting every sequence (``runtime.context_parallel``: NCCL all-to-all, or
all-gather of key/value shards) against 1 GPU reading the rows whole, bf16, 100 steps: dense,
packed rows, a mixture of experts; Ulysses and allgather; activation offload (every family)
and GPU-resident layers and embeddings (the one-GPU run with the same layout); train.freeze
with held-out evaluation (the eval losses within the same bound).

Run on a 2-GPU machine (the R=4 cases need 4):
``pytest -m multi_gpu tests/multirank/test_gpu_context.py -s``.
Tolerance: the engine's bf16 bound (max |Δloss| <= 1e-3, tests/multirank/test_gpu_ranks.py):
both runs compute in bf16; the split run's attention is the same SDPA call on the gathered
heads (Ulysses) or on each shard's queries over the gathered keys (allgather), its gradient the sum
of two shards' in another order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.cli import main

pytestmark = pytest.mark.e2e  # every test here trains end to end

STEPS = 100


# every family, part or all of its saved tensors offloaded to pinned host memory
OFFLOADED = {"layers": "1xF-r1, 1xN-r0.5, 1xS1010100-r0.5, 1xSAC.mm-r1"}
RESIDENT = {"resident_layers": 2, "resident_embeddings": True}  # updated on the GPU
# the embedding, layer 0 and every key projection frozen; held-out rows evaluated every 25 steps
FROZEN = {"freeze": ["embed_tokens", "layers.0", "*.self_attn.k_proj.*"], "eval_steps": 25}


@pytest.mark.multi_gpu
@pytest.mark.parametrize(
    ("arch", "gpus", "data_keys", "attention", "layout", "train_keys"),
    [
        ("qwen3", 2, {}, "auto", {}, {}),
        ("qwen3", 2, {"packing": True}, "auto", {}, {}),  # several samples per row, masked apart
        ("qwen3_moe", 2, {}, "auto", {}, {}),  # routers and experts on the shard (GPU histc)
        ("qwen3", 4, {}, "ulysses", {}, {}),  # R=4: the tiny model with 4 key/value heads
        # allgather: causal over the gathered keys (lower-right SDPA)
        ("qwen3", 2, {}, "allgather", {}, {}),
        ("qwen3", 2, {"packing": True}, "allgather", {}, {}),  # each shard's block of the mask
        ("qwen3", 4, {}, "allgather", {}, {}),  # R=4: the tiny model's 2 key/value heads
        ("qwen3", 2, {}, "auto", OFFLOADED, {}),  # the shard's saved tensors through the host
        ("qwen3", 2, {}, "allgather", OFFLOADED, {}),  # the gathered keys/values' too
        ("qwen3", 2, {}, "auto", RESIDENT, {}),  # resident gradients reduced onto their owner
        ("qwen3", 2, {"eval_fraction": 0.1}, "allgather", {}, FROZEN),  # eval losses compared
    ],
    ids=[
        "dense",
        "packed",
        "moe",
        "r4",
        "allgather",
        "allgather-packed",
        "allgather-r4",
        "offload",
        "allgather-offload",
        "resident",
        "frozen-eval",
    ],
)
def test_gpus_splitting_each_sequence_track_one(
    tmp_path: Path,
    arch: str,
    gpus: int,
    data_keys: dict[str, bool],
    attention: str,
    layout: dict[str, object],
    train_keys: dict[str, object],
) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    kv_heads = 4 if attention == "ulysses" else None  # the tiny model's 2 otherwise
    model = make_model(tmp_path, arch, tied=True, layers=4, kv_heads=kv_heads)
    # rows up to the tiny model's max_position_embeddings (128); packed: samples shorter than
    # a row, so that rows hold several
    short = data_keys.get("packing", False)
    data = write_data(tmp_path / "data.jsonl", STEPS * 4 * (4 if short else 1),
                      min_len=30 if short else 64, max_len=120 if short else 128)  # fmt: skip
    train = {"max_steps": STEPS, "global_batch_size": 4, "learning_rate": 1e-4,
             "max_grad_norm": 1.0, "dtype": "bfloat16"} | train_keys  # fmt: skip
    # what context parallelism is checked with: eager layers, not compiled, a fixed layout
    runtime = {"device": "cuda", "kernels": "eager", "compile": False, "policy": "fixed",
               "context_attention": attention} | layout  # fmt: skip
    losses, evals = [], []
    for n in (1, gpus):
        out = tmp_path / f"g{n}"
        split = {"gpus": n, "context_parallel": n}
        config = write_config(tmp_path / f"{n}.yaml", model, data, out, train=train,
                              data={"seq_len": 128} | data_keys, runtime=runtime | split,
                              output={"tensorboard": False})  # fmt: skip
        assert main(["train", str(config)]) == 0
        losses.append(torch.tensor([m["loss"] for m in read_metrics(out)]))
        evals.append(torch.tensor([m["eval_loss"] for m in read_metrics(out) if "eval_loss" in m]))
    assert len(evals[0]) == (STEPS // 25 if train_keys else 0)
    delta = max((a - b).abs().max().item() if len(a) else 0.0
                for a, b in ((losses[0], losses[1]), (evals[0], evals[1])))  # fmt: skip
    print(f"{arch} {data_keys} {layout} context_parallel={gpus} {attention}: max |dloss| "
          f"{delta:.2e} over {STEPS} steps")  # fmt: skip
    assert delta <= 1e-3
