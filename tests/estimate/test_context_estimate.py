"""The estimate of a context-parallel run: each rank's activations are those of its shard."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from transformers import Qwen3Config

from engine.tiny import make_model, write_config, write_data
from estimate.machines import H100
from slidedp.cli import main
from slidedp.config import TrainConfig, load_config
from slidedp.estimate import shortages
from slidedp.estimate_report import estimate_run, longest_sequence
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES
from slidedp.plan.machine import GIB


def _cfg(tmp_path: Path, model: Path, *overrides: str) -> TrainConfig:
    data = write_data(tmp_path / "data.jsonl", 8)
    path = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    return load_config(path, ["runtime.device=auto", "train.max_grad_norm=0", *overrides])


def test_four_ranks_splitting_a_sequence_each_hold_a_quarter(
    tmp_path: Path, qwen3_8b: Path
) -> None:
    """Qwen3-8B at 64K on 4 ranks of R=4: each rank's activations and loss are those of one
    GPU at 16K, a quarter of one GPU's at 64K (its layer too: Ulysses' buffers are not at the
    layer's peak)."""
    adapter = HFAdapter.from_dir(qwen3_8b)
    split = estimate_run(_cfg(tmp_path, qwen3_8b, "data.seq_len=65536", "runtime.gpus=4",
                              "runtime.context_parallel=4", "train.global_batch_size=1"),
                         adapter, H100)  # fmt: skip
    quarter = estimate_run(_cfg(tmp_path, qwen3_8b, "data.seq_len=16384",
                                "train.global_batch_size=1"), adapter, H100)  # fmt: skip
    whole = estimate_run(_cfg(tmp_path, qwen3_8b, "data.seq_len=65536",
                              "train.global_batch_size=1"), adapter, H100)  # fmt: skip
    assert split.gpu is not None
    assert quarter.gpu is not None
    assert whole.gpu is not None
    for part in ("checkpoint_bytes", "loss_bytes"):
        assert getattr(split.gpu, part) == getattr(quarter.gpu, part), part
    assert split.gpu.layer_bytes == quarter.gpu.layer_bytes  # Ulysses: the shard's layer
    assert split.gpu.checkpoint_bytes * 4 == whole.gpu.checkpoint_bytes


def test_the_longest_sequence_split_over_four_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-8B at B=1 on four H100s (a host of 4 GPUs: 500 GiB), positions up to 4M: split
    over R=4 GPUs the longest sequence
    is nearly 4 x one GPU's (each rank's activations are those of S/4 tokens, the weights'
    window and the loss's chunk the same), it fits the
    same memory model and the next multiple of 1024 does not; the report names R."""
    model = tmp_path / "qwen3-8b-4m"
    Qwen3Config(**{**SHAPES["qwen3-8b"], "max_position_embeddings": 2**22}).save_pretrained(model)
    adapter = HFAdapter.from_dir(model)
    one = _cfg(tmp_path, model, "train.global_batch_size=1")
    four = _cfg(tmp_path, model, "train.global_batch_size=1", "runtime.gpus=4",
                "runtime.context_parallel=4")  # fmt: skip
    node = replace(H100, shm_free_bytes=400 * GIB, mem_available_bytes=500 * GIB, gpu_count=4)
    alone, split = longest_sequence(one, adapter, node), longest_sequence(four, adapter, node)
    assert (alone.context_parallel, split.context_parallel) == (1, 4)
    assert 0 < alone.seq_len < split.seq_len < 2**22
    # each rank holds S/4 tokens where one GPU holds S: within one 1024-token step of 4 x
    assert abs(split.seq_len - 4 * alone.seq_len) <= 4 * 1024

    def fits(cfg: TrainConfig, tokens: int) -> bool:
        data = replace(cfg.data, seq_len=tokens)
        return not shortages(estimate_run(replace(cfg, data=data), adapter, node))

    assert fits(four, split.seq_len)
    assert not fits(four, split.seq_len + 1024)
    assert split.limit.startswith(f"{split.seq_len + 1024:,} tokens: GPU ")
    assert not fits(one, split.seq_len)  # what one GPU cannot hold
    line = split.describe(1)
    assert line.startswith(f"longest sequence at B=1 on this machine: {split.seq_len:,} tokens, ")
    assert f"each split over 4 GPUs ({split.seq_len // 4:,} on each)" in line
    # the command on this machine, a tiny Qwen3 on 2 CPU ranks (a second model: quick)
    tiny = make_model(tmp_path, "qwen3", tied=True)
    config = str(write_config(tmp_path / "t.yaml", tiny, tmp_path / "data.jsonl", tmp_path / "o"))
    given = ["train.global_batch_size=1", "runtime.context_parallel=2", "runtime.device=cpu",
             "runtime.ranks=2", "model.max_position_embeddings=4096", "--longest-seq"]  # fmt: skip
    assert main(["estimate", config, *given, "--json"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{") :])["longest_seq"]["context_parallel"] == 2
    assert main(["estimate", config, *given]) == 0
    assert "tokens, each split over 2 ranks (" in capsys.readouterr().out


def _split(tmp_path: Path, model: Path, attention: str, layers: str, seq: int = 65536) -> Any:
    """Qwen3-8B at B=1, ``seq`` tokens over 4 ranks of R=4 (or one GPU at ``seq`` with
    ``attention`` ''), ``runtime.layers`` ``layers``: the estimate's GPU part."""
    split = ["runtime.gpus=4", "runtime.context_parallel=4",
             f"runtime.context_attention={attention}"] if attention else []  # fmt: skip
    cfg = _cfg(tmp_path, model, f"data.seq_len={seq}", "train.global_batch_size=1",
               f"runtime.layers={layers}", "runtime.policy=fixed", *split)  # fmt: skip
    est = estimate_run(cfg, HFAdapter.from_dir(model), H100)
    assert est.gpu is not None
    return est


def test_allgather_counts_the_gathered_keys_and_values(tmp_path: Path, qwen3_8b: Path) -> None:
    """Allgather's last rank keeps, per layer, the keys and values of the whole sequence
    repeated to the 32 query heads (what SDPA's backward reads) where Ulysses keeps its
    shard's of the 8 key/value heads (as many elements as the whole sequence's 2 heads): in
    the retained checkpoints (no recompute), in the offload arena (all offloaded), and the
    gather's buffers in the layer's transient."""
    s, d, layers, elem = 65536, 128, 36, 2
    gathered = 2 * s * 32 * d * elem - 2 * (s // 4) * 8 * d * elem  # per layer
    kept = {a: _split(tmp_path, qwen3_8b, a, "N") for a in ("ulysses", "allgather")}
    assert kept["allgather"].gpu.checkpoint_bytes - kept["ulysses"].gpu.checkpoint_bytes == (
        layers * gathered
    )
    moved = {a: _split(tmp_path, qwen3_8b, a, "N-r1") for a in ("ulysses", "allgather")}
    arena = moved["allgather"].offload_arena_bytes - moved["ulysses"].offload_arena_bytes
    assert arena == 4 * layers * gathered  # each of the node's 4 ranks pins its own
    # the transient: Ulysses' is one GPU's at the shard's 16K (its all-to-all buffers are not
    # at the layer's peak: plan.context_cost)
    alone = _split(tmp_path, qwen3_8b, "", "F", seq=s // 4)
    ulysses, allgather = (_split(tmp_path, qwen3_8b, a, "F") for a in ("ulysses", "allgather"))
    assert ulysses.gpu.layer_bytes == alone.gpu.layer_bytes
    # allgather: the replayed layer's gathered keys/values, and the gather's buffers
    assert allgather.gpu.layer_bytes - ulysses.gpu.layer_bytes > 2 * 2 * 8 * s * d * elem


@pytest.mark.parametrize("route", ["gpu", "cpu"])
def test_each_rank_parks_the_gradients_it_owns(tmp_path: Path, qwen3_8b: Path, route: str) -> None:
    """Clipping on 2 GPUs (R=2 here; data ranks alike): on the gpu route a group's gradient is
    reduced onto its owner (group g on rank g % 2) and only the owner parks it: the embedding
    and the odd layers on rank 0, the even layers and the head on rank 1, half the model each
    (Qwen3-14B at 262,144 tokens on 4 H200s parked a quarter: 58.48 GiB peak reserved, where
    the whole model's 27.5 GiB parked had the estimate at 62.1); on the cpu route every rank
    parks every group's before the host sums them."""
    cfg = _cfg(tmp_path, qwen3_8b, "data.seq_len=8192", "train.global_batch_size=1",
               "runtime.gpus=2", "runtime.context_parallel=2", "train.max_grad_norm=1.0",
               f"runtime.grad_route={route}")  # fmt: skip
    adapter = HFAdapter.from_dir(qwen3_8b)
    est = estimate_run(cfg, adapter, H100)
    assert est.gpu is not None
    numels = [g.numel for g in adapter.group_specs()]  # embed, 36 layers, head
    assert len(numels) == 38
    owned = max(sum(numels[0::2]), sum(numels[1::2])) if route == "gpu" else sum(numels)
    assert est.gpu.parked_grad_bytes == 2 * owned
    share = 0.5 if route == "gpu" else 1.0  # the 8B's embedding and head are alike (untied)
    assert owned == pytest.approx(share * est.params, rel=1e-3)


def test_the_longest_sequence_of_a_model_with_fewer_positions_than_one_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = make_model(tmp_path, "qwen3", tied=True)
    positions = HFAdapter.from_dir(tiny).config.max_position_embeddings
    assert positions < 1024  # below the search's 1024-token step: the cap is the step
    config = write_config(tmp_path / "t.yaml", tiny, write_data(tmp_path / "d.jsonl", 8),
                          tmp_path / "o")  # fmt: skip
    assert main(["estimate", str(config), "--longest-seq"]) == 0
    assert f"{positions:,} tokens" in capsys.readouterr().out
