"""Disk space (``io.disk_space``): refused before the first step, one line when a save fills it."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

import slidedp.io.checkpoint
import slidedp.io.disk_space
from cli.util import one_error_line, run, snapshot, tiny_run_config
from engine.tiny import read_metrics
from slidedp.errors import DiskFullError
from slidedp.io.disk_space import check_disk_space, checkpoints_at_once, saves_of_run

Capsys = pytest.CaptureFixture[str]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return tiny_run_config(tmp_path)


def _checkpoint_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.e2e  # a 1-step training makes the checkpoint
@pytest.mark.parametrize("verb", ["validate", "train"])
def test_a_disk_without_room_for_the_checkpoints_is_refused_before_anything_is_written(
    capsys: Capsys, config: Path, monkeypatch: pytest.MonkeyPatch, verb: str
) -> None:
    code, _, err = run(capsys, "train", str(config), "train.max_steps=1")
    assert code == 0, err
    out = config.parent / "out"
    one = _checkpoint_size(out / "checkpoint-1")
    final = _checkpoint_size(out / "final")  # a copy of the checkpoint's HF part
    before = snapshot(out, itself=True)
    # room for one checkpoint more, the run keeps two: three at once while the third is saved,
    # then its export
    monkeypatch.setattr(slidedp.io.disk_space, "free_bytes", lambda path: 2 * one)
    overrides = ["train.resume=auto", "train.max_steps=4", "output.save_steps=1",
                 "output.save_total_limit=2"]  # fmt: skip
    code, _, err = run(capsys, verb, str(config), *overrides)
    assert code == 2
    lock = (out / ".slidedp.lock").stat().st_blocks * 512  # the run's own: counted as free
    line = one_error_line(err, verb, f"with {2 * one + lock:,} bytes free", "2 checkpoint(s)",
                          "and its export of")  # fmt: skip
    need = int(line.split("needs ")[1].split(" bytes")[0].replace(",", ""))
    # the estimate covers what a save and the export write
    assert 2 * one + final <= need <= 2 * (one + 2**20) + final + 2**20
    assert snapshot(out, itself=True) == before
    room = 2 * one + final + 2**22
    monkeypatch.setattr(slidedp.io.disk_space, "free_bytes", lambda path: room)
    code, _, err = run(capsys, verb, str(config), *overrides)
    assert code == 0, err


@pytest.mark.e2e
def test_a_save_that_runs_out_of_space_is_one_line_naming_the_checkpoint_to_resume_from(
    capsys: Capsys, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = slidedp.io.checkpoint._write_contents

    def filling(tmp: Path, *args: Any, **kwargs: Any) -> None:
        if tmp.name == ".checkpoint-2.tmp":
            (tmp / "model.safetensors").write_bytes(b"\0" * 100)  # half written
            raise OSError(errno.ENOSPC, "No space left on device")
        write(tmp, *args, **kwargs)

    monkeypatch.setattr(slidedp.io.checkpoint, "_write_contents", filling)
    code, _, err = run(capsys, "train", str(config), "train.max_steps=3", "output.save_steps=1")
    out = config.parent / "out"
    assert code == 2
    one_error_line(
        err, "train", "no space left on /", "bytes, ", "are free",
        f"resume from the intact {out / 'checkpoint-1'}",
    )  # fmt: skip
    assert [p.name for p in out.iterdir() if "checkpoint" in p.name] == ["checkpoint-1"]
    monkeypatch.undo()
    code, _, err = run(capsys, "train", str(config), "train.max_steps=3", "train.resume=auto")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_the_checkpoints_on_disk_at_once() -> None:
    assert saves_of_run(0, 10, 0) == 1  # the end only
    assert saves_of_run(0, 10, 3) == 4  # 3, 6, 9, the end
    assert saves_of_run(4, 10, 3) == 3  # 6, 9, the end
    assert saves_of_run(0, 9, 3) == 3  # 3, 6, then the end at 9
    assert checkpoints_at_once(0, 5, 4) == 4  # every one kept
    assert checkpoints_at_once(2, 0, 4) == 3  # two kept + the one being written
    assert checkpoints_at_once(2, 1, 4) == 2
    assert checkpoints_at_once(2, 3, 4) == 1  # the oldest go once the new one is in
    assert checkpoints_at_once(3, 0, 1) == 1


def test_the_best_checkpoint_needs_room_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slidedp.io.disk_space, "free_bytes", lambda path: 3 * 100)
    line = check_disk_space(tmp_path, one_bytes=100, total_limit=2, saves=5)
    assert line.startswith("3 checkpoint(s)")  # two kept + the one being written
    with pytest.raises(DiskFullError, match="4 checkpoint"):
        check_disk_space(tmp_path, one_bytes=100, total_limit=2, saves=5, best=True)
