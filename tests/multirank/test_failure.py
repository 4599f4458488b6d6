"""A rank that raises or dies: every rank stops, non-zero, fast, the failure reported once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli.util import one_error_line, run
from engine.tiny import make_model, write_config, write_data
from multirank.ranks import reaped, run_ranks
from slidedp.runtime.dist import EXIT_PEER_FAILED

pytestmark = pytest.mark.e2e  # every test here trains end to end


def _config(tmp_path: Path, steps: int) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": steps, "global_batch_size": 4, "max_grad_norm": 1.0}
    runtime = {"ranks": 2, "version_timeout_s": 300}  # a hang would outlast the test's bound
    return write_config(tmp_path / "c.yaml", model, data, tmp_path / "out", train=train,
                        runtime=runtime, output={"tensorboard": False})  # fmt: skip


@pytest.mark.parametrize("grad_route", ["gpu", "cpu"])
def test_a_rank_that_raises_stops_every_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], grad_route: str
) -> None:
    """On the cpu route the survivor's update worker may be waiting for the failed rank's
    gradient chunk: it wakes with the poison, as the peer's failure, not its own."""
    config = _config(tmp_path, steps=6)
    start = time.monotonic()
    codes = run_ranks(config, 2, [f"runtime.grad_route={grad_route}"], fail=(1, 2))
    assert time.monotonic() - start < 30
    assert codes == [EXIT_PEER_FAILED, 1]
    err = capfd.readouterr().err
    assert err.count("injected failure on rank 1") == 1, err


def test_a_killed_rank_stops_the_launch(tmp_path: Path) -> None:
    config = _config(tmp_path, steps=10_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slidedp", "train", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    with reaped(proc):
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, "the launch ended before training"
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 2
        os.kill(int(children[1]), signal.SIGKILL)  # rank 1, mid-run
        killed = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - killed < 30
        assert proc.returncode != 0
        assert "rank 1 was killed by SIGKILL" in err, err
        for pid in children:  # no rank left behind
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def _lr_failing_on(monkeypatch: pytest.MonkeyPatch, ranks: str, step: int) -> None:
    """An infinite learning rate at 0-based ``step`` on the ranks listed in ``ranks`` (ranks
    read ``RANK``; "" is a one-process run): the update worker's AdamW refuses it, the store
    is poisoned."""
    from slidedp.runtime.schedule import lr_schedule as real

    def schedule(*args: Any) -> Callable[[int], float]:
        lr_at = real(*args)
        failing = [(rank, step) for rank in ranks.split(",")]
        return lambda t: float("inf") if (os.environ.get("RANK", ""), t) in failing else lr_at(t)

    monkeypatch.setattr("slidedp.runtime.trainer.lr_schedule", schedule)


@pytest.mark.parametrize(
    "overrides",
    [[], ["train.max_grad_norm=0"], ["runtime.grad_slots=8"]],
    ids=["clipped", "overlapped", "deep-ring"],
)
def test_an_update_failure_is_reported_as_itself_in_one_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    overrides: list[str],
) -> None:
    config = _config(tmp_path, steps=4)
    _lr_failing_on(monkeypatch, "", 1)
    code, _, err = run(capsys, "train", str(config), "runtime.ranks=1", *overrides)
    assert code == 2
    one_error_line(err, "train", "a parameter update failed", "lr must be finite, got inf")


def test_an_update_failure_on_one_rank_is_reported_once_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, steps=4)
    _lr_failing_on(monkeypatch, "1", 1)
    codes = run_ranks(config, 2)
    assert codes == [EXIT_PEER_FAILED, 2]
    err = capfd.readouterr().err
    assert err.count("a parameter update failed") == 1, err
    assert "lr must be finite, got inf" in err
    assert "poisoned" not in err


def test_an_update_failure_on_every_rank_is_reported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Both ranks' workers fail the same step: the one whose poison came first reports, the
    other exits as a peer (was one line per rank)."""
    config = _config(tmp_path, steps=4)
    _lr_failing_on(monkeypatch, "0,1", 1)
    codes = run_ranks(config, 2, ["train.max_grad_norm=0"])  # both updates run unclipped, at once
    assert sorted(codes) == [2, EXIT_PEER_FAILED]
    err = capfd.readouterr().err
    assert err.count("a parameter update failed") == 1, err
    assert "poisoned" not in err
