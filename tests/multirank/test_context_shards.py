"""The shard and position maths of context parallelism (``runtime.context_parallel``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from engine.tiny import tiny_config
from slidedp.data.batch import IGNORE_INDEX, Batch
from slidedp.models.hf import HFAdapter
from slidedp.models.loss import shift_labels
from slidedp.runtime.context_parallel import (
    GATHER,
    ContextGroup,
    attention_scheme,
    bind_attention,
    full_sequence_masks,
    pad_width,
)


def _groups(r: int) -> list[ContextGroup]:
    return [ContextGroup(i, r) for i in range(r)]


def test_shards_tile_the_row_and_positions_are_global() -> None:
    x = torch.arange(2 * 12).reshape(2, 12)
    for r in (1, 2, 3, 4):
        shards = [g.shard(x) for g in _groups(r)]
        assert all(s.shape == (2, 12 // r) for s in shards)
        assert torch.equal(torch.cat(shards, dim=1), x)


def test_positions_are_global_or_per_sample_and_masks_span_the_rows() -> None:
    """The shards' RoPE positions tile the row's (global, or per packed sample); every shard
    reads the whole rows' positions for the masks."""
    ids = torch.ones(2, 12, dtype=torch.long)
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(12))])
    cpu = torch.device("cpu")
    for position_ids in (None, packed):
        batch = Batch(ids, torch.ones_like(ids), ids, position_ids)
        rows = torch.arange(12)[None] if position_ids is None else position_ids
        for r in (1, 2, 4):
            split = [g.layer_inputs(batch, cpu) for g in _groups(r)]
            shards = torch.cat([shared["position_ids"] for _, shared in split], dim=1)
            assert torch.equal(shards, rows)
            assert all(torch.equal(shared["row_position_ids"], rows) for _, shared in split)
            masks = [a for a, _ in split]  # the router loss's: packed rows have none
            if position_ids is not None:
                assert masks == [None] * r
            else:
                assert torch.equal(torch.cat(masks, dim=1), batch.attention_mask)  # type: ignore[arg-type]


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


def test_pad_width_continues_a_packed_rows_tail_segment() -> None:
    """A full packed row gets a padding segment from 0; a row with a tail continues it."""
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]])
    padded = pad_width(Batch(ids, mask, ids, positions), 4)
    assert padded.position_ids is not None
    assert torch.equal(padded.position_ids, torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2],
                                                          [0, 1, 2, 0, 1, 2, 3, 4]]))  # fmt: skip


def test_packed_masks_keep_samples_apart_over_the_whole_row() -> None:
    """Under Ulysses each rank attends over the whole row: its masks are the one-rank masks of
    the whole row (a token sees earlier tokens of its own sample only), not causal over it."""
    adapter = HFAdapter(tiny_config("qwen3", tied=False, layers=2))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])  # samples of 3, 4 and 1 tokens
    x = torch.zeros(1, 4, 64)  # one shard of R=2
    one_rank = adapter.layer_masks(torch.zeros(1, 8, 64), None, positions)
    bind_attention(adapter.config, ContextGroup(0, 2))
    masks = full_sequence_masks(adapter.layer_masks, x, {"row_position_ids": positions})
    sample = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    allowed = (sample[:, None] == sample[None]) & torch.ones(8, 8, dtype=torch.bool).tril()
    for mask, want in zip(masks, one_rank, strict=True):
        assert torch.equal(mask, want)
        assert torch.equal(mask[0, 0], allowed)


def test_auto_picks_ulysses_where_the_heads_divide_else_allgather() -> None:
    config = tiny_config("qwen3", tied=False, layers=2)  # 4 query, 2 key/value heads
    assert attention_scheme(config, ContextGroup(0, 2)) == "ulysses"
    assert attention_scheme(config, ContextGroup(0, 4)) == "allgather"
    assert attention_scheme(config, ContextGroup(0, 2, attention="allgather")) == "allgather"


def _sliding_qwen3(window: int | None) -> HFAdapter:
    """The tiny Qwen3 with a sliding-window layer (``window`` tokens) before a full one."""
    config = tiny_config("qwen3", tied=False, layers=2)
    if window is not None:
        config.sliding_window, config.layer_types = window, ["sliding_attention", "full_attention"]
    return HFAdapter(config)


@pytest.mark.parametrize("window", [None, 3])
def test_allgather_masks_are_each_shards_block_of_the_whole_rows_masks(window: int | None) -> None:
    """Under allgather each rank's masks are the blocks of the one-rank masks for its queries over
    the keys up to its shard's end (no later key is visible in a causal model), packed or
    within a sliding window; a plain causal row of full attention gives SDPA's lower-right
    causal bias over that block."""
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]])
    for positions in (packed, torch.arange(8)[None]):
        one_rank = _sliding_qwen3(window).layer_masks(torch.zeros(2, 8, 64), None, positions)
        for index in range(4):
            adapter = _sliding_qwen3(window)
            bind_attention(adapter.config, ContextGroup(index, 4))  # 2 key/value heads: allgather
            assert adapter.config._attn_implementation == GATHER
            shared = {"row_position_ids": positions}
            masks = full_sequence_masks(adapter.layer_masks, torch.zeros(2, 2, 64), shared)
            rows, end = slice(2 * index, 2 * index + 2), 2 * index + 2
            for mask, whole in zip(masks, one_rank, strict=True):
                if whole is None:  # plain causal on one rank too: the block's causal bias
                    assert isinstance(mask, CausalBias)
                    assert mask.variant == CausalVariant.LOWER_RIGHT
                    assert (mask.seq_len_q, mask.seq_len_kv) == (2, end)
                    continue
                assert torch.equal(mask, whole.expand(2, -1, -1, -1)[:, :, rows, :end])
                assert not whole[:, :, rows, end:].any()
        assert window is not None or positions is packed or one_rank == [None, None]
