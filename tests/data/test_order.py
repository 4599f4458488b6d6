"""Step order: file order by default, a seeded permutation per epoch with shuffle, and
``batch(t)`` a pure function of the step (resume = knowing the step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from data.helpers import build, write_jsonl
from slidedp.data.batches import Batches
from slidedp.errors import InvalidArgumentError


@pytest.fixture
def data(tmp_path: Path) -> Path:
    # sample i is [i, i]: the first id names the sample
    return write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [i, i]} for i in range(10)])


def _firsts(batches: Batches, step: int) -> list[int]:
    return batches.batch(step).input_ids[:, 0].tolist()


def test_file_order_cycles_through_the_file(tmp_path: Path, data: Path) -> None:
    batches = build(data, tmp_path, batch_size=4)
    assert [_firsts(batches, t) for t in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_shuffle_visits_every_sample_once_per_epoch(tmp_path: Path, data: Path) -> None:
    batches = build(data, tmp_path, batch_size=5, shuffle=True, seed=3)
    epochs = [_firsts(batches, 0) + _firsts(batches, 1), _firsts(batches, 2) + _firsts(batches, 3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]  # a new permutation each epoch
    assert epochs[0] != list(range(10))


def test_shuffle_is_seeded(tmp_path: Path, data: Path) -> None:
    def order(seed: int) -> list[list[int]]:
        batches = build(data, tmp_path, batch_size=4, shuffle=True, seed=seed)
        return [_firsts(batches, t) for t in range(5)]

    assert order(1) == order(1)
    assert order(1) != order(2)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("packing", [False, True])
def test_batch_is_a_pure_function_of_the_step(
    tmp_path: Path, data: Path, shuffle: bool, packing: bool
) -> None:
    """A resumed run asks for step 7 first: it must get what a run from step 0 got."""
    keys: dict[str, Any] = {
        "batch_size": 3,
        "shuffle": shuffle,
        "packing": packing,
        "seq_len": 4,
        "seed": 5,
    }
    from_start = build(data, tmp_path, **keys)
    seen = [from_start.batch(t) for t in range(12)]
    resumed = build(data, tmp_path, **keys)
    for t in (7, 11, 0, 7):
        batch = resumed.batch(t)
        assert torch.equal(batch.input_ids, seen[t].input_ids)
        assert torch.equal(batch.labels, seen[t].labels)
        if packing:
            expected = seen[t].position_ids
            assert batch.position_ids is not None
            assert expected is not None
            assert torch.equal(batch.position_ids, expected)


def test_a_batch_larger_than_the_data_wraps_into_the_next_epoch(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [i, i]} for i in range(3)])
    batches = build(data, tmp_path, batch_size=4)
    assert _firsts(batches, 0) == [0, 1, 2, 0]
    assert _firsts(batches, 1) == [1, 2, 0, 1]
    with pytest.raises(InvalidArgumentError, match="step must be >= 0"):
        batches.batch(-1)
