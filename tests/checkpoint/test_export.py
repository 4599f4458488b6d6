"""``slidedp export`` refusals: one line, exit 2, nothing written anywhere (CPU, no engine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cli.util import one_error_line, run
from engine.tiny import make_model
from slidedp.io.checkpoint import Progress, save_checkpoint
from slidedp.models.hf import HFAdapter
from slidedp.store import HostStore


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    adapter = HFAdapter.from_dir(make_model(tmp_path, "qwen3", tied=True))
    store = HostStore.create(adapter.group_specs(), staging_slots=2)
    for _, name in adapter.iter_params():
        store.param(name).copy_(torch.randn(store.param(name).shape))
    meta = {"train": {"global_batch_size": 8}}
    return save_checkpoint(tmp_path / "out", adapter, store, Progress(step=3, adam_step=3), meta)


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("a-file", "a-file exists and is a file"),
        ("a-file/hf", "cannot be created: "),
        ("out/checkpoint-3/hf", "is inside the checkpoint or model directory"),
        ("out/checkpoint-3/optimizer/hf", "is inside the checkpoint or model directory"),
        ("qwen3-tied-2/hf", "is inside the checkpoint or model directory"),  # the model
    ],
)
def test_export_refuses_a_target_it_must_not_write(
    capsys: pytest.CaptureFixture[str], checkpoint: Path, target: str, needle: str
) -> None:
    root = checkpoint.parents[1]
    assert (root / "qwen3-tied-2" / "config.json").is_file()
    (root / "a-file").write_text("keep me")
    before = _tree(root)
    code, _, err = run(capsys, "export", str(checkpoint), str(root / target))
    assert code == 2
    one_error_line(err, "export", needle, "choose" if "inside" in needle else "")
    assert _tree(root) == before
    assert not (root / target).exists() or target == "a-file"


def test_export_refuses_a_damaged_checkpoint(
    capsys: pytest.CaptureFixture[str], checkpoint: Path
) -> None:
    os.truncate(checkpoint / "model.safetensors", 100)  # a copy cut short
    root = checkpoint.parents[1]
    before = _tree(root)
    code, _, err = run(capsys, "export", str(checkpoint), str(root / "hf"))
    assert code == 2
    one_error_line(err, "export", f"checkpoint {checkpoint} is damaged: model.safetensors has 100")
    assert _tree(root) == before
