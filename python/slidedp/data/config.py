"""The ``data:`` section of the training config (owned by the data package)."""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.errors import require as _require


@dataclass(kw_only=True)
class DataSection:
    path: str  # JSONL: {"input_ids": [...]} or {"text": "..."} per line
    seq_len: int = 1024

    def __post_init__(self) -> None:
        _require(bool(self.path), "data.path is required")
        _require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
