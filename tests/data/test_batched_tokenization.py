"""Tokenization is batched (one tokenizer call per chunk of records, not per line) and the
token ids are stored compactly (int32 arrays, not Python ints)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from data.helpers import build, make_tokenizer, write_jsonl
from slidedp.data import sources

CHUNK = 64  # records per chunk in this test (the real one is sources.RECORDS_PER_CHUNK)
N = 2 * CHUNK + 5  # three chunks


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every tokenizer call."""
    sizes: list[int] = []
    original = PreTrainedTokenizerBase.__call__

    def counting(self: Any, text: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(text) if isinstance(text, list) else 1)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counting)
    monkeypatch.setattr(sources, "RECORDS_PER_CHUNK", CHUNK)
    return sizes


@pytest.mark.parametrize(
    ("record", "calls_per_chunk"),
    [
        ({"text": "w1 w2 w3"}, 1),
        ({"prompt": "w1 w2", "completion": "w3"}, 2),
        (
            {
                "messages": [
                    {"role": "user", "content": "w1"},
                    {"role": "assistant", "content": "w2"},
                ]
            },
            1,
        ),
    ],
)
def test_one_tokenizer_call_per_chunk(
    tmp_path: Path, calls: list[int], record: dict[str, Any], calls_per_chunk: int
) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", [record] * N)
    batches = build(data, tok)
    chunks = math.ceil(N / CHUNK)
    assert len(calls) == chunks * calls_per_chunk
    assert sum(calls) == N * calls_per_chunk
    assert batches.report.sequences == N
    assert batches.samples.tokens.dtype == np.int32
    assert batches.samples.trained.dtype == np.bool_
