"""Dataset mixtures (``data.sources``): several files mixed by weight into one epoch.

Each source is read, tokenized and cut to ``seq_len`` on its own (``data.build``). An epoch of
the mixture has as many samples as all sources together; source ``i`` gives
``round(weight_i / sum(weights) * total)`` of them (at least one): a seeded permutation of its
samples, cycled when it gives more than it has (a small source repeats), cut short when fewer
(a large one is subsampled: the same subset every epoch, as the banner says; a larger weight
gives more of it). The selected samples are interleaved by one more seeded permutation.
Everything is drawn from ``train.seed`` alone, so the mixed samples, and with them
``batch(t)``, are a pure function of the config and the step: a resumed run mixes alike.

Example::

    mixed, shares = mix([chat, code], [3.0, 1.0], seed=42)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slidedp.data.samples import I64, Samples, offsets_of, positions_within
from slidedp.errors import DataError

_MIX_STREAM = 7919  # the RNG stream of the interleaving, apart from every source's (its index)
_EVAL_STREAM = 104729  # the RNG stream of the held-out split (data.eval_fraction)


@dataclass(frozen=True)
class SourceShare:
    """What one source gave an epoch of the mixture."""

    path: str
    weight: float
    kept: int  # its samples after the over-length policy
    samples: int  # samples it gives each epoch
    tokens: int  # their tokens

    def __str__(self) -> str:
        # the subset is drawn once by the seed: a subsampled source never gives the others
        same = f" (the same {self.samples} every epoch)" if self.samples < self.kept else ""
        return (
            f"{self.path} (weight {self.weight:g}): {self.samples} of {self.kept} samples{same}, "
            f"{self.tokens} tokens"
        )


def take(samples: Samples, index: I64) -> Samples:
    """Samples ``index`` (repeats allowed) in that order: a gather, no Python loop per token."""
    lengths = samples.lengths[index]
    src = np.repeat(samples.offsets[:-1][index], lengths) + positions_within(lengths)
    return Samples(
        samples.tokens[src], samples.trained[src], offsets_of(lengths), samples.numbers[index]
    )


def shares_of(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Samples each source gives an epoch: its weight's share of every sample, at least one."""
    if not math.isfinite(sum(weights)):  # huge weights: their sum overflows, theirs scaled not
        weights = [w / max(weights) for w in weights]
    total, weight_sum = sum(sizes), sum(weights)
    return [max(1, round(w / weight_sum * total)) for w in weights]


def _picks(size: int, count: int, seed: int, stream: int) -> I64:
    """``count`` indices into ``size`` samples: seeded permutations back to back, cut."""
    cycles = -(-count // size)
    rng = np.random.default_rng([seed, stream])
    return np.concatenate([rng.permutation(size) for _ in range(cycles)])[:count].astype(np.int64)


def mix(
    parts: Sequence[Samples], weights: Sequence[float], paths: Sequence[str], *, seed: int
) -> tuple[Samples, list[SourceShare]]:
    """One epoch's samples of the mixture, and what each source gave it."""
    counts = shares_of([len(p) for p in parts], weights)
    picked = [
        take(p, _picks(len(p), n, seed, i))
        for i, (p, n) in enumerate(zip(parts, counts, strict=True))
    ]
    every = Samples.concat(picked)
    order = np.random.default_rng([seed, _MIX_STREAM]).permutation(len(every)).astype(np.int64)
    shares = [
        SourceShare(path, w, len(p), len(q), int(q.lengths.sum()))
        for path, w, p, q in zip(paths, weights, parts, picked, strict=True)
    ]
    return take(every, order), shares


def held_out(samples: Samples, fraction: float, seed: int, path: str) -> tuple[Samples, Samples]:
    """(training, held-out) samples: ``round(fraction * n)`` of them (at least one) drawn by
    ``seed``, each part in file order. Refused when nothing would be left to train on."""
    count = max(1, round(fraction * len(samples)))
    if count >= len(samples):
        raise DataError(
            f"{path}: data.eval_fraction={fraction} of {len(samples)} samples leaves none to "
            "train on; lower data.eval_fraction or give data.eval_path"
        )
    chosen = np.random.default_rng([seed, _EVAL_STREAM]).permutation(len(samples))[:count]
    is_eval = np.zeros(len(samples), dtype=np.bool_)
    is_eval[chosen] = True
    every = np.arange(len(samples), dtype=np.int64)
    return take(samples, every[~is_eval]), take(samples, every[is_eval])
