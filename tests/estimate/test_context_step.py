"""The step-time model of a context-parallel run (``plan.predict``): each rank computes its
shard's tokens and 1/R of attention, and waits for the all-to-alls that the estimate reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tiny import write_config, write_data
from estimate.machines import H100
from slidedp.config import TrainConfig, load_config
from slidedp.estimate_report import Estimate, estimate_run, format_estimate
from slidedp.models.hf import HFAdapter
from slidedp.plan.attention_rate import ATTENTION_EFFICIENCY
from slidedp.plan.machine import gpu_peak
from slidedp.plan.timing import NVLINK_GBPS

SEQ = 65536


def _cfg(tmp_path: Path, model: Path, *overrides: str) -> TrainConfig:
    data = write_data(tmp_path / "data.jsonl", 8)
    path = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    return load_config(path, ["runtime.device=auto", "train.max_grad_norm=0",
                              f"data.seq_len={SEQ}", "train.global_batch_size=1",
                              *overrides])  # fmt: skip


def _estimate(tmp_path: Path, model: Path, *overrides: str) -> Estimate:
    return estimate_run(_cfg(tmp_path, model, *overrides), HFAdapter.from_dir(model), H100)


def test_the_all_to_all_term_is_the_hand_count(tmp_path: Path, qwen3_8b: Path) -> None:
    """Qwen3-8B (36 layers, 32 query and 8 key/value heads of 128) at 64K on R=4: a rank's
    forward sends q, k, v and takes the output back, 16,384 tokens x (2 x 4096 + 2 x 1024)
    bf16 elements a layer; its backward as many again plus the replay's (every layer F), at
    the node's assumed NVLink rate. The compute is a quarter of one GPU's whole sequence
    (linear layers on S/4 tokens, a quarter of the heads over the whole sequence)."""
    split = _estimate(tmp_path, qwen3_8b, "runtime.gpus=4", "runtime.context_parallel=4")
    whole = _estimate(tmp_path, qwen3_8b)
    assert split.step_model is not None
    assert whole.step_model is not None
    forward_s = SEQ // 4 * (2 * 4096 + 2 * 1024) * 2 / (NVLINK_GBPS * 1e9)
    assert split.step_model.busy_s["all_to_all"] == pytest.approx(36 * 3 * forward_s)
    assert "all_to_all" not in whole.step_model.busy_s
    compute = split.step_model.busy_s["compute"]
    assert compute == pytest.approx(whole.step_model.busy_s["compute"] / 4)
    # GPU-bound: the compute waits for every all-to-all, and the step holds them
    assert split.step_model.exposed_s["all_to_all"] == pytest.approx(36 * 3 * forward_s)
    assert split.step_model.step_s >= compute + 36 * 3 * forward_s
    assert "all-to-all at the all_gather's 360 GB/s, assumed" in split.step_model.calibration


def test_layers_that_replay_nothing_exchange_once_in_the_backward(
    tmp_path: Path, qwen3_8b: Path
) -> None:
    """``N`` layers keep their activations: the backward sends the gradients only."""
    kept = _estimate(tmp_path, qwen3_8b, "runtime.gpus=4", "runtime.context_parallel=4",
                     "runtime.layers=N")  # fmt: skip
    assert kept.step_model is not None
    forward_s = SEQ // 4 * (2 * 4096 + 2 * 1024) * 2 / (NVLINK_GBPS * 1e9)
    assert kept.step_model.busy_s["all_to_all"] == pytest.approx(36 * 2 * forward_s)


def test_the_report_shows_a_context_parallel_step(tmp_path: Path, qwen3_8b: Path) -> None:
    """``slidedp estimate`` of R=2 gives the model's step and the all-to-all's share of it."""
    est = _estimate(tmp_path, qwen3_8b, "runtime.gpus=2", "runtime.context_parallel=2")
    assert est.step_model is not None
    table = format_estimate(est)
    assert f"{est.step_model.step_s:.2f} s" in table
    a2a = est.step_model.busy_s["all_to_all"]
    share = f"{a2a:.2f} s {a2a / est.step_model.step_s:.0%} of the step"
    assert f"all-to-all (context parallel) {share}" in " ".join(table.split())


def test_allgather_prices_the_gathered_keys_and_the_last_ranks_attention(
    tmp_path: Path, qwen3_8b: Path
) -> None:
    """``runtime.context_attention: allgather`` on R=4: a layer's forward gathers every rank's
    keys and values, 4 x 16,384 tokens x 2 x 1024 bf16 elements received (no queries or
    output move); the backward reduce-scatters their gradients and the replay gathers again
    (every layer F), at the all_gather's rate. The last rank's 16,384 queries see on average
    65,536 - 8,192 keys where Ulysses' share counts half the sequence: its attention is
    (2S - S/4) / S of Ulysses', at the attention rate, the forward, replay and backward (4x)."""
    gather = _estimate(tmp_path, qwen3_8b, "runtime.gpus=4", "runtime.context_parallel=4",
                       "runtime.context_attention=allgather")  # fmt: skip
    ulysses = _estimate(tmp_path, qwen3_8b, "runtime.gpus=4", "runtime.context_parallel=4")
    assert gather.step_model is not None
    assert ulysses.step_model is not None
    tokens = SEQ // 4
    forward_s = 4 * tokens * 2 * 1024 * 2 / (NVLINK_GBPS * 1e9)
    assert gather.step_model.busy_s["all_to_all"] == pytest.approx(36 * 3 * forward_s)
    assert "key/value all-gather at the all_gather's 360 GB/s" in gather.step_model.calibration
    # the last rank's attention beyond Ulysses' share: 2 q_dim x (S - S/4) x its tokens
    extra_flops = 36 * 4 * 2 * 4096 * (SEQ - tokens) * tokens
    peak = gpu_peak(H100.gpu_name)[0]
    assert peak is not None
    extra_s = extra_flops / (ATTENTION_EFFICIENCY * peak)
    more = gather.step_model.busy_s["compute"] - ulysses.step_model.busy_s["compute"]
    assert more == pytest.approx(extra_s)
