"""The peers of ``slidedp bench train --gpus N`` on CPU (``--ranks N``), with fake workers where
DeepSpeed would run: which peers and variants run on N ranks and with what, the DeepSpeed
config of N ranks, the cores each rank is bound to, the scaling report and its refusals."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.tiny import tiny_spec, write_tiny_config
from slidedp.bench import multi
from slidedp.bench import train as bench_train
from slidedp.bench.child import run_child
from slidedp.bench.deepspeed_zero import STAGES, bind_cores, zero_config
from slidedp.bench.measure import RunSpec
from slidedp.cli import main
from slidedp.config import TrainSection

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEP_S = {"ours": 0.01, "reference": 0.005, "zero3-offload": 0.04, "zero3-offload:big": 0.05,
          "zero3-optim-offload": 0.02, "roundpipe": 0.03}  # fmt: skip


def _fake_child(calls: list[RunSpec]) -> Any:
    """Results as a worker writes them: on 2 ranks every system takes 1.25x its 1-rank step."""

    def run_child(spec: RunSpec, workdir: Path) -> tuple[dict[str, Any], int]:
        calls.append(spec)
        if spec.system == "collectives":
            return {"status": "ok", "backend": "gloo", "dtype": "bfloat16", "warmup": 2,
                    "reps": 5, "rows": []}, 0  # fmt: skip
        step_s = STEP_S[spec.full_system] * (1.25 if spec.world > 1 else 1.0)
        result = {
            "system": spec.full_system, "batch": spec.batch, "status": "ok",
            "step_times_s": [step_s], "tokens_per_step": spec.global_batch * spec.seq_len,
            "host_pss_end_bytes": 2**30, "gpu_peak_reserved_bytes": None,
        }  # fmt: skip
        if spec.system == "ours":
            lanes = ("wait_h2d_s", "wait_update_s", "wait_d2h_s", "wait_offload_s")
            result["lanes_s"] = dict.fromkeys(lanes, 0.001)
        return result, 2**30

    return run_child


def test_the_peers_and_their_variants_run_on_n_ranks_beside_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[RunSpec] = []
    monkeypatch.setattr(bench_train, "run_child", _fake_child(calls))
    config = write_tiny_config(tmp_path / "m")
    out = tmp_path / "r.json"
    systems = "ours,reference,zero3-offload,zero3-offload:big,zero3-optim-offload,roundpipe"
    args = ["bench", "train", "--shape", str(config), "--seq", "16", "--device", "cpu",
            "--batch", "2", "--warmup", "1", "--steps", "1", "--json", str(out), "--ranks", "2",
            "--systems", systems, "--system-timeout", "100,zero3-offload:big=300",
            "--peer-set", "zero3-offload.zero_optimization.overlap_comm=false",
            "--peer-set", "zero3-offload:big.zero_optimization.reduce_bucket_size=5e8"]  # fmt: skip
    assert main(args) == 0
    ran = [(s.full_system, s.world) for s in calls]
    assert ran == [
        ("collectives", 2), ("ours", 1), ("reference", 1), ("zero3-offload", 1),
        ("zero3-offload:big", 1), ("zero3-optim-offload", 1), ("roundpipe", 1), ("ours", 2),
        ("zero3-offload", 2), ("zero3-offload:big", 2), ("zero3-optim-offload", 2),
    ]  # fmt: skip
    # (the reference and RoundPipe on one GPU only)
    one, two = (
        {s.full_system: s for s in calls if s.world == world and s.system != "collectives"}
        for world in (1, 2)
    )
    for name in ("zero3-offload", "zero3-offload:big", "zero3-optim-offload"):
        # on N ranks as on one: the same worker, overrides and limit; N x the rows
        assert dataclasses.replace(two[name], world=1) == one[name]
        assert two[name].global_batch == 2 * 2
    assert two["zero3-offload:big"].peer == {
        "zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 5 * 10**8}
    }
    assert two["zero3-offload:big"].timeout_s == 300
    report = json.loads(out.read_text())
    (row,) = report["scaling"]
    peers = row["peers"]
    assert list(peers) == ["zero3-offload", "zero3-offload:big", "zero3-optim-offload"]
    ours_n = row["ours_n_tokens_per_s"]
    for name, peer in peers.items():
        assert peer["tokens_per_s_1"] == pytest.approx(32 / STEP_S[name])
        assert peer["tokens_per_s_n"] == pytest.approx(64 / (1.25 * STEP_S[name]))
        assert peer["efficiency"] == pytest.approx(0.8)
        assert peer["ours_over"] == pytest.approx(ours_n / peer["tokens_per_s_n"])
    assert peers["zero3-offload"]["ours_over"] == pytest.approx(4.0)
    printed = capsys.readouterr().out
    assert "  zero3-optim-offload 1:     1600.0  2:     2560.0  efficiency 80.0%" in printed
    assert "ours/zero3-offload 4.00x, ours/zero3-offload:big 5.00x, " in printed


def test_every_deepspeed_peer_on_n_ranks_gets_its_stage_offload_and_global_batch() -> None:
    train = TrainSection(max_steps=1, max_grad_norm=1.0)
    assert STAGES == {"zero3-offload": (3, True), "zero3-optim-offload": (3, False),
                      "zero-offload": (2, False)}  # fmt: skip
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    full = zero_config(3, train, 16, 64, world=4)
    optim = zero_config(3, train, 16, 64, world=4, offload_param=False)
    for config in (full, optim):
        assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (64, 16)
        assert config["zero_optimization"]["offload_optimizer"] == pinned_cpu
        assert config["zero_optimization"]["stage"] == 3
    assert full["zero_optimization"]["offload_param"] == pinned_cpu
    assert "offload_param" not in optim["zero_optimization"]  # the BF16 shards on the GPUs
    assert {k: v for k, v in optim["zero_optimization"].items() if k != "offload_param"} == {
        k: v for k, v in full["zero_optimization"].items() if k != "offload_param"
    }


def test_each_rank_is_bound_to_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    bound: list[list[int]] = []
    threads: list[int] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(10)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, c: bound.append(c))
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    assert [bind_cores(r, 4) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert bound == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert threads == [2, 2, 2, 2]
    assert bind_cores(0, 16) == [0]  # more ranks than cores: one core each, never none


def test_the_runs_on_n_ranks_need_a_system_that_scales() -> None:
    from slidedp.bench.train import ours_config
    from slidedp.cli import build_parser
    from slidedp.errors import ConfigError

    args = build_parser().parse_args(["bench", "train", "--ranks", "2"])
    with pytest.raises(ConfigError, match=r"need ours, fsdp2 or a peer that runs on several"):
        multi.parse_scale(args, ["reference", "roundpipe"], "cpu", ours_config([]))
    scale = multi.parse_scale(args, ["zero3-optim-offload"], "cpu", ours_config([]))
    assert scale is not None
    assert multi.scales("zero3-offload:big")
    assert not multi.scales("roundpipe")
    assert not multi.scales("reference")


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed (slidedp[peers])")
@pytest.mark.parametrize("system", ["zero3-offload", "zero3-optim-offload"])
def test_zero3_on_two_cpu_ranks_trains_the_global_batch(tmp_path: Path, system: str) -> None:
    one, _ = run_child(tiny_spec(tmp_path, system), tmp_path)
    two, _ = run_child(dataclasses.replace(tiny_spec(tmp_path, system), world=2), tmp_path)
    assert one["status"] == two["status"] == "ok", two
    assert two["tokens_per_step"] == 2 * one["tokens_per_step"]
    assert two["peer_config"]["train_batch_size"] == 2 * one["peer_config"]["train_batch_size"]
    assert all(5.0 < loss < 6.0 for loss in two["losses"])  # about ln(256): it trains
