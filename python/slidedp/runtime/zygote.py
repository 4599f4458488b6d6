"""A copy of the launcher taken right after its imports, forking the ranks of ``launch``: a rank
starts with torch and transformers imported (a fresh interpreter spends ~10 CPU-s on them).

``Zygote.forked()`` must be entered before this process computes anything (``can_fork``): GNU
OpenMP's pool, CUDA and the threads a computation starts do not survive a fork. A rank is forked
twice (zygote -> a short-lived middle process -> rank) and adopted by the launcher, which is made
a child subreaper: the rank is the launcher's child as a ``subprocess.Popen`` rank is (its
``os.getppid()``, ``waitpid``, signals). Its environment, working directory, session and stdout/
stderr are set before its module runs, so what is read after the imports (``RANK``,
``CUDA_VISIBLE_DEVICES``, the thread counts given to torch) takes effect; what a library read
while importing is the launcher's, whose environment the ranks' extends. No zygote outlives its
launcher (``PR_SET_PDEATHSIG``); ``close`` (at the latest on leaving ``forked``) reaps it.

Example::

    with Zygote.forked() as zygote:  # nothing computed yet
        rank = zygote.start("slidedp", ["train", "run.yaml"], env, own_session=True)
        code = rank.wait()
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

import torch

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
MESSAGE_BYTES = 1 << 20  # one request: module, argv, environment
CLOSE_S = 10.0  # a closed zygote has this long to exit before it is killed
CUDA_DRIVER = "libcuda.so"  # mapped by importing torch on a CUDA machine; initialized by cuInit
CUDA_ERROR_NOT_INITIALIZED = 3  # cuda.h


def can_fork() -> bool:
    """Whether this process may fork a zygote now: Linux, no thread started from Python, the
    CUDA driver not initialized (a driver initialized before a fork is unusable in the child,
    and ``torch.cuda.is_available()`` initializes it without torch saying so). OpenMP's pool
    cannot be seen: the caller must not have computed."""
    if sys.platform != "linux" or threading.active_count() != 1:
        return False
    return not torch.cuda.is_initialized() and not cuda_driver_initialized()  # type: ignore[no-untyped-call]


def cuda_driver_initialized() -> bool:
    """Whether ``cuInit`` ran in this process. Importing torch maps the driver library without
    initializing it (safe to fork); before ``cuInit`` every driver call answers
    CUDA_ERROR_NOT_INITIALIZED, so a device count is the probe. Not mapped: not initialized."""
    if CUDA_DRIVER not in Path("/proc/self/maps").read_text():
        return False
    try:  # the mapped library itself (RTLD_NOLOAD: never loads a second copy)
        driver = ctypes.CDLL(f"{CUDA_DRIVER}.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return True  # mapped under another name: assume the worst
    count = ctypes.c_int()
    return bool(driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}): {os.strerror(errno)}")


class ForkedRank:
    """A rank forked by a zygote, driven as a ``subprocess.Popen``: ``returncode`` is None while
    it runs, then its exit code (negative: the signal that killed it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # never a reaped pid, which the kernel may give again
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The forked copy (``pid``), asked for ranks over ``channel``."""

    def __init__(self, pid: int, channel: socket.socket) -> None:
        self.pid, self.channel = pid, channel

    @classmethod
    @contextlib.contextmanager
    def forked(cls) -> Iterator[Zygote]:
        """A zygote while inside; on leaving, it exits and is reaped."""
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # the ranks' middle process exits: they come to us
        ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()  # nothing buffered is written twice
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(its, launcher=os.getppid())
        its.close()
        zygote = cls(pid, ours)
        try:
            yield zygote
        finally:
            zygote.close()

    def close(self) -> None:
        """Let the zygote exit and reap it (once); the ranks it forked run on."""
        if self.channel.fileno() == -1:
            return
        self.channel.close()  # the zygote reads the end of its requests and exits
        _reap(self.pid, CLOSE_S)
        _prctl(PR_SET_CHILD_SUBREAPER, 0)

    def start(
        self,
        module: str,
        argv: list[str],
        env: dict[str, str],
        *,
        own_session: bool,
        output: tuple[IO[bytes] | None, IO[bytes] | None] = (None, None),
    ) -> ForkedRank:
        """``python -m MODULE ARGV`` with ``env``, in its own session or not, writing to
        ``output`` (stdout, stderr; None: this process's)."""
        request = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(),
                   "own_session": own_session}  # fmt: skip
        fds = [1 if output[0] is None else output[0].fileno(),
               2 if output[1] is None else output[1].fileno()]  # fmt: skip
        socket.send_fds(self.channel, [json.dumps(request).encode()], fds)
        reply = json.loads(self.channel.recv(MESSAGE_BYTES) or b'{"error": "zygote gone"}')
        if "error" in reply:
            raise OSError(f"could not fork a rank of {module}: {reply['error']}")
        return ForkedRank(int(reply["pid"]))


def _reap(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)


def _serve(channel: socket.socket, launcher: int) -> NoReturn:
    """The zygote: one rank per request until the launcher closes the channel or exits."""
    code = 0
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # Ctrl-C is the launcher's to handle; a rank gets the launcher's own disposition back
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        while os.getppid() == launcher:
            message, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 2)
            if not message:
                break
            try:
                pid = _fork_rank(channel, json.loads(message), fds, interrupt)
                reply: dict[str, Any] = {"pid": pid}
            except OSError as e:
                reply = {"error": str(e)}
            finally:
                for fd in fds:
                    os.close(fd)
            channel.send(json.dumps(reply).encode())
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)


def _fork_rank(
    channel: socket.socket, request: dict[str, Any], fds: list[int], interrupt: Any
) -> int:
    """Fork the middle process, which forks the rank, says its pid and exits; the pid once the
    rank is the launcher's child."""
    said, say = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = 1
        try:
            os.close(said)
            me = os.getpid()
            rank = os.fork()
            if rank == 0:
                os.close(say)
                _run_rank(channel, request, fds, middle=me, interrupt=interrupt)
            os.write(say, str(rank).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(say)
    with os.fdopen(said, "rb") as pipe:
        pid = pipe.read()
    os.waitpid(middle, 0)
    if not pid:
        raise OSError("the middle process could not fork")
    return int(pid)


def _run_rank(
    channel: socket.socket, request: dict[str, Any], fds: list[int], middle: int, interrupt: Any
) -> NoReturn:
    """Become ``python -m MODULE ARGV``: its exit code, signal or traceback as a fresh
    interpreter's, with the exit handlers and non-daemon threads waited for; ``interrupt``:
    the launcher's SIGINT handler when the zygote was forked."""
    code = 1
    try:
        channel.close()
        while os.getppid() == middle:  # until the launcher has adopted this process
            time.sleep(0.001)
        if request["own_session"]:
            os.setsid()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, interrupt)  # ignored if the launcher's was, as exec keeps
        os.chdir(request["cwd"])
        os.environ.clear()  # putenv/unsetenv too: C code reads the rank's
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["argv"]]
        code = _run_module(request["module"])
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_module(module: str) -> int:
    """``module`` as ``__main__``, then what the interpreter does on its way out."""
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as the interpreter: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
    atexit._run_exitfuncs()
    return code
