"""JSONL training data: ``{"input_ids": [...]}`` or ``{"text": "..."}`` per line.

Sequences are used in file order (no shuffling); step ``t`` takes sequences
``[t * B, (t + 1) * B)`` modulo the number of sequences (the file is cycled when it runs out).
Each sequence is truncated to ``seq_len``; a batch is right-padded to its longest sequence with
``pad_id``, padding masked out of attention and of the labels (-100). Labels are the inputs:
the model shifts them (position i predicts token i + 1), as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from slidedp.data.batch import IGNORE_INDEX, Batch
from slidedp.errors import DataError


def _tokenizer(model_dir: Path) -> object:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise DataError(
            f"data has 'text' lines but no tokenizer loads from {model_dir}: {e}"
        ) from None


def read_sequences(path: Path, seq_len: int, model_dir: Path) -> list[list[int]]:
    """Every line's token ids, truncated to ``seq_len`` (text is tokenized with the model's)."""
    sequences: list[list[int]] = []
    tokenizer: object | None = None
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DataError(f"cannot read data {path}: {e.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected an object with input_ids or text")
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise DataError(f"{path}:{number}: input_ids must be a list of integers")
        elif "text" in record:
            if tokenizer is None:
                tokenizer = _tokenizer(model_dir)
            ids = tokenizer(record["text"])["input_ids"]  # type: ignore[operator]
        else:
            raise DataError(f"{path}:{number}: expected 'input_ids' or 'text'")
        if len(ids) < 2:
            raise DataError(f"{path}:{number}: a sequence needs at least 2 tokens")
        sequences.append(list(ids[:seq_len]))
    if not sequences:
        raise DataError(f"{path} has no sequences")
    return sequences


def make_batch(sequences: list[list[int]], pad_id: int) -> Batch:
    """Right-pad to the longest sequence; mask padding out of attention and labels."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(sequences), length), dtype=torch.int64)
    for row, seq in enumerate(sequences):  # one row per sequence, not per element
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        mask[row, : len(seq)] = 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return Batch(ids, mask, labels)


class JsonlBatches:
    """The batch of each step, in file order."""

    def __init__(self, sequences: list[list[int]], batch_size: int, pad_id: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.sequences = sequences
        self.batch_size = batch_size
        self.pad_id = pad_id

    def batch(self, step: int) -> Batch:
        n = len(self.sequences)
        picks = [self.sequences[(step * self.batch_size + i) % n] for i in range(self.batch_size)]
        batch = make_batch(picks, self.pad_id)
        ids = batch.input_ids
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise DataError(
                f"step {step}: a token id in [{int(ids.min())}, {int(ids.max())}] is outside "
                f"the vocabulary of {self.vocab_size}"
            )
        return batch
