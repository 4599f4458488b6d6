"""Mixtures of experts and layers of several kinds on one GPU (BF16) against FSDP2 mixed
precision: 200 steps, the load-balancing loss in both (transformers adds
``router_aux_loss_coef * aux_loss`` to the loss FSDP2 trains on; the engine computes it as
``models.router_loss`` does), the bound of ``test_gpu_parity.py``.

Both bf16 runs are also measured against the exact trajectory, FSDP2 with float32 compute.
The tiny Gemma 4 amplifies bf16 rounding: FSDP2 itself strays ~1e-2 from float32 there
(``test_bf16_rounding.py`` shows it on CPU), so 1e-3 between two bf16 runs cannot hold and
the test asks what does: ours no farther from float32 than FSDP2.

Run on the GPU machine: ``pytest -m "gpu and slow" tests/engine/test_gpu_moe_parity.py``; set
``SLIDEDP_PARITY_JSON=FILE`` to append each model's deltas to ``FILE.moe.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.mixed_precision import (
    fsdp2_losses,
    max_abs,
    mean_abs,
    our_losses,
    parity_data,
    train_config,
)
from engine.test_bf16_rounding import ROUNDING_RATIO
from engine.tiny import make_model

LAYERS = 4
STEPS = 200
BOUND = 1e-3  # the bound of test_gpu_parity.py (the paper: 5.2e-4 against FSDP2)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma4_text", "qwen3_5_moe_text", "qwen3_moe", "mixtral"])
def test_moe_and_mixed_kinds_track_fsdp2(tmp_path: Path, arch: str) -> None:
    model_dir = make_model(tmp_path, arch, tied=True, layers=LAYERS)
    data = parity_data(tmp_path, STEPS)
    train = train_config(STEPS)
    ref = fsdp2_losses(model_dir, data, train, device="cuda")
    exact = fsdp2_losses(model_dir, data, train, device="cuda", param_dtype=torch.float32)
    ours = our_losses(tmp_path, model_dir, data, train, arch, device="cuda", layers="F-r1",
                      bf16_mirror=True)  # fmt: skip
    delta, ours_f32, fsdp2_f32 = max_abs(ours, ref), mean_abs(ours, exact), mean_abs(ref, exact)
    noise = max_abs(ref, exact)  # FSDP2's own distance from float32
    summary = {
        "arch": arch,
        "max_abs_delta_loss": delta,
        "mean_abs_delta_loss": mean_abs(ours, ref),
        "ours_vs_f32_mean": ours_f32,
        "fsdp2_vs_f32_mean": fsdp2_f32,
        "fsdp2_vs_f32_max": noise,
        "first_loss": [ours[0], ref[0]],
        "last_loss": [ours[-1], ref[-1]],
    }
    if path := os.environ.get("SLIDEDP_PARITY_JSON"):
        with Path(path).with_suffix(".moe.jsonl").open("a") as f:
            f.write(json.dumps(summary) + "\n")
    print(summary)
    assert ours_f32 <= ROUNDING_RATIO * fsdp2_f32
    if noise <= BOUND:  # the bound means something above the noise
        assert delta <= BOUND
    else:
        assert arch == "gemma4_text", "only the tiny Gemma 4 was measured this sensitive"
