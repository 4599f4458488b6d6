"""One run per output directory (``io.run_lock``): two real ``slidedp train`` processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slidedp.preflight
from cli.util import one_error_line, run, tiny_run_config
from slidedp.errors import OutputDirBusyError
from slidedp.io.run_lock import LOCK_FILE, RunLock

Capsys = pytest.CaptureFixture[str]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return tiny_run_config(tmp_path)


def _start_train(config: Path, *overrides: str) -> subprocess.Popen[str]:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "slidedp", "train", str(config), *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 120) -> None:
    """Until ``path`` exists while ``proc`` runs."""
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.1)


@pytest.mark.e2e
def test_a_second_run_is_refused_while_the_first_trains_and_a_killed_one_leaves_no_lock(
    capsys: Capsys, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = config.parent / "out"
    first = _start_train(config, "train.max_steps=100000", "output.save_steps=1",
                         "output.save_total_limit=2")  # fmt: skip
    try:
        # training: a checkpoint is written (every step's; with the limit of 2, checkpoint-1
        # is gone after the third, which a loaded machine's poll can miss: "latest" stays)
        _wait_for(out / "latest", first)
        # refused before the resume decision reads a checkpoint (or anything else)
        monkeypatch.setattr(slidedp.preflight, "plan_resume", _must_not_run)
        code, _, err = run(capsys, "train", str(config), "train.resume=auto")
        assert code == 2
        one_error_line(
            err, "train", f"run pid {first.pid} on host {socket.gethostname()}", "output.dir"
        )
    finally:
        first.send_signal(signal.SIGKILL)  # no cleanup at all: the kernel drops the lock
        first.communicate()
    monkeypatch.undo()
    latest = int((out / "latest").read_text().strip().removeprefix("checkpoint-"))
    steps = f"train.max_steps={latest + 1}"
    code, _, err = run(capsys, "train", str(config), "train.resume=auto", steps)
    assert code == 0, err  # the killed run left no lock behind


def _must_not_run(*args: object, **kwargs: object) -> object:
    raise AssertionError("the refused run read output.dir")


@pytest.mark.e2e
def test_a_refused_run_leaves_no_lock_file_nor_the_directory_it_created(
    capsys: Capsys, config: Path
) -> None:
    out = config.parent / "new" / "out"
    code, _, err = run(capsys, "train", str(config), f"output.dir={out}", "train.resume=auto",
                       "model.max_position_embeddings=8")  # fmt: skip
    assert code == 2, err
    assert not (config.parent / "new").exists()
    code, _, err = run(capsys, "train", str(config), "train.max_steps=1")
    assert code == 0, err
    assert (config.parent / "out" / LOCK_FILE).read_text().split()[0] == str(os.getpid())


def test_the_lock_is_exclusive_between_processes(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from slidedp.io.run_lock import RunLock; "
         f"RunLock.acquire(Path({str(tmp_path)!r})); print('locked', flush=True); "
         "time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(OutputDirBusyError) as busy:
            RunLock.acquire(tmp_path)
        assert (busy.value.pid, busy.value.host) == (holder.pid, socket.gethostname())
    finally:
        holder.kill()
        holder.communicate()
    RunLock.acquire(tmp_path).release()


@pytest.mark.parametrize("exists", [False, True])
def test_a_refused_run_puts_the_directory_times_back_unless_another_writer_came(
    tmp_path: Path, exists: bool
) -> None:
    """The lock's entry (the output directory, or its lock file) changed its parent's mtime:
    put back on refusal. A directory another process wrote into meanwhile keeps its new mtime
    (older than its new child's would mislead make, rsync and backups)."""
    runs = tmp_path / "runs"
    (runs / "a" if exists else runs).mkdir(parents=True)
    where = runs / "a" if exists else runs  # the directory the lock makes its entry in
    os.utime(where, ns=(10**18, 10**18))
    RunLock.acquire(runs / "a").release(refused=True)
    assert where.stat().st_mtime_ns == 10**18
    lock = RunLock.acquire(runs / "a")
    (where / "b").mkdir()  # another process, while the run is refused
    lock.release(refused=True)
    assert where.stat().st_mtime_ns >= (where / "b").stat().st_mtime_ns
