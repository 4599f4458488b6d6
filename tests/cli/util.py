"""Shared by the CLI tests: run ``slidedp`` in-process and check its one error line."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``slidedp ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop what earlier steps of the test printed
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, verb: str, *needles: str) -> str:
    """The single stderr line ``slidedp VERB: error: ...``, checked to contain every needle."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"slidedp {verb}: error: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def snapshot(path: Path, itself: bool = False) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``path`` (with ``itself``, ``path`` too) with its size
    and mtime ({} when it does not exist): a directory's mtime changes when an entry is made or
    removed in it. (A refused run may make and remove a missing output directory: its parent's
    mtime changes, the output directory stays absent.)"""
    if not path.exists():
        return {}
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in [*([path] if itself else []), *sorted(path.rglob("*"))]
    }


def tiny_run_config(tmp_path: Path) -> Path:
    """A config training a tiny tied Qwen3 on 8 rows into ``tmp_path/out``."""
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 8)
    return write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
