"""The bench's processes (``runtime.lifetime``): a worker dies with the bench that started it, even
one killed by SIGKILL, and a run's whole process group is gone before the next run starts."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.tiny import tiny_spec, write_tiny_config
from slidedp.bench import child
from slidedp.bench.measure import process_tree
from slidedp.runtime import lifetime
from slidedp.runtime.zygote import process_name

SLEEPER = "import time; print('armed', flush=True); time.sleep(120)"
ARMED_SLEEPER = (
    "from slidedp.runtime.lifetime import die_with_parent; die_with_parent(); " + SLEEPER
)


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for a reaper that may never come in a container, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.e2e
def test_a_worker_dies_with_its_parent() -> None:
    parent_code = textwrap.dedent(f"""
        import subprocess, sys, time
        from slidedp.runtime.lifetime import worker_env
        worker = subprocess.Popen([sys.executable, "-c", {ARMED_SLEEPER!r}], env=worker_env(),
                                  stdout=subprocess.PIPE, text=True)
        print(worker.pid, worker.stdout.readline().strip(), flush=True)
        time.sleep(120)
    """)
    with subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                          text=True) as parent:  # fmt: skip
        assert parent.stdout is not None
        pid, armed = parent.stdout.readline().split()
        assert armed == "armed"
        parent.kill()  # SIGKILL: the bench cannot clean up
    try:
        assert _gone_within(int(pid), 30)
    finally:
        if _alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)


def test_a_worker_whose_parent_is_already_gone_does_not_start(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()  # the pid of a parent that exited before the worker armed the signal
    env = os.environ | {lifetime.PARENT_PID: str(gone.pid)}
    worker = subprocess.run([sys.executable, "-c", ARMED_SLEEPER], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert (worker.returncode, worker.stdout) == (-signal.SIGKILL, "")


def test_outside_a_worker_nothing_is_armed() -> None:
    env = {k: v for k, v in os.environ.items() if k != lifetime.PARENT_PID}
    code = ARMED_SLEEPER.replace("time.sleep(120)", "pass")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "armed\n")


@pytest.mark.e2e
def test_a_killed_bench_leaves_no_worker(tmp_path: Path) -> None:
    """``slidedp bench train`` killed by SIGKILL mid-run: its worker (a reference run that would
    go on for a million steps) dies with it."""
    config = write_tiny_config(tmp_path / "tiny")
    bench = subprocess.Popen(
        [sys.executable, "-m", "slidedp", "bench", "train", "--shape", str(config), "--device",
         "cpu", "--systems", "reference", "--batch", "1", "--seq", "8", "--warmup", "0",
         "--steps", "1000000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not workers and time.monotonic() < deadline and bench.poll() is None:
            time.sleep(0.1)
            workers = [p for p in process_tree(bench.pid)[1:] if _is_worker(p)]
        assert workers, "the bench started no worker"
        bench.kill()
        bench.wait()
        assert _gone_within(workers[0], 60)
    finally:
        bench.kill()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _is_worker(pid: int) -> bool:
    """A fresh worker by its command line, a forked one by its name (its command line is the
    bench's)."""
    try:
        proc = Path(f"/proc/{pid}")
        named = (proc / "comm").read_text().strip() == process_name(child.WORKER)
        return named or child.WORKER.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False


# A stand-in worker: two helper processes in its group, each holding memory (a process takes a
# while to exit after SIGKILL, as one with a CUDA context does), then it waits for the timeout.
FAKE_WORKER = """
import os, subprocess, sys, time
HELPER = (
    "import os, sys, time; block = bytearray(200 << 20); "
    "open(sys.argv[1], 'a').write(f'{os.getpid()}\\\\n'); time.sleep(120)"
)
pids = sys.argv[2] + ".pids"
helpers = [subprocess.Popen([sys.executable, "-c", HELPER, pids]) for _ in range(2)]
while not os.path.exists(pids) or len(open(pids).read().split()) < 2:
    time.sleep(0.02)
time.sleep(120)
"""


@pytest.mark.e2e
def test_a_timed_out_run_is_over_when_its_whole_group_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's exit is not the run's end: its helpers (ranks, compile workers) may still be
    exiting. ``run_child`` returns only once no process of the group is alive."""
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(child, "WORKER", "fake_worker")
    spec = dataclasses.replace(tiny_spec(tmp_path, "reference"), timeout_s=10.0)
    result, _ = child.run_child(spec, tmp_path)
    helpers = [int(p) for p in (tmp_path / "reference-b2.json.pids").read_text().split()]
    assert result["status"] == "timeout"
    alive = [p for p in helpers if _alive(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert len(helpers) == 2
    assert alive == []
