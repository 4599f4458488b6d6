"""The estimate of a context-parallel run: each rank's activations are those of its shard."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen3Config

from engine.tiny import write_config, write_data
from estimate.machines import H100
from slidedp.config import TrainConfig, load_config
from slidedp.estimate_report import estimate_run
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The published Qwen3-8B config only: the adapter builds it on the meta device."""
    path = tmp_path_factory.mktemp("models") / "qwen3-8b"
    Qwen3Config(**SHAPES["qwen3-8b"]).save_pretrained(path)
    return path


def _cfg(tmp_path: Path, model: Path, *overrides: str) -> TrainConfig:
    data = write_data(tmp_path / "data.jsonl", 8)
    path = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    return load_config(path, ["runtime.device=auto", "train.max_grad_norm=0", *overrides])


def test_four_ranks_splitting_a_sequence_each_hold_a_quarter(
    tmp_path: Path, qwen3_8b: Path
) -> None:
    """Qwen3-8B at 64K on 4 ranks of R=4: each rank's activations and loss are those of one
    GPU at 16K, a quarter of one GPU's at 64K."""
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
    for part in ("layer_bytes", "checkpoint_bytes", "loss_bytes"):
        assert getattr(split.gpu, part) == getattr(quarter.gpu, part), part
    assert split.gpu.checkpoint_bytes * 4 == whole.gpu.checkpoint_bytes
