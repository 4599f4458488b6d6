"""Tokenized samples stored compactly, and the over-length policy (``data.over_length``).

All samples' token ids live in one int32 array with int64 offsets, next to a bool array that
marks the tokens trained on (labels); nothing holds a Python int per token. Every operation here
is a handful of vectorised numpy calls over the whole data set.

Example::

    samples = Samples.concat(parts)
    kept, counts = apply_over_length(samples, seq_len=1024, policy="truncate", where=source.where)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import numpy.typing as npt

from slidedp.errors import DataError

I64 = npt.NDArray[np.int64]


def positions_within(lengths: I64) -> I64:
    """The position of each element inside its segment: lengths [2, 3] → [0, 1, 0, 1, 2]."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)


def flatten_lists(lists: Sequence[Sequence[int]]) -> tuple[I64, I64]:
    """Lists of ints (a tokenizer's output) → (values [T], lengths [n]), converted in C."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    values = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    return values, lengths


def flatten_pairs(lists: Sequence[Sequence[tuple[int, int]]], count: int) -> I64:
    """Lists of ``count`` (start, end) pairs in all (a tokenizer's offset mapping) → [count, 2],
    converted in C like ``flatten_lists`` (no intermediate list of the pairs)."""
    flat = chain.from_iterable(chain.from_iterable(lists))
    return np.fromiter(flat, dtype=np.int64, count=2 * count).reshape(count, 2)


def offsets_of(lengths: I64) -> I64:
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)


@dataclass(frozen=True)
class Samples:
    tokens: npt.NDArray[np.int32]  # [T] every sample's token ids back to back
    trained: npt.NDArray[np.bool_]  # [T] True where the token is a label (loss on it)
    offsets: I64  # [N + 1] sample i = tokens[offsets[i] : offsets[i + 1]]
    numbers: I64  # [N] the 1-based line / record / row each sample came from

    @property
    def lengths(self) -> I64:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.numbers)

    @classmethod
    def concat(cls, parts: Sequence[Samples]) -> Samples:
        lengths = np.concatenate([p.lengths for p in parts] or [np.zeros(0, np.int64)])
        return cls(
            np.concatenate([p.tokens for p in parts] or [np.zeros(0, np.int32)]),
            np.concatenate([p.trained for p in parts] or [np.zeros(0, np.bool_)]),
            offsets_of(lengths),
            np.concatenate([p.numbers for p in parts] or [np.zeros(0, np.int64)]),
        )

    def select(
        self, keep_sample: npt.NDArray[np.bool_], keep_token: npt.NDArray[np.bool_]
    ) -> Samples:
        """The kept samples, each reduced to its kept tokens (a prefix of it)."""
        starts = self.offsets[:-1]
        kept_lengths = np.add.reduceat(keep_token, starts) if len(starts) else np.zeros(0)
        lengths = kept_lengths.astype(np.int64)[keep_sample]
        token_mask = keep_token & np.repeat(keep_sample, self.lengths)
        return Samples(
            self.tokens[token_mask],
            self.trained[token_mask],
            offsets_of(lengths),
            self.numbers[keep_sample],
        )

    def label_counts(self) -> I64:
        """[N] tokens each sample is trained to predict (its first token never is a target)."""
        targets = self.trained.copy()
        targets[self.offsets[:-1]] = False
        return np.add.reduceat(targets, self.offsets[:-1]).astype(np.int64)


@dataclass(frozen=True)
class OverLengthCounts:
    truncated: int  # samples cut to seq_len (policy truncate)
    truncated_tokens: int  # tokens cut off them
    dropped: int  # samples left out (policy drop)
    unlabeled: int  # truncated samples left out: nothing to train on remained


def apply_over_length(
    samples: Samples, seq_len: int, policy: str, where: Callable[[int], str]
) -> tuple[Samples, OverLengthCounts]:
    """``truncate`` keeps the first ``seq_len`` tokens, ``drop`` leaves the sample out,
    ``error`` raises on the first over-length sample. Either way the counts say how many."""
    lengths = samples.lengths
    over = lengths > seq_len
    if policy == "error" and over.any():
        i = int(np.argmax(over))
        raise DataError(
            f"{where(int(samples.numbers[i]))}: {int(lengths[i])} tokens > data.seq_len="
            f"{seq_len} (data.over_length=error); raise data.seq_len or set data.over_length "
            "to truncate or drop"
        )
    if policy == "drop":
        keep_token = np.ones(len(samples.tokens), dtype=np.bool_)
        kept = samples.select(~over, keep_token)
        return kept, OverLengthCounts(0, 0, int(over.sum()), 0)
    keep_token = positions_within(lengths) < seq_len
    cut = samples.select(np.ones(len(samples), dtype=np.bool_), keep_token)
    # A prompt longer than seq_len leaves nothing to train on: such a sample is left out (every
    # sample had a label before: ``encode`` checks it, so only truncated ones can have none).
    labeled = cut.label_counts() > 0
    unlabeled = int((~labeled).sum())
    if unlabeled:
        cut = cut.select(labeled, np.ones(len(cut.tokens), dtype=np.bool_))
    counts = OverLengthCounts(int(over.sum()), int((lengths[over] - seq_len).sum()), 0, unlabeled)
    return cut, counts
