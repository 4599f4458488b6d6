"""What the estimate's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen3Config

from slidedp.models.shapes import SHAPES


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The published Qwen3-8B config only: the adapter builds it on the meta device."""
    path = tmp_path_factory.mktemp("models") / "qwen3-8b"
    Qwen3Config(**SHAPES["qwen3-8b"]).save_pretrained(path)
    return path
