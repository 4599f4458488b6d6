"""Packing: best fit without splitting samples, and attention kept inside each packed sample by
transformers itself when given ``Batch.model_inputs()`` (the engine's contract)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from data.helpers import VOCAB, build, make_tokenizer, write_jsonl
from slidedp.data.layout import pack_rows, pad_rows


def _rows_as_lists(lengths: list[int], seq_len: int) -> list[list[int]]:
    rows = pack_rows(np.asarray(lengths, dtype=np.int64), seq_len)
    bounds = zip(rows.offsets[:-1], rows.offsets[1:], strict=True)
    return [rows.samples[a:b].tolist() for a, b in bounds]


def test_best_fit_in_file_order() -> None:
    # 6 opens row 0 (room 2); 5 opens row 1 (room 3); 3 fills row 1; 2 fills row 0; 4 opens row 2
    assert _rows_as_lists([6, 5, 3, 2, 4], 8) == [[0, 3], [1, 2], [4]]
    # best fit, not first fit: 3 goes to the row with room 3 (row 1), not room 4 (row 0)
    assert _rows_as_lists([4, 5, 3, 4], 8) == [[0, 3], [1, 2]]


def test_every_sample_in_one_row_and_rows_within_seq_len() -> None:
    lengths = np.random.default_rng(0).integers(2, 65, size=2000)
    rows = pack_rows(lengths, 64)
    assert sorted(rows.samples.tolist()) == list(range(2000))  # each sample once, never split
    per_row = np.add.reduceat(lengths[rows.samples], rows.offsets[:-1])
    assert np.array_equal(per_row, rows.lengths)
    assert rows.lengths.max() <= 64
    assert rows.lengths.sum() / (len(rows) * 64) > 0.95  # best fit packs small samples densely
    assert len(pad_rows(lengths)) == 2000


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_computes_each_sample_as_if_alone(tmp_path: Path, attention: str) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    texts = ["w1 w2 w3 w4 w5", "w6 w7 w8", "w9 w10 w11 w12", "w13 w14"]
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    batch = build(data, tok, seq_len=12, packing=True).batch(0)
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        # no KV cache, as in training: transformers detects packing only without one
        packed = model(**batch.model_inputs(), use_cache=False).logits  # [B, S, V]
        unaware = model(input_ids=batch.input_ids, use_cache=False).logits  # positions ignored
        assert batch.position_ids is not None
        starts = (batch.position_ids == 0) & (batch.attention_mask == 1)
        compared = 0
        for b, s in starts.nonzero().tolist():
            end = s + 1
            while end < batch.input_ids.shape[1] and batch.position_ids[b, end] == end - s:
                end += 1
            alone = model(input_ids=batch.input_ids[b : b + 1, s:end], use_cache=False).logits[0]
            torch.testing.assert_close(packed[b, s:end], alone, rtol=1e-5, atol=1e-5)
            compared += 1
            if s > 0:  # a later sample of a row sees the earlier ones unless packing is honoured
                assert not torch.allclose(unaware[b, s:end], alone, atol=1e-3)
    assert compared == 4
    assert batch.input_ids.shape[0] == 2  # two rows: 4 samples were packed, not one per row
