"""Context parallelism on CPU ranks (gloo, float32): R ranks splitting every sequence against
one rank reading the same rows whole.

Tolerance: the same math in another summation order. Attention over the whole sequence is
the same SDPA call on the gathered heads, but each layer's gradient is the sum of R shards'
(a different order than one rank's sum over all tokens), the loss and label count are summed
over ranks, and the global norm is taken over owners; AdamW's m/sqrt(v) amplifies those f32
roundings as in tests/multirank/test_parity.py, whose bounds we keep: 1e-5 relative on losses
and grad norms, 1e-5 absolute on parameters. R=4 sums four shards' gradients: the same
reordering once more (measured: losses within 7.7e-8 relative, parameters 1.2e-7 absolute).
Real errors exceed them (measured on the llama
case): a shard's RoPE positions not offset moves the losses by 9.6e-5 relative, a label lost at
each shard boundary by 1.1e-3; packed samples attending across their boundaries (causal masks
over the whole rows instead of per sample) by 5.8e-3 (packed case: 5.6e-8 when right); a
mixture of experts' load-balancing loss taken on each shard alone, not from every shard's token
statistics, by 1.0e-4 (MoE case: 7.6e-8, its aux_loss compared too, equal to the bit).
All-gather attention (each shard's queries over the gathered keys) reorders SDPA's sums over keys
too: R=4 within 1.3e-7 relative (parameters 1.4e-7), R=2 x 2 groups 1.1e-7 (1.2e-7), packed
1.0e-7 (9.7e-8) of one rank and 5.1e-8 (1.2e-7) of Ulysses; allgather mask blocks plain causal over
the rows instead of each shard's block of the per-sample mask move the packed losses by 5.8e-3.
Offloading a shard's saved tensors (a copy to the host and back) and GPU residency (on CPU
ranks the host AdamW kernel on the owner, bit for bit the host update) add no rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import run_ranks
from slidedp.cli import main

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
MAX_GRAD_NORM_PACKED = 1.95

TRAIN = {
    "max_steps": 5,
    "global_batch_size": 4,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
}


def _compare(one: Path, many: Path, model: Path) -> None:
    """Losses, grad norms and final parameters of ``many`` against ``one``."""
    m1, m2 = read_metrics(one), read_metrics(many)
    for key in ("loss", "grad_norm", "aux_loss", "eval_loss"):
        a = torch.tensor([m[key] for m in m1 if key in m], dtype=torch.float64)
        b = torch.tensor([m[key] for m in m2 if key in m], dtype=torch.float64)
        assert key not in m1[0] or len(a) > 0
        torch.testing.assert_close(b, a, rtol=LOSS_RTOL, atol=0)
    clipped = [m["clip_coef"] < 1.0 for m in m2]
    assert any(clipped), "clipping must bind in some steps"
    assert not all(clipped), "and leave others unclipped"
    p1 = load_file(one / "final" / "model.safetensors")
    p2 = load_file(many / "final" / "model.safetensors")
    assert set(p1) == set(p2)
    assert max((p1[n] - p2[n]).abs().max().item() for n in p1) <= PARAM_ATOL
    start = load_file(next(model.glob("*.safetensors")))
    moved = max((p1[n] - start[n]).abs().max().item() for n in p1)
    assert moved > 100 * PARAM_ATOL, "training must move the parameters for this to mean much"


GATHER = {"context_attention": "allgather"}
OFFLOADED = "1xF-r1, 1xN-r0.5, 1xS1010100-r0.5, 1xSAC.mm-r1"  # every family, part or all offloaded


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("arch", "ranks", "context", "runtime", "kv_heads"),
    [
        ("qwen3", 2, 2, {"layers": "1xF, 1xN, 1xS1010100, 1xSAC.mm"}, None),
        # each family's saved tensors of the shard offloaded (a part, or all of them)
        ("qwen3", 2, 2, {"layers": OFFLOADED}, None),
        ("qwen3", 2, 2, GATHER | {"layers": OFFLOADED}, None),  # the gathered keys/values too
        # each rank's shard tiled (runtime.mlp_tile_tokens; the one rank tiles its whole rows)
        ("qwen3", 2, 2, {"layers": OFFLOADED, "mlp_tile_tokens": 5}, None),
        ("llama", 2, 2, {"grad_route": "cpu", "param_route": "sharded"}, None),
        ("qwen3", 4, 2, GATHER, None),  # 2 allgather groups of 2: data parallelism over the groups
        ("qwen3", 4, 4, {}, 4),  # one group of 4 (Ulysses: the 4 key/value heads split in 4)
        (
            "qwen3",
            4,
            4,
            {},
            None,
        ),  # allgather (auto): the tiny model's 2 key/value heads in 4 ranks
        ("qwen3_moe", 2, 2, {}, None),  # routers and experts on the shard, aux loss summed
        # 2 resident layers and the embeddings in 2 groups of 2: each resident gradient summed
        # onto its owner over the context and the data ranks, as a streamed group's
        ("qwen3", 4, 2, {"resident_layers": 2, "resident_embeddings": True}, None),
    ],
    ids=[
        "families",
        "offload",
        "offload-allgather",
        "tiled-mlp",
        "llama-routes",
        "allgather-dp",
        "ulysses-r4",
        "allgather-r4",
        "moe",
        "resident",
    ],
)
def test_context_parallel_matches_one_rank(
    tmp_path: Path,
    arch: str,
    ranks: int,
    context: int,
    runtime: dict[str, str],
    kv_heads: int | None,
) -> None:
    """R=2 on 2 ranks (every activation family, also offloaded; llama on the cpu and sharded
    routes; a mixture of experts), R=2 x 2 data-parallel groups (allgather; resident layers and
    embeddings) and R=4 on 4 ranks (Ulysses, and allgather where the key/value heads do not
    divide by 4): one rank's losses, norms and parameters."""
    # each norm binds in some steps of its model's run, not in all
    train = TRAIN | {"max_grad_norm": 2.0 if arch == "llama" else 2.2}
    model = make_model(tmp_path, arch, tied=False, layers=4, kv_heads=kv_heads)
    data = write_data(tmp_path / "data.jsonl", 24, min_len=10, max_len=31)
    _train_pair(tmp_path, model, data, (ranks, context), {"train": train, "runtime": runtime})


@pytest.mark.e2e
def test_packed_rows_match_one_rank(tmp_path: Path) -> None:
    """Packed rows (2 to 7 samples each, attention kept inside every sample, the shard
    boundary inside a sample) at R=2, Ulysses then allgather (the mask blocks of each shard): the
    one-rank packed run's losses, norms, parameters, and the two schemes' alike."""
    model = make_model(tmp_path, "qwen3", tied=False, layers=4)
    data = write_data(tmp_path / "data.jsonl", 64, min_len=4, max_len=14)
    train = TRAIN | {"max_grad_norm": MAX_GRAD_NORM_PACKED}
    sections = {"train": train, "data": {"packing": True}}
    ulysses = _train_pair(tmp_path, model, data, (2, 2), sections)
    allgather = _train_pair(tmp_path, model, data, (2, 2), sections | {"runtime": GATHER})
    _compare(ulysses, allgather, model)


@pytest.mark.e2e
def test_frozen_and_evaluated_run_matches_one_rank(tmp_path: Path) -> None:
    """``train.freeze`` (the embedding, layer 0, every key projection: under allgather the
    gathered keys then send no gradient back) and held-out evaluation every 2 steps at R=2:
    one rank's losses, norms, eval losses (each rank's shard summed) and parameters; the frozen
    parameters as they came in."""
    model = make_model(tmp_path, "qwen3", tied=False, layers=4)
    data = write_data(tmp_path / "data.jsonl", 32, min_len=10, max_len=31)
    frozen = ["embed_tokens", "layers.0", "*.self_attn.k_proj.*"]
    train = TRAIN | {"max_grad_norm": 1.6, "freeze": frozen, "eval_steps": 2}  # binds twice
    sections = {"train": train, "data": {"eval_fraction": 0.25}, "runtime": GATHER}
    many = _train_pair(tmp_path, model, data, (2, 2), sections)
    assert [m["step"] for m in read_metrics(many) if "eval_loss" in m] == [2, 4, 5]
    start = load_file(next(model.glob("*.safetensors")))
    final = load_file(many / "final" / "model.safetensors")
    held = [n for n in start if n == "model.embed_tokens.weight" or ".layers.0." in n
            or ".k_proj." in n]  # fmt: skip
    assert len(held) > 4
    assert all(torch.equal(final[n], start[n]) for n in held)


def _train_pair(
    tmp_path: Path, model: Path, data: Path, split: tuple[int, int], sections: dict[str, Any]
) -> Path:
    """The config ``sections`` on one rank (once per ``tmp_path``), then on ``split`` =
    (ranks, context_parallel); ``_compare``'d. Returns the split run's output directory."""
    one = tmp_path / "one"
    common = {"output": {"tensorboard": False}} | sections
    ranks, context = split
    cp = common.get("runtime", {}) | {"ranks": ranks, "context_parallel": context}
    many = tmp_path / f"many-{cp.get('context_attention', 'auto')}"
    c1 = write_config(tmp_path / "1.yaml", model, data, one, **common)
    c2 = write_config(tmp_path / "2.yaml", model, data, many, **(common | {"runtime": cp}))
    if not one.exists():
        assert main(["train", str(c1)]) == 0
    assert run_ranks(c2, ranks) == [0] * ranks
    _compare(one, many, model)
    return many
