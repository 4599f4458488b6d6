"""Dataset mixtures (``data.sources``): shares by weight, seeded, ``batch(t)`` pure, reported."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cli.util import run
from data.helpers import VOCAB, write_jsonl
from engine.tiny import make_model, write_config
from slidedp.data.batches import Batches
from slidedp.data.build import ModelFacts, build_data
from slidedp.data.config import DataSection
from slidedp.errors import ConfigError


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    # the first id names the source: 1..10 in a (2 tokens each), 11..14 in b (3 tokens each)
    a = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [i, i]} for i in range(1, 11)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [i, i, i]} for i in range(11, 15)])
    return a, b


def _mixture(tmp_path: Path, sources: list[dict[str, Any]], **keys: Any) -> Batches:
    seed = keys.pop("seed", 0)
    section = DataSection(sources=sources, seq_len=16, pad_id=0, **keys)
    return build_data(
        section,
        model_dir=tmp_path,
        model=ModelFacts(vocab_size=VOCAB, max_positions=64),
        batch_size=2,
        seed=seed,
    )[0]


def _epoch(batches: Batches) -> list[int]:
    steps = batches.report.rows // batches.batch_size
    return [i for t in range(steps) for i in batches.batch(t).input_ids[:, 0].tolist()]


def test_each_source_gives_its_weight_s_share_of_an_epoch(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    a, b = files
    batches = _mixture(tmp_path, [{"path": str(a), "weight": 1}, {"path": str(b), "weight": 1}])
    epoch = _epoch(batches)
    assert len(epoch) == 14  # as many samples as both files
    from_b = Counter(i for i in epoch if i > 10)
    assert sum(from_b.values()) == 7  # half of 14: the 4 samples of b, then 3 repeated
    assert set(from_b) == {11, 12, 13, 14}  # every one of b's before any repeats twice
    assert sorted(from_b.values()) == [1, 2, 2, 2]
    assert len({i for i in epoch if i <= 10}) == 7  # a subsampled: 7 distinct of 10
    assert epoch != sorted(epoch)  # interleaved, not a then b
    shares = batches.report.sources
    assert [(s.kept, s.samples, s.tokens) for s in shares] == [(10, 7, 14), (4, 7, 21)]
    line = str(batches.report)
    # the subset of a is drawn once: the banner says the other 3 never train
    assert f"{a} (weight 1): 7 of 10 samples (the same 7 every epoch), 14 tokens" in line
    assert f"{b} (weight 1): 7 of 4 samples, 21 tokens" in line


def test_the_mixture_is_seeded_and_each_batch_a_pure_function_of_the_step(
    tmp_path: Path, files: tuple[Path, Path]
) -> None:
    a, b = files
    sources = [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1, "format": "auto"}]

    def steps(seed: int, order: list[int], **keys: Any) -> dict[int, list[list[int]]]:
        batches = _mixture(tmp_path, sources, seed=seed, **keys)
        return {t: batches.batch(t).input_ids.tolist() for t in order}

    forward = steps(5, list(range(12)), shuffle=True)
    resumed = steps(5, [7, 8, 9, 10, 11, 0], shuffle=True)  # a resumed run asks for 7 first
    assert all(resumed[t] == forward[t] for t in resumed)
    assert steps(5, [0, 1, 2]) == steps(5, [0, 1, 2])
    assert steps(5, [0, 1, 2]) != steps(6, [0, 1, 2])
    counts = Counter(i > 10 for t in range(7) for i in _mixture(tmp_path, sources).batch(t)
                     .input_ids[:, 0].tolist())  # fmt: skip
    assert (counts[False], counts[True]) == (10, 4)  # weight 3:1 of 14 samples: 10.5 → 10, 3.5 → 4


def test_huge_weights_keep_their_shares(tmp_path: Path, files: tuple[Path, Path]) -> None:
    a, b = files  # their sum overflows to inf: the shares are taken of the weights scaled first
    huge = [{"path": str(a), "weight": 1.5e308}, {"path": str(b), "weight": 5e307}]
    assert [s.samples for s in _mixture(tmp_path, huge).report.sources] == [10, 4]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"path": "x.jsonl", "sources": [{"path": "y.jsonl"}]}, "both given"),
        ({"sources": [{"path": "y.jsonl", "weight": 0}]}, r"sources\[0\]\.weight must be"),
        ({"sources": [{"path": "y.jsonl", "weight": float("inf")}]}, r"finite number > 0, got inf"),
        ({"sources": [{"path": "y.jsonl", "weight": 10**400}]}, r"finite number > 0, got 1000"),
        ({"sources": [{"path": "y.jsonl", "wieght": 2}]}, r"unknown key\(s\) \['wieght'\]"),
        ({"sources": [{"weight": 2}]}, r"sources\[0\]\.path is required"),
        ({"sources": [{"path": "y.jsonl", "format": "chat"}]}, r"sources\[0\]\.format"),
        ({"sources": ["y.jsonl"]}, r"sources\[0\] must be a mapping"),
        (
            {"sources": [{"path": "y.jsonl"}, {"path": "z.jsonl"}, {"path": "./y.jsonl"}]},
            r"data\.sources lists /\S*/y\.jsonl twice \(data\.sources\[0\] and \[2\]\): give it "
            "once with a larger weight$",
        ),
    ],
)
def test_bad_sources_are_config_errors(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataSection(**keys)


def test_validate_reports_each_source(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, files: tuple[Path, Path]
) -> None:
    a, b = files
    model = make_model(tmp_path, "qwen3", tied=True)
    sources = [{"path": str(a), "weight": 2.5}, {"path": str(b)}]
    config = write_config(tmp_path / "c.yaml", model, a, tmp_path / "out",
                          data={"path": "", "sources": sources})  # fmt: skip
    code, out, err = run(capsys, "validate", str(config))
    assert code == 0, err
    assert f"{a} (weight 2.5): 10 of 10 samples" in out
    assert f"{b} (weight 1): 4 of 4 samples" in out
