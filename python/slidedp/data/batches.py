"""The batch of each step, a pure function of (config, data file, step), and the data report.

Step ``t`` takes rows ``t * B .. t * B + B - 1`` of an endless sequence of epochs; epoch ``e``
visits every row once, in file order, or with ``data.shuffle`` in the order of a permutation
seeded by ``(train.seed, e)``. Nothing depends on earlier calls, so resuming at step ``t`` is
calling ``batch(t)``. A batch is as wide as its longest row (at most ``seq_len``).

Example::

    batches, held = build_data(cfg.data, model_dir=..., model=..., batch_size=8, seed=0)
    batch = batches.batch(t)  # slidedp.data.batch.Batch
    print(batches.report)      # one line: samples, tokens, truncated/dropped, packing fill
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slidedp.data.batch import IGNORE_INDEX, Batch
from slidedp.data.layout import Rows
from slidedp.data.mixture import SourceShare
from slidedp.data.samples import I64, Samples, positions_within
from slidedp.errors import InvalidArgumentError


@dataclass(frozen=True)
class DataReport:
    path: str
    format: str
    records: int  # samples read from the file
    sequences: int  # samples kept (after the over-length policy)
    rows: int  # rows an epoch has (= sequences unless packing)
    tokens: int  # tokens kept
    label_tokens: int  # tokens trained to predict, per epoch
    seq_len: int
    packing: bool
    over_length: str  # the policy
    truncated: int  # samples cut to seq_len
    truncated_tokens: int  # tokens cut off them
    dropped: int  # over-length samples left out (policy drop)
    unlabeled: int  # truncated samples left out: their prompt filled seq_len
    sources: tuple[SourceShare, ...] = ()  # a mixture (data.sources): what each source gave

    @property
    def packing_efficiency(self) -> float:
        """Tokens over the rows' capacity (rows * seq_len): how full rows are on average."""
        return self.tokens / (self.rows * self.seq_len)

    def __str__(self) -> str:
        layout = "packed" if self.packing else "padded"
        line = (
            f"{self.path} ({self.format}): {self.records} samples → {self.sequences} in "
            f"{self.rows} {layout} rows of <= {self.seq_len} tokens "
            f"({self.packing_efficiency:.1%} full); {self.tokens} tokens, "
            f"{self.label_tokens} trained; over-length ({self.over_length}): "
            f"{self.truncated} truncated ({self.truncated_tokens} tokens cut), "
            f"{self.dropped} dropped"
        )
        if self.unlabeled:
            line += f", {self.unlabeled} left out with nothing to train on after truncation"
        if self.sources:
            line += "; each epoch mixes " + ", ".join(str(s) for s in self.sources)
        return line


class Batches:
    """``batch(step)``: the global batch of a step (``batch_size`` rows)."""

    def __init__(
        self,
        samples: Samples,
        rows: Rows,
        *,
        batch_size: int,
        pad_id: int,
        packed: bool,
        shuffle: bool,
        seed: int,
        report: DataReport,
    ) -> None:
        self.samples, self.rows, self.batch_size, self.pad_id = samples, rows, batch_size, pad_id
        self.packed, self.shuffle, self.seed, self.report = packed, shuffle, seed, report
        self._orders: dict[int, I64] = {}  # a cache only: order(e) is a function of e

    def order(self, epoch: int) -> I64:
        """The row order of ``epoch``."""
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._orders[epoch] = rng.permutation(len(self.rows)).astype(np.int64)
            else:
                self._orders[epoch] = np.arange(len(self.rows), dtype=np.int64)
        return self._orders[epoch]

    def rows_at(self, step: int) -> I64:
        """[B] the rows of step ``step``."""
        if step < 0:
            raise InvalidArgumentError(f"step must be >= 0, got {step}")
        epochs, index = np.divmod(
            step * self.batch_size + np.arange(self.batch_size), len(self.rows)
        )
        rows = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            at = epochs == epoch
            rows[at] = self.order(epoch)[index[at]]
        return rows

    def batch(self, step: int) -> Batch:
        return self.batch_of_rows(self.rows_at(step))

    def batch_of_rows(self, rows: I64) -> Batch:
        """A batch of the rows ``rows`` [n] (the held-out set's, ``runtime.evaluate``)."""
        per_row = self.rows.offsets[rows + 1] - self.rows.offsets[rows]  # [B] samples per row
        picked = self.rows.samples[
            np.repeat(self.rows.offsets[rows], per_row) + positions_within(per_row)
        ]
        lengths = self.samples.lengths[picked]  # [n] tokens of each picked sample
        row_lengths = self.rows.lengths[rows]  # [B]
        # column where each sample starts in its row: its offset among the row's samples
        ends = np.cumsum(lengths)
        row_first = np.cumsum(per_row) - per_row  # index of each row's first sample in `picked`
        start_col = ends - lengths - np.repeat(ends[row_first] - lengths[row_first], per_row)
        pos = positions_within(lengths)  # [T] position inside its sample
        src = np.repeat(self.samples.offsets[:-1][picked], lengths) + pos
        row = np.repeat(np.repeat(np.arange(len(rows)), per_row), lengths)
        col = np.repeat(start_col, lengths) + pos
        tokens = self.samples.tokens[src].astype(np.int64)
        trained = self.samples.trained[src]
        if self.packed:
            trained = trained & (pos > 0)  # a sample's first token: no target across samples
        width = int(row_lengths.max())
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        ids[row, col] = tokens
        mask[row, col] = 1
        labels[row[trained], col[trained]] = tokens[trained]
        position_ids = None
        if self.packed:
            # tail padding counts from 0 too: a segment of its own, never attended from samples
            positions = np.arange(width)[None, :] - row_lengths[:, None]
            positions[row, col] = pos
            position_ids = torch.from_numpy(positions)
        return Batch(
            torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(labels), position_ids
        )
