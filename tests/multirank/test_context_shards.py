"""The shard and position maths of context parallelism (``runtime.context_parallel``)."""

from __future__ import annotations

import torch

from slidedp.data.batch import IGNORE_INDEX, Batch
from slidedp.models.loss import shift_labels
from slidedp.runtime.context_parallel import ContextGroup, pad_width


def _groups(r: int) -> list[ContextGroup]:
    return [ContextGroup(i, r) for i in range(r)]


def test_shards_tile_the_row_and_positions_are_global() -> None:
    x = torch.arange(2 * 12).reshape(2, 12)
    for r in (1, 2, 3, 4):
        shards = [g.shard(x) for g in _groups(r)]
        assert all(s.shape == (2, 12 // r) for s in shards)
        assert torch.equal(torch.cat(shards, dim=1), x)
        positions = torch.cat([g.positions(12, torch.device("cpu")) for g in _groups(r)], dim=1)
        assert torch.equal(positions, torch.arange(12)[None])


def test_labels_are_shifted_across_shard_boundaries() -> None:
    """Each shard's last target is the next shard's first label: the labels are shifted over
    the whole row before it is split, so no token loses its target at a boundary."""
    labels = torch.arange(10, 18)[None]  # [1, 8]
    targets = [g.shard(shift_labels(labels)) for g in _groups(2)]
    assert targets[0][0, -1] == 14
    assert targets[1][0, 0] == 15
    assert targets[1][0, -1] == IGNORE_INDEX


def test_pad_width_adds_masked_unlabelled_tokens() -> None:
    batch = Batch(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long),
                  torch.full((2, 5), 7))  # fmt: skip
    padded = pad_width(batch, 4)
    assert padded.input_ids.shape == (2, 8)
    assert torch.equal(padded.attention_mask[:, 5:], torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(padded.labels[:, 5:], torch.full((2, 3), IGNORE_INDEX))
    assert torch.equal(padded.labels[:, :5], batch.labels)
    assert pad_width(batch, 5) is batch
