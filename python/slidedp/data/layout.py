"""Which samples go in which row: one per row (padding) or packed (``data.packing``).

Packing never splits a sample across rows (attention is kept inside each sample, so a split one
would lose its context). It is online best fit in file order: each sample goes into the open row
with the least room that still holds it, or starts a new row; rows are numbered by their first
sample, so without shuffling training still follows the file. Best fit on many small samples
fills rows nearly as well as the offline best-fit-decreasing (TRL's default), without putting all
long samples first. The loop is per sample (not per token), with one vectorised search each.

Example::

    rows = pack_rows(samples.lengths, seq_len=2048)
    first_row_samples = rows.samples[rows.offsets[0] : rows.offsets[1]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slidedp.data.samples import I64, offsets_of


@dataclass(frozen=True)
class Rows:
    samples: I64  # [N] sample indices, row after row, each row's in file order
    offsets: I64  # [R + 1] row r = samples[offsets[r] : offsets[r + 1]]
    lengths: I64  # [R] tokens in each row

    def __len__(self) -> int:
        return len(self.lengths)


def pad_rows(lengths: I64) -> Rows:
    """One sample per row."""
    return Rows(np.arange(len(lengths), dtype=np.int64), offsets_of(np.ones_like(lengths)), lengths)


def pack_rows(lengths: I64, seq_len: int) -> Rows:
    """Online best fit in file order (every length must be <= ``seq_len``)."""
    assert len(lengths) == 0 or int(lengths.max()) <= seq_len
    open_by_room: list[list[int]] = [[] for _ in range(seq_len + 1)]  # rows with that much room
    has_room = np.zeros(seq_len + 1, dtype=np.bool_)  # open_by_room[room] is not empty
    row_of = np.empty(len(lengths), dtype=np.int64)
    row_len: list[int] = []
    for i, need in enumerate(lengths.tolist()):
        room = need + int(np.argmax(has_room[need:]))  # the least room >= need, if any
        if has_room[room]:
            row = open_by_room[room].pop()
            has_room[room] = bool(open_by_room[room])
        else:
            row = len(row_len)
            row_len.append(0)
        row_len[row] += need
        left = seq_len - row_len[row]
        if left >= 2:  # a sample has 2 tokens at least
            open_by_room[left].append(row)
            has_room[left] = True
        row_of[i] = row
    order = np.argsort(row_of, kind="stable")  # row by row, file order inside a row
    counts = np.bincount(row_of, minlength=len(row_len)).astype(np.int64)
    return Rows(order.astype(np.int64), offsets_of(counts), np.asarray(row_len, dtype=np.int64))
