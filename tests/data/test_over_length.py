"""The over-length policy (truncate | drop | error) and the counts the report gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.helpers import EOS, build, make_tokenizer, write_jsonl
from slidedp.errors import DataError

X = -100


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "ids.jsonl",
        [
            {"input_ids": [1, 2, 3]},
            {"input_ids": list(range(10))},  # 10 > seq_len 6: 4 over
            {"input_ids": [4, 5]},
            {"input_ids": list(range(8))},  # 2 over
        ],
    )


def test_truncate_keeps_the_first_seq_len_tokens_and_counts(tmp_path: Path, data: Path) -> None:
    batches = build(data, tmp_path, seq_len=6, pad_id=0)
    assert batches.batch(0).input_ids.tolist() == [[1, 2, 3, 0, 0, 0], [0, 1, 2, 3, 4, 5]]
    r = batches.report
    assert (r.records, r.sequences, r.truncated, r.truncated_tokens, r.dropped) == (4, 4, 2, 6, 0)
    assert r.tokens == 3 + 6 + 2 + 6
    assert r.label_tokens == r.tokens - 4  # a sample's first token is never a target
    assert "2 truncated (6 tokens cut), 0 dropped" in str(r)


def test_drop_leaves_over_length_samples_out_and_counts(tmp_path: Path, data: Path) -> None:
    batches = build(data, tmp_path, seq_len=6, pad_id=0, over_length="drop")
    assert batches.batch(0).input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    r = batches.report
    assert (r.records, r.sequences, r.truncated, r.dropped) == (4, 2, 0, 2)
    assert "0 truncated (0 tokens cut), 2 dropped" in str(r)


def test_error_names_the_first_over_length_line(tmp_path: Path, data: Path) -> None:
    with pytest.raises(DataError, match=r"ids\.jsonl:2: 10 tokens > data\.seq_len=6"):
        build(data, tmp_path, seq_len=6, pad_id=0, over_length="error")


def test_dropping_everything_is_one_clear_error(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "long.jsonl", [{"input_ids": [1, 2, 3]}] * 3)
    with pytest.raises(DataError, match=r"no sample is left of 3 .* \(3 dropped"):
        build(data, tmp_path, seq_len=2, over_length="drop")


def test_a_truncated_sample_left_without_a_target_is_left_out(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    data = write_jsonl(
        tmp_path / "pc.jsonl",
        [
            {"prompt": "w1 w2 w3 w4 w5 w6", "completion": "w7"},  # the prompt fills seq_len
            {"prompt": "w1", "completion": "w2 w3 w4 w5 w6 w7"},  # cut inside the completion
        ],
    )
    batches = build(data, tok, seq_len=5, batch_size=1)
    assert batches.batch(0).labels.tolist() == [[X, X, 2, 3, 4]]
    assert batches.batch(1).labels.tolist() == [[X, X, 2, 3, 4]]  # one sample left: it cycles
    r = batches.report
    assert (r.truncated, r.unlabeled, r.sequences) == (2, 1, 1)
    assert "1 left out with nothing to train on" in str(r)
    assert EOS not in batches.batch(0).input_ids.tolist()[0]


def test_packing_efficiency_is_tokens_over_row_capacity(tmp_path: Path, data: Path) -> None:
    packed = build(data, tmp_path, seq_len=12, pad_id=0, packing=True).report
    # samples of 3, 10, 2, 8 tokens: best fit gives the rows 3 + 8 and 10 + 2
    assert packed.rows == 2
    assert packed.packing_efficiency == pytest.approx(23 / 24)
    padded = build(data, tmp_path, seq_len=12, pad_id=0).report
    assert padded.packing_efficiency == pytest.approx(23 / 48)
