"""``slidedp train`` builds its data with ``build_data``: the banner reports it, and a data
error stops the run before any step with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.helpers import write_jsonl
from engine.tiny import make_model, write_config
from slidedp.cli import main

pytestmark = pytest.mark.e2e  # every test here trains end to end


def test_the_banner_reports_the_data_and_a_bad_line_stops_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=1)
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"input_ids": list(range(40))}, {"input_ids": [1, 2]}]
    )
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    assert main(["train", str(config), "train.max_steps=1", "output.export=false"]) == 0
    out = capsys.readouterr().out
    assert "data: " in out
    assert "2 samples → 2 in 2 padded rows of <= 32 tokens" in out
    assert "1 truncated (8 tokens cut), 0 dropped" in out

    strict = ["data.over_length=error", f"output.dir={tmp_path / 'strict'}"]
    assert main(["train", str(config), *strict]) != 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert "d.jsonl:1: 40 tokens > data.seq_len=32" in captured.err
    assert "step 1" not in captured.out
