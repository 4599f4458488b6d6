"""One step's global batch, as the engine consumes it.

Labels are the inputs (the model shifts them, ``models.loss.shift_labels``); padding and
untrained tokens are ``IGNORE_INDEX``. The loss is the mean over the global batch's label tokens.
Rows (``data.packing``): padded (``position_ids is None``, one right-padded sample per row) or
packed (``position_ids`` restart at 0 at each sample, the tail padding a segment of its own; a
sample's first token is never a target). Invariant for a packed batch (``model_inputs``):
``position_ids`` go to the rotary embeddings and the mask builders with ``attention_mask=None``
and no cache, so transformers keeps attention inside each sample
(``masking_utils.find_packed_sequence_indices``); ``attention_mask`` only counts tokens.

Example::

    logits = hf_model(**batch.model_inputs(), use_cache=False).logits  # [B, S, V], samples apart
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, S] int64
    attention_mask: torch.Tensor  # [B, S] int64, 1 = token, 0 = padding
    labels: torch.Tensor  # [B, S] int64, IGNORE_INDEX on padding and untrained tokens
    position_ids: torch.Tensor | None = None  # [B, S] int64, packed rows only (see above)

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of a transformers causal LM's forward for this batch."""
        if self.position_ids is None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        return {
            "input_ids": self.input_ids,
            "attention_mask": None,
            "position_ids": self.position_ids,
        }
