"""Held-out data (``data.eval_path`` / ``data.eval_fraction``): the split and the config."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.util import run
from data.helpers import VOCAB, write_jsonl
from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.config import config_from_dict
from slidedp.data.batches import Batches
from slidedp.data.build import ModelFacts, build_data
from slidedp.data.config import DataSection
from slidedp.data.sources import Chunk, Source
from slidedp.errors import ConfigError, DataError


def _part(tmp_path: Path, part: str, **keys: Any) -> Batches:
    seed = keys.pop("seed", 0)
    train, held = build_data(
        DataSection(**{"seq_len": 16, "pad_id": 0} | keys),
        model_dir=tmp_path,
        model=ModelFacts(vocab_size=VOCAB, max_positions=64),
        batch_size=2,
        seed=seed,
    )
    if part == "train":
        return train
    assert held is not None
    return held


def _firsts(batches: Batches) -> list[int]:
    return [int(batches.samples.tokens[o]) for o in batches.samples.offsets[:-1]]


def test_the_fraction_is_split_off_by_the_seed_and_never_trained_on(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [i, i]} for i in range(1, 21)])
    keys = {"path": str(data), "eval_fraction": 0.2, "shuffle": True}
    train, held = _part(tmp_path, "train", **keys), _part(tmp_path, "eval", **keys)
    assert len(_firsts(held)) == 4
    assert sorted(_firsts(train) + _firsts(held)) == list(range(1, 21))  # disjoint, complete
    assert _firsts(held) == sorted(_firsts(held))  # in file order
    assert not held.shuffle
    assert _firsts(_part(tmp_path, "eval", **keys)) == _firsts(held)  # the same seed: alike
    assert _firsts(_part(tmp_path, "eval", seed=1, **keys)) != _firsts(held)
    with pytest.raises(DataError, match="leaves none to train on"):
        _part(tmp_path, "train", path=str(data), eval_fraction=0.99)


def test_an_eval_file_is_read_whole(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [i, i]} for i in range(1, 9)])
    held = write_jsonl(tmp_path / "h.jsonl", [{"input_ids": [i, i]} for i in range(11, 14)])
    batches = _part(tmp_path, "eval", path=str(data), eval_path=str(held))
    assert _firsts(batches) == [11, 12, 13]
    assert len(_firsts(_part(tmp_path, "train", path=str(data), eval_path=str(held)))) == 8


def _raw(**sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model": {"path": "m"},
        "data": {"path": "d.jsonl"},
        "train": {"max_steps": 2},
        "output": {"dir": "o", "tensorboard": False},
    }
    for name, values in sections.items():
        raw[name] |= values
    return raw


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"data": {"eval_path": "e.jsonl", "eval_fraction": 0.1}}, "both given"),
        ({"data": {"eval_fraction": 1.0}}, r"eval_fraction must be in \[0, 1\)"),
        ({"data": {"eval_path": "./d.jsonl"}}, "is a file the run trains on"),
        (
            {"data": {"path": "", "sources": [{"path": "a.jsonl"}], "eval_path": "a.jsonl"}},
            "is a file the run trains on",
        ),
        ({"train": {"eval_steps": 5}}, "train.eval_steps needs held-out data"),
        ({"output": {"save_best": True}}, "output.save_best needs held-out data"),
    ],
)
def test_eval_keys_are_checked(sections: dict[str, dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_raw(**sections))


def test_validate_reports_the_held_out_rows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "d.jsonl", 10)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          data={"eval_fraction": 0.3})  # fmt: skip
    code, out, err = run(capsys, "validate", str(config))
    assert code == 0, err
    assert f"{data} (input_ids): 10 samples → 7 in" in out  # 10 read, 3 held out
    assert f"held out: {data} (input_ids): 10 samples → 3 in" in out


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times each data file (by name) is read."""
    counts: Counter[str] = Counter()
    read = Source.chunks

    def counted(source: Source) -> Iterator[Chunk]:
        counts[source.path.name] += 1
        return read(source)

    monkeypatch.setattr(Source, "chunks", counted)
    return counts


@pytest.mark.parametrize("held", ["fraction", "file", "none"])
def test_both_parts_come_from_one_read_of_each_file(
    tmp_path: Path, reads: Counter[str], held: str
) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [i, i]} for i in range(1, 21)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [i, i, i]} for i in range(21, 27)])
    h = write_jsonl(tmp_path / "h.jsonl", [{"input_ids": [i, i]} for i in range(1, 4)])
    keys: dict[str, Any] = {"sources": [{"path": str(a), "weight": 2}, {"path": str(b)}],
                            "shuffle": True}  # fmt: skip
    held_keys: dict[str, dict[str, Any]] = {
        "fraction": {"eval_fraction": 0.25}, "file": {"eval_path": str(h)}, "none": {}}  # fmt: skip
    keys |= held_keys[held]
    train, eval_part = build_data(
        DataSection(seq_len=16, pad_id=0, **keys),
        model_dir=tmp_path,
        model=ModelFacts(vocab_size=VOCAB, max_positions=64),
        batch_size=2,
        seed=3,
    )
    assert reads == Counter(
        {"a.jsonl": 1, "b.jsonl": 1} | ({"h.jsonl": 1} if held == "file" else {})
    )
    # a quarter of each source held out: 20 -> 15 + 5, 6 -> 4 + 2 (round(1.5) is 2)
    assert len(train.samples) == {"fraction": 19, "file": 26, "none": 26}[held]
    assert (eval_part is None) == (held == "none")
    if eval_part is not None:
        assert len(eval_part.samples) == {"fraction": 7, "file": 3}[held]


@pytest.mark.parametrize("held", ["eval_fraction", "eval_path"])
def test_validate_reads_each_file_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, reads: Counter[str], held: str
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "d.jsonl", 10)
    keys = {"eval_fraction": 0.3} if held == "eval_fraction" else {
        "eval_path": str(write_data(tmp_path / "h.jsonl", 4, seed=2))}  # fmt: skip
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out", data=keys)
    code, out, err = run(capsys, "validate", str(config))
    assert code == 0, err
    assert "held out: " in out
    assert reads == Counter({"d.jsonl": 1} | ({"h.jsonl": 1} if held == "eval_path" else {}))


@pytest.mark.e2e  # trains a step
def test_train_reads_the_data_once_for_both_parts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, reads: Counter[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=1)
    data = write_data(tmp_path / "d.jsonl", 10)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out",
                          data={"eval_fraction": 0.3})  # fmt: skip
    assert main(["train", str(config), "train.max_steps=1", "output.export=false"]) == 0, (
        capsys.readouterr().err
    )
    assert reads == Counter({"d.jsonl": 1})
