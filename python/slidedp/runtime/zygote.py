"""A copy of a command's process taken right after its imports, forking its children (the ranks
of ``launch``; ``start_child``: the bench's workers and probes, AutoPolicy's measurements and
trials) with torch and transformers imported (a fresh interpreter spends ~8 CPU-s on them).

``Zygote.forked()`` needs a process that computed nothing yet (``can_fork``: GNU OpenMP, CUDA
and threads do not survive a fork); one that computed spawns it (``Zygote.spawned``: a fresh
interpreter importing ``preload``). A child is forked twice (zygote -> middle -> child) and
adopted by the launcher (a child subreaper while it starts one): its child as a ``Popen`` is.
Its environment, directory, session, stdio and name (``process_name``: its command line is the
zygote's) are set before its module runs; what a library
read while importing is the zygote's. ``process_age_s`` counts the inherited imports. No zygote
outlives its launcher (``PR_SET_PDEATHSIG``); ``close`` (at the latest on leaving) reaps it.

Example::

    with Zygote.started(("slidedp.cli",), own_process=True) as zygote:  # forked if can_fork()
        rank = zygote.start("slidedp", ["train", "run.yaml"], env, own_session=True)
        code = rank.wait()
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any, NoReturn

import torch

from slidedp.runtime.lifetime import PR_SET_PDEATHSIG, prctl

PR_SET_NAME = 15  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
MESSAGE_BYTES = 1 << 20  # one request: module, argv, environment
CLOSE_S = 10.0  # a closed zygote has this long to exit before it is killed
CUDA_DRIVER = "libcuda.so"  # mapped by importing torch on a CUDA machine; initialized by cuInit
CUDA_ERROR_NOT_INITIALIZED = 3  # cuda.h
POLL_S = 0.01
Stream = IO[bytes] | IO[str] | int | None  # a child's stdin, stdout or stderr (None: ours)
_inherited_s = 0.0  # in a forked child: how long its zygote's state took to build (imports)


def process_age_s() -> float:
    """Seconds since this process started (``/proc``: the kernel's start time, so the
    interpreter's start and the imports count), plus, in a child forked from a zygote, the
    time its zygote's imports took (which a fresh interpreter would have spent itself)."""
    start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK") + _inherited_s


def process_name(module: str) -> str:
    """The name (``/proc/PID/comm``, 15 bytes) of a child forked to run ``module``."""
    return module[-15:]


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

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; past ``timeout`` seconds ``subprocess.TimeoutExpired``."""
        if timeout is None and self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        deadline = time.monotonic() + (timeout or 0.0)
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # never a reaped pid, which the kernel may give again
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Child = ForkedRank | subprocess.Popen[bytes]  # a child forked from a zygote, or a fresh one


class Zygote:
    """The forked (or spawned: ``process``) copy ``pid``, asked for children over ``channel``."""

    def __init__(
        self, pid: int, channel: socket.socket, process: subprocess.Popen[bytes] | None = None
    ) -> None:
        self.pid, self.channel, self.process = pid, channel, process

    @classmethod
    @contextlib.contextmanager
    def started(cls, preload: tuple[str, ...], *, own_process: bool) -> Iterator[Zygote]:
        """``forked`` when ``own_process`` (this process runs one command and has computed
        nothing: OpenMP's pool cannot be seen) and ``can_fork``, else ``spawned(preload)``."""
        forks = own_process and can_fork()
        with cls.forked() if forks else cls.spawned(preload) as zygote:
            yield zygote

    @classmethod
    @contextlib.contextmanager
    def spawned(cls, preload: tuple[str, ...]) -> Iterator[Zygote]:
        """A zygote in a fresh interpreter that imports the modules ``preload`` (while this
        process goes on) before it forks its first child; on leaving, it exits and is reaped."""
        ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        serve = f"from {__name__} import serve_spawned; serve_spawned()"
        command = [sys.executable, "-c", serve, str(its.fileno()), *preload]
        with _subreaper():  # while it is spawned: its descendants may be adopted by this process
            process = subprocess.Popen(command, pass_fds=[its.fileno()])
        its.close()
        zygote = cls(process.pid, ours, process)
        try:
            yield zygote
        finally:
            zygote.close()

    @classmethod
    @contextlib.contextmanager
    def forked(cls) -> Iterator[Zygote]:
        """A zygote while inside; on leaving, it exits and is reaped."""
        ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()  # nothing buffered is written twice
        sys.stderr.flush()
        built_s = process_age_s()
        with _subreaper():  # while it is forked: its descendants may be adopted by this process
            pid = os.fork()
            if pid == 0:
                ours.close()
                _serve(its, launcher=os.getppid(), built_s=built_s)
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
        if self.process is None:
            _reap(self.pid, CLOSE_S)
        else:
            try:
                self.process.wait(CLOSE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def start(
        self,
        module: str,
        argv: list[str],
        env: dict[str, str],
        *,
        own_session: bool,
        output: tuple[Stream, Stream] = (None, None),
        stdin: Stream = None,
    ) -> ForkedRank:
        """``python -m MODULE ARGV`` with ``env``, in its own session or not, reading ``stdin``
        and writing to ``output`` (stdout, stderr): files or descriptors, None: this
        process's."""
        request = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(),
                   "own_session": own_session}  # fmt: skip
        fds = [_fd(given, default) for default, given in enumerate((stdin, *output))]
        with _subreaper():  # the middle process exits: the child comes to us, before the reply
            socket.send_fds(self.channel, [json.dumps(request).encode()], fds)
            reply = json.loads(self.channel.recv(MESSAGE_BYTES) or b'{"error": "zygote gone"}')
        if "error" in reply:
            raise OSError(f"could not fork a rank of {module}: {reply['error']}")
        return ForkedRank(int(reply["pid"]))


class Children:
    """The zygote of ``children_forked``: forked when it was entered, else spawned at the first
    child (a command refused before it starts one pays no interpreter)."""

    def __init__(self, preload: tuple[str, ...], stack: contextlib.ExitStack) -> None:
        self.preload, self._stack = preload, stack
        self._zygote: Zygote | None = None

    def fork_now(self) -> None:
        self._zygote = self._stack.enter_context(Zygote.forked())

    def zygote(self) -> Zygote:
        """The zygote, spawned now if there is none."""
        if self._zygote is None:
            self._zygote = self._stack.enter_context(Zygote.spawned(self.preload))
        return self._zygote

    def close(self) -> None:
        """Let the zygote, if there is one, exit: no child starts from it after."""
        if self._zygote is not None:
            self._zygote.close()


_children: ContextVar[Children | None] = ContextVar("children", default=None)


@contextlib.contextmanager
def children_forked(preload: tuple[str, ...], *, own_process: bool) -> Iterator[Children]:
    """Within (this thread and context), ``start_child`` forks from one zygote: a copy of this
    process taken now when ``own_process`` (as ``Zygote.started``), else one spawned importing
    ``preload`` when the first child starts."""
    with contextlib.ExitStack() as stack:
        children = Children(preload, stack)
        if own_process and can_fork():
            children.fork_now()
        token = _children.set(children)
        try:
            yield children
        finally:
            _children.reset(token)


def children_zygote() -> Zygote | None:
    """The zygote of the ``children_forked`` this runs inside (spawned now if it must be)."""
    children = _children.get()
    return None if children is None else children.zygote()


def start_child(
    module: str,
    argv: list[str],
    env: dict[str, str],
    *,
    own_session: bool = False,
    stdio: tuple[Stream, Stream, Stream] = (None, None, None),
    zygote: Zygote | None = None,
) -> Child:
    """``python -m MODULE ARGV`` with ``env``, reading and writing ``stdio`` (stdin, stdout,
    stderr; None: this process's): forked from ``zygote``, else from the one of
    ``children_forked`` inside one, else a fresh interpreter."""
    zygote = zygote or children_zygote()
    if zygote is None:
        stdin, stdout, stderr = stdio
        return subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                                start_new_session=own_session, stdin=stdin, stdout=stdout,
                                stderr=stderr)  # fmt: skip
    return zygote.start(module, argv, env, own_session=own_session, output=stdio[1:],
                        stdin=stdio[0])  # fmt: skip


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """This process adopts the orphans of its descendants while inside, and only then: an orphan
    adopted later (a killed child's own children) would stay its zombie, never waited for."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        prctl(PR_SET_CHILD_SUBREAPER, 0)


def _fd(given: Stream, default: int) -> int:
    if given is None:
        return default
    return given if isinstance(given, int) else given.fileno()


def serve_spawned() -> NoReturn:
    """A spawned zygote's life (``python -c ... FD MODULE...``): import the modules, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's, while importing too
    for module in sys.argv[2:]:
        importlib.import_module(module)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the children's: a fresh one's
    channel = socket.socket(fileno=int(sys.argv[1]))
    _serve(channel, launcher=os.getppid(), built_s=process_age_s())


def _reap(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)


def _serve(channel: socket.socket, launcher: int, built_s: float) -> NoReturn:
    """The zygote: one rank per request until the launcher closes the channel or exits;
    ``built_s``: the age of the state it forks (its ranks' ``process_age_s`` starts there)."""
    global _inherited_s
    _inherited_s = built_s
    code = 0
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # Ctrl-C is the launcher's to handle; a rank gets the launcher's own disposition back
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        while os.getppid() == launcher:
            message, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 3)
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
        for target, fd in enumerate(fds):  # stdin, stdout, stderr
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, interrupt)  # ignored if the launcher's was, as exec keeps
        os.chdir(request["cwd"])
        name = process_name(request["module"]).encode()
        prctl(PR_SET_NAME, ctypes.c_char_p(name))
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
