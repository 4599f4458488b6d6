"""Ranks forked from a zygote are what ``subprocess.Popen`` would have started: the launcher's
children, with their environment, working directory, session, output and exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from slidedp.runtime import zygote

# A launcher in a fresh interpreter (a pytest worker has computed: it must not fork a zygote).
LAUNCHER = """
import json, os, signal, sys
from slidedp.runtime.zygote import Zygote, can_fork

assert can_fork()
with open(sys.argv[1], "wb") as out, Zygote.forked() as zygote:
    ranks = [zygote.start("multirank.zygote_rank", [code], os.environ | {"RANK": str(i)},
                          own_session=i == 0, output=(out, None))
             for i, code in enumerate(["0", "3", "kill"])]
    zygote.close()
    zygote_left = os.path.exists(f"/proc/{zygote.pid}")
    codes = [rank.wait() for rank in ranks]
print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "codes": codes,
                  "sigint": str(signal.getsignal(signal.SIGINT)),
                  "zygote_left": zygote_left, "pids": [rank.pid for rank in ranks]}))
"""


def test_forked_ranks_are_the_launcher_s_children_with_their_own_settings(tmp_path: Path) -> None:
    tests = str(Path(__file__).parents[1])
    env = os.environ | {"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "ranks.jsonl"
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(out)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    launcher = json.loads(done.stdout)
    assert launcher["codes"] == [0, 3, -signal.SIGKILL]
    assert not launcher["zygote_left"]  # exited and reaped: no zombie either
    seen = sorted((json.loads(line) for line in out.read_text().splitlines()),
                  key=lambda rank: rank["rank"])  # fmt: skip
    assert [rank["rank"] for rank in seen] == ["0", "1", "2"]
    assert [rank["pid"] for rank in seen] == launcher["pids"]
    assert all(rank["ppid"] == launcher["pid"] for rank in seen)  # adopted before they run
    assert all(rank["cwd"] == str(work) for rank in seen)
    assert [rank["sid"] == rank["pid"] for rank in seen] == [True, False, False]
    assert all(rank["sid"] == launcher["sid"] for rank in seen[1:])
    # Ctrl-C as a fresh interpreter takes it: the zygote's own (ignored) is not inherited
    assert all(rank["sigint"] == launcher["sigint"] for rank in seen)


def test_a_process_that_computed_forks_its_children_from_a_spawned_zygote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pytest worker has computed: its children fork from a fresh interpreter's imports
    (spawned at the first child), are still its children, talk through pipes, time out as
    ``Popen.wait`` does and count the zygote's imports in their age."""
    assert float(torch.ones(8).sum()) == 8.0  # this process computed: no forked zygote
    tests = str(Path(__file__).parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    before = _my_children()
    with zygote.children_forked(("multirank.zygote_rank",), own_process=False) as children:
        assert _my_children() == before  # nothing spawned before a child is asked for
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        asked = time.monotonic()
        child = zygote.start_child("multirank.zygote_rank", ["echo"], dict(os.environ),
                                   stdio=(stdin_read, stdout_write, None))  # fmt: skip
        spawned = children.zygote()
        assert spawned.process is not None
        assert _my_children() == before | {spawned.pid, child.pid}
        os.close(stdin_read)
        os.close(stdout_write)
        os.write(stdin_write, b"asked\n")
        os.close(stdin_write)
        with os.fdopen(stdout_read) as stdout:
            seen, answer = stdout.read().splitlines()
        elapsed = time.monotonic() - asked  # the zygote's spawn and imports, the fork, the child
        assert child.wait(60) == 0
        sleeper = zygote.start_child("multirank.zygote_rank", ["sleep"], dict(os.environ))
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(0.1)
        sleeper.kill()
        assert sleeper.wait() == -signal.SIGKILL
    assert answer == "asked"
    assert json.loads(seen)["ppid"] == os.getpid()
    # the zygote's imports (torch: most of the elapsed time) count, not only the fork's own
    # milliseconds (1.0 s was a bound here: the imports took 0.98 s from a warm page cache)
    assert json.loads(seen)["age_s"] > max(0.3, 0.5 * elapsed)
    assert spawned.process.returncode == 0  # closed and reaped


def _my_children() -> set[int]:
    listed = Path(f"/proc/self/task/{threading.get_native_id()}/children").read_text()
    return {int(pid) for pid in listed.split()}


def test_no_zygote_once_a_thread_runs_or_the_cuda_driver_is_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Either makes a forked copy unsafe: the ranks then start as fresh interpreters."""
    monkeypatch.setattr("slidedp.runtime.zygote.threading.active_count", lambda: 1)
    monkeypatch.setattr(zygote, "CUDA_DRIVER", "no-such-library.so")
    assert zygote.can_fork()
    # mapped in every process, as a driver; no libc.so.1 to probe: assumed initialized
    monkeypatch.setattr(zygote, "CUDA_DRIVER", "libc.so")
    assert not zygote.can_fork()
    monkeypatch.setattr(zygote, "CUDA_DRIVER", "no-such-library.so")
    monkeypatch.setattr("slidedp.runtime.zygote.threading.active_count", lambda: 2)
    assert not zygote.can_fork()


@pytest.mark.gpu
def test_the_imports_leave_the_cuda_driver_uninitialized_and_cuda_init_is_seen() -> None:
    """On a CUDA machine importing torch maps the driver: the zygote is still safe until
    ``cuInit`` (here through ``torch.cuda.is_available``, which torch does not record)."""
    probe = (
        "import slidedp.cli, torch\n"
        "from slidedp.runtime.zygote import can_fork, cuda_driver_initialized\n"
        "before = can_fork()\n"
        "assert torch.cuda.is_available()\n"
        "print(before, can_fork(), cuda_driver_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False", "True"]
