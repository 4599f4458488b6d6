"""BF16 training on one CUDA GPU (run on the device machine: ``pytest -m gpu tests/engine``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.tiny import make_model, write_config, write_data
from slidedp.config import load_config
from slidedp.runtime.trainer import Trainer

pytestmark = pytest.mark.e2e  # every test here trains end to end


@pytest.mark.gpu
def test_bf16_training_on_gpu_lowers_the_loss_with_depth_independent_param_memory(
    tmp_path: Path,
) -> None:
    assert torch.cuda.is_available()
    data = write_data(tmp_path / "data.jsonl", 8)  # 2 batches, cycled: the model memorises
    param_bytes = []
    for layers in (2, 6):
        model = make_model(tmp_path, "qwen3", tied=True, layers=layers)
        out = tmp_path / f"out{layers}"
        config = write_config(
            tmp_path / f"c{layers}.yaml",
            model,
            data,
            out,
            train={"max_steps": 20, "learning_rate": 3e-3, "dtype": "bfloat16"},
            runtime={"device": "cuda", "offload_ratio": 1},
        )
        trainer = Trainer(load_config(config), log=False)
        records = trainer.run()
        assert records[-1]["loss"] < records[0]["loss"] - 0.5
        assert all(r["h2d_s"] > 0 and r["compute_s"] > 0 for r in records)
        param_bytes.append(trainer.engine.window.param_bytes())
    assert param_bytes[0] == param_bytes[1]
