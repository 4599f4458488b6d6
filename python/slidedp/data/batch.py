"""One step's global batch, as the engine consumes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, S] int64
    attention_mask: torch.Tensor  # [B, S] int64, 1 = token, 0 = padding
    labels: torch.Tensor  # [B, S] int64, IGNORE_INDEX on padding

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())
