"""A GPU-resident group's gradient in the GPU estimate: counted once. The engine keeps it on
the group's owner from its backward to the step's end (``GradSync.hand_over`` hands it to
``ResidentLayers.keep``, never to the parked list), clipping or not; with clipping the
estimate counts it in the parked term (``parked_grad_bytes``: every group's gradient on its
owner), without clipping in the resident term (``plan.cost.resident_rank_bytes``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tiny import make_model, write_config, write_data
from estimate.machines import H100
from slidedp.config import load_config
from slidedp.estimate_report import estimate_run
from slidedp.models.hf import HFAdapter


@pytest.mark.parametrize("gpus", [1, 4])
def test_a_resident_gradient_counts_once_with_or_without_clipping(
    tmp_path: Path, gpus: int
) -> None:
    """Every layer and the embeddings resident (gpu route on 4 ranks: each owner's groups): the
    clipped estimate parks exactly the gradient bytes the unclipped one keeps in the resident
    term, and its resident term is the unclipped one's less them (exact: the same per-group
    integer bytes on the same owner)."""
    model = make_model(tmp_path / "models", "qwen3", tied=False)
    adapter = HFAdapter.from_dir(model)
    data = write_data(tmp_path / "data.jsonl", 8)
    path = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    gpus_keys = ["runtime.device=auto", f"runtime.gpus={gpus}", "runtime.grad_route=gpu"]
    keys = [*gpus_keys, "runtime.kernels=eager", "runtime.compile=false",
            f"runtime.resident_layers={adapter.num_layers}", "runtime.resident_embeddings=true",
            f"train.global_batch_size={gpus}"]  # fmt: skip
    gpu = {}
    for clip in (0.0, 1.0):
        cfg = load_config(path, [*keys, f"train.max_grad_norm={clip}"])
        est = estimate_run(cfg, adapter, H100, step_model=False).gpu
        assert est is not None
        gpu[clip > 0] = est
    clipped, unclipped = gpu[True], gpu[False]
    assert unclipped.parked_grad_bytes == 0
    assert clipped.parked_grad_bytes > 0
    assert clipped.resident_bytes == unclipped.resident_bytes - clipped.parked_grad_bytes
