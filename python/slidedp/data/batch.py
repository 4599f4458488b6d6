"""One step's global batch, as the engine consumes it.

Labels are the inputs (the model shifts them: position ``i`` predicts token ``i + 1``, see
``slidedp.models.loss.shift_labels``); padding and untrained tokens (prompts, user turns) are
``IGNORE_INDEX`` in ``labels``. The loss is the mean over all label tokens of the global batch.

Two row layouts (``data.packing``):

- padded (``position_ids is None``): one sample per row, right-padded; ``attention_mask`` marks
  the tokens and positions are ``0 .. S-1`` (the models' default).
- packed (``position_ids`` set): several samples per row, back to back, padding only at a row's
  tail. ``position_ids`` restart at 0 at each sample (the tail padding restarts too, so it is a
  segment of its own, with ``IGNORE_INDEX`` labels). The first token of each sample is never a
  target, so no sample is trained to predict the next one's start.

What the engine must do with a packed batch (``model_inputs`` returns exactly this): pass
``position_ids`` [B, S] to the rotary embeddings and to transformers' mask builders, and pass
``attention_mask=None`` and no cache to the mask builders: transformers then
detects the packed samples from the position ids (``masking_utils.find_packed_sequence_indices``,
skipped when there is a mask or a cache) and keeps attention inside each sample.
``attention_mask`` stays set only to count tokens (``Batch.tokens``).

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
