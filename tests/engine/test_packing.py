"""Packed rows through the engine: attention stays inside each sample.

The engine's loss on a packed batch must equal transformers' own loss on the same batch given
as ``batch.model_inputs()`` (per-sample position ids, no padding mask), and differ from the
loss with the positions ignored (the samples would see each other).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.tiny import make_model, write_config, write_data
from slidedp.config import load_config
from slidedp.data.batch import Batch
from slidedp.models.loss import IGNORE_INDEX
from slidedp.runtime.trainer import Trainer

pytestmark = pytest.mark.e2e  # every test here trains end to end


def _hf_loss(model: torch.nn.Module, batch: Batch, packed: bool) -> float:
    inputs = batch.model_inputs() if packed else {"input_ids": batch.input_ids}
    logits = model(**inputs, use_cache=False).logits.float()  # [B, S, V]
    targets = batch.labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )
    return float(loss)


def test_a_packed_batch_gives_transformers_loss_with_samples_kept_apart(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 12, min_len=4, max_len=10)
    config = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data,
        tmp_path / "out",
        data={"packing": True, "seq_len": 32},
        train={"max_steps": 1, "global_batch_size": 2, "learning_rate": 0.0},
    )
    trainer = Trainer(load_config(config), log=False)
    batch = trainer.data.batch(0)
    assert batch.position_ids is not None
    assert int((batch.position_ids == 0).sum()) > batch.input_ids.shape[0], "several per row"
    result = trainer.engine.step(0, batch, 0.0)
    trainer.engine.drain()

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        want = _hf_loss(hf, batch, packed=True)
        leaky = _hf_loss(hf, batch, packed=False)
    # float32, the same math: only the summation order differs (chunked loss, per-layer
    # streaming), ~1e-7 relative; a leak between samples moves the loss by > 1e-3 here.
    assert abs(result.loss - want) <= 1e-5 * abs(want)
    assert abs(result.loss - leaky) > 1e-4 * abs(want), "packing must change the attention"
