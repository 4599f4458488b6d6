"""Attention's quadratic term in the step-time model (``plan.timing``): priced at
``ATTENTION_EFFICIENCY`` of the peak, the rate measured at long sequences, apart from the
matmuls' ``LAYER_EFFICIENCY``."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen3Config

from engine.tiny import write_config, write_data
from estimate.machines import H100
from slidedp.config import load_config
from slidedp.estimate_report import estimate_run
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES

SEQ = 131072


def test_the_long_sequence_record_the_attention_rate_comes_from(tmp_path: Path) -> None:
    """Qwen3-4B at 131,072 tokens on one H100, every layer F: the compute-only reference ran
    2,645 tokens/s, 49.55 s a step (benchmarks/2026-11-24-moe-long-context-h100.md, "Long
    sequences"). The model's compute lane (layers, head) is that step within 1% (the
    constant's three digits); attention at the matmuls' rate would make it 67 s."""
    model = tmp_path / "qwen3-4b"
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    Qwen3Config(**{**SHAPES["qwen3-4b"], "max_position_embeddings": SEQ,
                   "rope_scaling": rope}).save_pretrained(model)  # fmt: skip
    data = write_data(tmp_path / "data.jsonl", 2)
    path = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    cfg = load_config(path, ["runtime.device=auto", f"data.seq_len={SEQ}", "runtime.layers=F",
                             "train.global_batch_size=1", "runtime.policy=fixed"])  # fmt: skip
    est = estimate_run(cfg, HFAdapter.from_dir(model), H100)
    assert est.step_model is not None
    assert est.step_model.busy_s["compute"] == pytest.approx(SEQ / 2645, rel=0.01)
