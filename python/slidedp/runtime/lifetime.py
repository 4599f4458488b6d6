"""How long the processes of a bench run live: no worker outlives the bench, and no system starts
while the process group of the previous one is still exiting. Linux only (``/proc``, ``prctl``).

- ``die_with_parent``: the kernel SIGKILLs the worker when its parent exits
  (``PR_SET_PDEATHSIG``; a parent dead before that is caught through ``worker_env``), so a
  killed bench leaves no worker holding the GPU.
- ``stop_group``: SIGKILL to a run's process group, then a bounded wait until none of it is
  alive (a process with a CUDA context takes seconds to exit).

Example::

    subprocess.Popen(command, env=worker_env(), start_new_session=True)  # in the bench
    die_with_parent()  # in the worker, before anything else
    survivors = stop_group(proc.pid)  # in the bench, when the run is over
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

PARENT_PID = "SLIDEDP_BENCH_PARENT_PID"  # set for a worker: the pid of the process starting it
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GROUP_EXIT_S = 60.0  # a killed group's processes have this long to be gone
POLL_S = 0.05


def prctl(option: int, value: int | ctypes.c_char_p) -> None:
    """``prctl(option, value)`` of this process (<linux/prctl.h>); ``OSError`` on failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}): {os.strerror(errno)}")


def worker_env() -> dict[str, str]:
    """This process's environment, naming this process as the parent of the worker started
    with it."""
    return os.environ | {PARENT_PID: str(os.getpid())}


def die_with_parent() -> None:
    """SIGKILL to this process when the one that started it exits (``PR_SET_PDEATHSIG``); at once
    if it has already gone. A no-op outside a worker (no ``PARENT_PID``). SIGKILL, not SIGTERM:
    a worker has nothing to save, and ours installs SIGTERM handlers that finish the step first.
    The signal follows the parent *thread* that forked: the bench and the ranks' launcher start
    their workers from the main thread, which lives as long as they do."""
    parent = os.environ.get(PARENT_PID)
    if parent is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # gone before the signal was armed: nobody will send it
        os.kill(os.getpid(), signal.SIGKILL)
    os.environ[PARENT_PID] = str(os.getpid())  # the ranks this worker launches die with it


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that are alive (zombies, which hold no memory
    and no device, are not), from ``/proc/PID/stat``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        state, _ppid, pgrp = stat.rpartition(")")[2].split()[:3]  # after the command's name
        if int(pgrp) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def stop_group(pgid: int, timeout_s: float = GROUP_EXIT_S) -> list[int]:
    """SIGKILL to every process of group ``pgid``, then wait until none is alive; the pids still
    alive after ``timeout_s`` (stuck in the kernel: none normally)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(ProcessLookupError):  # again each round: one forked meanwhile
            os.killpg(pgid, signal.SIGKILL)
        alive = group_members(pgid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(POLL_S)
