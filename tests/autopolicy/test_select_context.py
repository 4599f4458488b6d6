"""AutoPolicy's layout stage for a context-parallel run (``autopolicy.select``): the layer
profile is of a rank's shard (its activation bytes /R), the candidates' times carry attention
over the whole sequence and the all-to-alls, offloaded and resident ones among them; the same GPU
holds more kept layers at R=2 than at R=1."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autopolicy.test_select import MIB, SEQ, _row
from engine.tiny import make_model, write_config, write_data
from slidedp.autopolicy.select import activation_budget, select_layout
from slidedp.config import TrainConfig, load_config
from slidedp.models.hf import HFAdapter
from slidedp.models.shape import layer_shapes
from slidedp.plan.attention_rate import ATTENTION_EFFICIENCY
from slidedp.plan.machine import Machine
from slidedp.plan.timing import NVLINK_GBPS
from slidedp.profile.layer import profile_spec

LAYERS, ROWS = 4, 2
H100_PEAK = 989e12  # plan.machine's dense bf16 peak of the H100 the machine is named as


def _report(context: int) -> dict[str, Any]:
    """The profile of one rank's shard: S/R tokens, so 1/R of one GPU's activation bytes."""
    rows = [
        _row("F-r0", 30.0, 1.0 / context, pareto=False),
        _row("F-r1", 30.0, 0.0),
        _row("SAC.mm-r0", 27.0, 100.0 / context),
        _row("N-r0", 18.0, 300.0 / context),
    ]
    return {"batch": ROWS, "seq_len": SEQ // context, "candidates": rows, "cached": None}


def _run(tmp_path: Path, context: int) -> tuple[TrainConfig, HFAdapter, Machine]:
    """The same rows on one GPU (R=1) or split over two (R=2), as on an H100."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=LAYERS)
    data = write_data(tmp_path / "data.jsonl", 16, min_len=SEQ, max_len=SEQ)
    runtime = {"device": "cpu", "ranks": context, "context_parallel": context,
               "kernels": "eager", "compile": False}  # fmt: skip
    path = write_config(tmp_path / f"r{context}.yaml", model, data, tmp_path / "out",
                        runtime=runtime, train={"max_steps": 2, "global_batch_size": ROWS,
                                                "max_grad_norm": 1.0})  # fmt: skip
    cfg = load_config(path, [])
    machine = replace(Machine.probe(cfg, measure=False), gpu_name="NVIDIA H100 80GB HBM3")
    return cfg, HFAdapter.from_dir(model), machine


def test_the_profile_is_of_a_ranks_shard(tmp_path: Path) -> None:
    cfg, _, _ = _run(tmp_path, 2)
    spec = profile_spec(cfg)
    assert (spec.batch, spec.seq_len, spec.world) == (ROWS, SEQ // 2, 2)


def test_two_ranks_keep_more_layers_and_price_the_all_to_alls(tmp_path: Path) -> None:
    """A GPU whose activation budget at R=1 holds 700 MiB: fewer than four N layers (300 MiB
    each) fit; at R=2 each N layer's shard keeps 150 MiB and all four fit. R=2's candidates
    are R=1's profile times plus the hand count of what the shard's profile leaves out."""
    one_cfg, adapter, machine = _run(tmp_path / "one", 1)
    two_cfg, _, _ = _run(tmp_path / "two", 2)
    base = 10 * 2**30
    free = activation_budget(one_cfg, adapter, machine, base).bytes
    total = int(base + (700 * MIB - free) / 0.94)  # select.HEADROOM keeps 6% free
    one = select_layout(one_cfg, adapter, machine, _report(1), total_bytes=total,
                        update_gbps=10.0)  # fmt: skip
    two = select_layout(two_cfg, adapter, machine, _report(2), total_bytes=total,
                        update_gbps=10.0)  # fmt: skip
    assert one.layout != "4xN-r0"
    assert two.layout == "4xN-r0"
    # R=2: the offloaded candidate too, and the layers may stay resident (each rank owning
    # its groups' state, as data ranks do)
    assert [c.name for c in two.problem.candidates] == ["F-r0", "F-r1", "SAC.mm-r0", "N-r0"]
    assert two.problem.resident is not None
    # the tiny model's layers and embeddings fit beside the kept activations: all resident
    assert (two.resident_layers, two.resident_embeddings) == (LAYERS, True)
    # the hand count: a rank's 2 rows x 16 tokens; its heads attend over 32 keys, not 16;
    # q, k, v and the output cross the link in bf16 once a forward (N: once more backward)
    shape = layer_shapes(adapter.config, SEQ)[0]
    tokens = ROWS * SEQ // 2
    attention_s = 2 * shape.q_dim * (SEQ - SEQ // 2) * tokens / (ATTENTION_EFFICIENCY * H100_PEAK)
    a2a_s = tokens * (2 * shape.q_dim + 2 * shape.kv_dim) * 2 / (NVLINK_GBPS * 1e9)
    times = {c.name: c for c in two.problem.candidates}
    assert times["N-r0"].time_s == pytest.approx(18e-3 + 3 * attention_s + 2 * a2a_s)
    assert times["N-r0"].forward_s == pytest.approx(6e-3 + attention_s + a2a_s)
    # F replays the forward: its attention and its all-to-alls once more
    assert times["F-r0"].time_s == pytest.approx(30e-3 + 4 * attention_s + 3 * a2a_s)
    assert two.solution.compute_s >= 4 * times["N-r0"].time_s
