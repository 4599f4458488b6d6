"""Each data format and file type gives the exact expected tensors, loss masks included."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.helpers import ASSISTANT, BOS, END, EOS, PAD, SYSTEM, USER, build, make_tokenizer
from data.helpers import write_jsonl as jsonl

X = -100  # IGNORE_INDEX


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return make_tokenizer(tmp_path / "tok")


def test_text_is_padded_with_bos_and_no_eos(tmp_path: Path, tok: Path) -> None:
    data = jsonl(tmp_path / "t.jsonl", [{"text": "w1 w2 w3"}, {"text": "w4 w5", "id": 7}])
    batch = build(data, tok).batch(0)
    assert batch.input_ids.tolist() == [[BOS, 1, 2, 3], [BOS, 4, 5, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch.labels.tolist() == [[BOS, 1, 2, 3], [BOS, 4, 5, X]]
    assert batch.position_ids is None
    assert batch.tokens == 7


def test_packed_text_gets_eos_and_restarting_positions(tmp_path: Path, tok: Path) -> None:
    data = jsonl(tmp_path / "t.jsonl", [{"text": "w1 w2 w3"}, {"text": "w4 w5"}, {"text": "w6"}])
    batch = build(data, tok, seq_len=8, packing=True).batch(0)
    # best fit: sample 0 (5 tokens) opens row 0, sample 1 (4) does not fit there and opens
    # row 1, sample 2 (3) fills row 0 exactly
    assert batch.input_ids.tolist() == [
        [BOS, 1, 2, 3, EOS, BOS, 6, EOS],
        [BOS, 4, 5, EOS, PAD, PAD, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch.position_ids is not None
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]
    # a sample's first token is never a target: no prediction across samples
    assert batch.labels.tolist() == [[X, 1, 2, 3, EOS, X, 6, EOS], [X, 4, 5, EOS, X, X, X, X]]


def test_prompt_completion_trains_on_the_completion_and_eos(tmp_path: Path, tok: Path) -> None:
    data = jsonl(
        tmp_path / "pc.jsonl",
        [{"prompt": "w1 w2", "completion": "w3 w4"}, {"prompt": "w5", "completion": "w6 </s>"}],
    )
    batch = build(data, tok).batch(0)
    assert batch.input_ids.tolist() == [[BOS, 1, 2, 3, 4, EOS], [BOS, 5, 6, EOS, PAD, PAD]]
    assert batch.labels.tolist() == [[X, X, X, 3, 4, EOS], [X, X, 6, EOS, X, X]]
    everything = build(data, tok, train_on_prompt=True).batch(0)
    assert everything.labels.tolist() == [[BOS, 1, 2, 3, 4, EOS], [BOS, 5, 6, EOS, X, X]]


CONVERSATION = [
    {"role": "system", "content": "w0"},
    {"role": "user", "content": "w1"},
    {"role": "assistant", "content": "w2 w3"},
    {"role": "user", "content": "w4"},
    {"role": "assistant", "content": "w5"},
]
# <s><|system|> w0 <|end|> <|user|> w1 <|end|> <|assistant|> w2 w3 <|end|> <|user|> w4 ...
CONVERSATION_IDS = [BOS, SYSTEM, 0, END, USER, 1, END, ASSISTANT, 2, 3, END, USER, 4, END]
CONVERSATION_IDS += [ASSISTANT, 5, END]
# the assistant turns' content and end-of-turn marker, not the role headers
CONVERSATION_LABELS = [X] * 8 + [2, 3, END] + [X] * 4 + [5, END]


def test_messages_train_on_assistant_turns_only(tmp_path: Path, tok: Path) -> None:
    short = [{"role": "user", "content": "w6 w7"}, {"role": "assistant", "content": "w8"}]
    data = jsonl(tmp_path / "m.jsonl", [{"messages": CONVERSATION}, {"messages": short}])
    batch = build(data, tok, seq_len=32).batch(0)
    short_ids = [BOS, USER, 6, 7, END, ASSISTANT, 8, END]
    assert batch.input_ids.tolist() == [CONVERSATION_IDS, short_ids + [PAD] * 9]
    assert batch.labels.tolist() == [CONVERSATION_LABELS, [X] * 6 + [8, END] + [X] * 9]
    everything = build(data, tok, seq_len=32, train_on_prompt=True).batch(0)
    assert everything.labels.tolist() == [CONVERSATION_IDS, short_ids + [X] * 9]


def test_input_ids_are_taken_as_given(tmp_path: Path, tok: Path) -> None:
    data = jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    batch = build(data, tok).batch(0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 9, PAD]]
    assert batch.labels.tolist() == [[5, 6, 7], [8, 9, X]]


def test_input_ids_labels_mask_the_tokens_not_trained_on_in_every_file_type(
    tmp_path: Path, tok: Path
) -> None:
    records = [{"input_ids": [5, 6, 7, 8], "labels": [X, X, 7, 8]}, {"input_ids": [8, 9, 4]}]
    (tmp_path / "d.json").write_text(json.dumps(records))
    with_labels = [{"input_ids": [5, 6, 7, 8], "labels": [X, X, 7, 8]},
                   {"input_ids": [8, 9, 4], "labels": [X, 9, X]}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(with_labels), tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "null.parquet")  # a null row
    expected = {
        "d.jsonl": [[X, X, 7, 8], [8, 9, 4, X]],  # a record without labels trains on every token
        "d.json": [[X, X, 7, 8], [8, 9, 4, X]],
        "d.parquet": [[X, X, 7, 8], [X, 9, X, X]],
        "null.parquet": [[X, X, 7, 8], [8, 9, 4, X]],
    }
    jsonl(tmp_path / "d.jsonl", records)
    for name, labels in expected.items():
        batch = build(tmp_path / name, tok).batch(0)
        assert batch.input_ids.tolist() == [[5, 6, 7, 8], [8, 9, 4, PAD]], name
        assert batch.labels.tolist() == labels, name


RECORDS = [
    {"input_ids": [5, 6, 7]},
    {"input_ids": [8, 9]},
    {"text": "w1 w2"},
    {"prompt": "w1", "completion": "w2"},
    {"messages": CONVERSATION},
]


@pytest.mark.parametrize("record", [0, 2, 3, 4])
def test_jsonl_json_and_parquet_give_the_same_batches(
    tmp_path: Path, tok: Path, record: int
) -> None:
    records = [RECORDS[record], RECORDS[1] if record == 0 else RECORDS[record]]
    (tmp_path / "d.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    batches = [
        build(path, tok, seq_len=32).batch(0)
        for path in (
            jsonl(tmp_path / "d.jsonl", records),
            tmp_path / "d.json",
            tmp_path / "d.parquet",
        )
    ]
    for other in batches[1:]:
        assert torch.equal(other.input_ids, batches[0].input_ids)
        assert torch.equal(other.labels, batches[0].labels)
        assert torch.equal(other.attention_mask, batches[0].attention_mask)


def test_parquet_input_ids_column_of_a_later_row_group(tmp_path: Path, tok: Path) -> None:
    """The flat (values, offsets) path: sliced arrays, several row groups, int32 lists."""
    ids = [[i % 20, (i + 1) % 20, (i + 2) % 20][: 2 + i % 2] for i in range(10)]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
    batches = build(tmp_path / "d.parquet", tok, batch_size=10)
    assert [row[: len(ids[i])] for i, row in enumerate(batches.batch(0).input_ids.tolist())] == ids
