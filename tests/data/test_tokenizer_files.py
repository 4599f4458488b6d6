"""A tokenizer.json that the Rust tokenizers library rejects is one clear data error (exit 2)
by ``validate`` and ``train`` alike, naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli.util import one_error_line, run, snapshot
from data.helpers import make_tokenizer, write_jsonl
from engine.tiny import make_model, write_config


def _no_vocabulary(tokenizer: dict[str, Any]) -> None:
    tokenizer["model"]["vocab"] = "notamap"


def _unknown_pre_tokenizer(tokenizer: dict[str, Any]) -> None:
    tokenizer["pre_tokenizer"] = {"type": "Bogus"}


@pytest.mark.parametrize("verb", ["validate", "train"])
@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_no_vocabulary, 'invalid type: string "notamap", expected a map'),
        (_unknown_pre_tokenizer, "did not match any variant of untagged enum PreTokenizer"),
    ],
)
def test_a_tokenizer_json_the_library_rejects(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, verb: str, damage: Any, reason: str
) -> None:
    model = make_tokenizer(make_model(tmp_path, "qwen3", tied=True))
    tokenizer_json = model / "tokenizer.json"
    tokenizer = json.loads(tokenizer_json.read_text())
    damage(tokenizer)
    tokenizer_json.write_text(json.dumps(tokenizer))
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": f"w{i} w{i + 1}"} for i in range(8)])
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    before = snapshot(tmp_path)
    code, _, err = run(capsys, verb, str(config))
    assert code == 2, err
    assert snapshot(tmp_path) == before
    one_error_line(
        err,
        verb,
        f"the tokenizers library rejects {tokenizer_json}: ",
        reason,
        "copy the tokenizer files again from the original model",
    )
