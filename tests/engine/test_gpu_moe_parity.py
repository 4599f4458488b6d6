"""Mixtures of experts and layers of several kinds on one GPU (BF16) against FSDP2 mixed
precision: 200 steps, the load-balancing loss in both (transformers adds
``router_aux_loss_coef * aux_loss`` to the loss FSDP2 trains on; the engine computes it as
``models.router_loss`` does), the bound of ``test_gpu_parity.py``.

Run on the GPU machine: ``pytest -m "gpu and slow" tests/engine/test_gpu_moe_parity.py``; set
``SLIDEDP_PARITY_JSON=FILE`` to append each model's deltas to ``FILE.moe.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.test_gpu_parity import _data, _fsdp2_losses, _ours
from engine.tiny import make_model

LAYERS = 4


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma4_text", "qwen3_5_moe_text", "qwen3_moe", "mixtral"])
def test_moe_and_mixed_kinds_track_fsdp2(tmp_path: Path, arch: str) -> None:
    model_dir = make_model(tmp_path, arch, tied=True, layers=LAYERS)
    data = _data(tmp_path)
    ref = _fsdp2_losses(model_dir, data)
    ours = _ours(tmp_path, model_dir, data, arch, layers="F-r1", bf16_mirror=True)
    deltas = [abs(a - b) for a, b in zip(ours, ref, strict=True)]
    summary = {
        "arch": arch,
        "max_abs_delta_loss": max(deltas),
        "mean_abs_delta_loss": sum(deltas) / len(deltas),
        "first_loss": [ours[0], ref[0]],
        "last_loss": [ours[-1], ref[-1]],
    }
    if path := os.environ.get("SLIDEDP_PARITY_JSON"):
        with Path(path).with_suffix(".moe.jsonl").open("a") as f:
            f.write(json.dumps(summary) + "\n")
    print(summary)
    assert max(deltas) <= 1e-3  # the bound of test_gpu_parity.py
