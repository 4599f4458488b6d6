"""Held-out data (``data.eval_path`` / ``data.eval_fraction``): the split and the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.util import run
from data.helpers import VOCAB, write_jsonl
from engine.tiny import make_model, write_config, write_data
from slidedp.config import config_from_dict
from slidedp.data.batches import Batches
from slidedp.data.build import ModelFacts, build_batches
from slidedp.data.config import DataSection
from slidedp.errors import ConfigError, DataError


def _part(tmp_path: Path, part: str, **keys: Any) -> Batches:
    seed = keys.pop("seed", 0)
    return build_batches(
        DataSection(**{"seq_len": 16, "pad_id": 0} | keys),
        model_dir=tmp_path,
        model=ModelFacts(vocab_size=VOCAB, max_positions=64),
        batch_size=2,
        seed=seed,
        part=part,  # type: ignore[arg-type]
    )


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
