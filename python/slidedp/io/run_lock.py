"""One run per output directory: an advisory lock on ``OUTPUT/.slidedp.lock``.

``slidedp train`` takes it before it reads or writes anything else in ``output.dir``; a second
run into the same directory is refused at once (``OutputDirBusyError``: exit 2, one line naming
the holder's pid and host). The lock is ``flock(2)`` on an open file: the kernel drops it when
the process ends however it ends, so a killed run never leaves a stale lock. The file itself
stays behind (its content, ``pid host``, is only read while the lock is held by another run).
On several ranks the process that started them on node 0 holds it (``slidedp train``'s
launcher), or global rank 0 where another launcher (torchrun) started the ranks.

Example::

    with RunLock.acquire(Path(cfg.output.dir)):
        ...  # train
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from slidedp.errors import OutputDirBusyError

LOCK_FILE = ".slidedp.lock"


def _holder(path: Path) -> tuple[int | None, str]:
    """The pid and host the lock file names (None, "?" while the holder has not written it)."""
    try:
        pid, _, host = path.read_text().strip().partition(" ")
        return int(pid), host or "?"
    except (OSError, ValueError):
        return None, "?"


@dataclass(frozen=True)
class _Before:
    """A lock file as an earlier run left it."""

    content: bytes
    atime_ns: int
    mtime_ns: int


@dataclass
class DirTimes:
    """A directory's times before a refused run made an entry in it (the lock file, the output
    directory itself, a write probe), put back once it removed the entry: a refusal leaves
    the directory as it was. ``untouched``: no other process changed it since ``made``."""

    path: Path
    atime_ns: int
    mtime_ns: int
    made_ns: int | None = None  # the mtime once the entry was made

    @classmethod
    def of(cls, path: Path) -> DirTimes:
        stat = os.stat(path)
        return cls(path, stat.st_atime_ns, stat.st_mtime_ns)

    def made(self) -> None:
        self.made_ns = os.stat(self.path).st_mtime_ns

    def untouched(self) -> bool:
        return self.made_ns is not None and os.stat(self.path).st_mtime_ns == self.made_ns

    def restore(self) -> None:
        with contextlib.suppress(OSError):  # not its owner: a run's writes would touch it too
            os.utime(self.path, ns=(self.atime_ns, self.mtime_ns))


class RunLock:
    """An exclusive ``flock`` on ``OUTPUT/.slidedp.lock``, held until ``release`` or exit."""

    def __init__(
        self,
        path: Path,
        fd: int,
        created_dir: Path | None,
        before: _Before | None,
        times: DirTimes,
    ) -> None:
        self.path, self.fd, self.created_dir, self.before = path, fd, created_dir, before
        self.times = times

    @classmethod
    def acquire(cls, out_dir: Path) -> RunLock:
        """Create ``out_dir`` if needed, lock it, write ``pid host`` into the lock file; raises
        ``OutputDirBusyError`` when another process holds it."""
        created = _first_missing(out_dir)
        times = DirTimes.of(out_dir if created is None else created.parent)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / LOCK_FILE
        before, existed = None, path.exists()
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if not _flock(fd, fcntl.LOCK_EX, tries=_TRIES):
                os.close(fd)
                raise _busy(out_dir, path)
            # a run that gave the lock up while refused removes the file: ours may be that one
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stat = os.fstat(fd)
        if existed:  # a lock file an earlier run left
            before = _Before(path.read_bytes(), stat.st_atime_ns, stat.st_mtime_ns)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        times.made()
        return cls(path, fd, created, before, times)

    def release(self, *, refused: bool = False) -> None:
        """Unlock. ``refused``: the run wrote nothing else, so its lock file (and the output
        directory it created) are removed: a refused run leaves the directory as it was."""
        if self.fd < 0:
            return
        if refused and self.before is not None:  # as an earlier run left it, mtime included
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, self.before.content, 0)
            os.utime(self.fd, ns=(self.before.atime_ns, self.before.mtime_ns))
        elif refused:
            untouched = self.times.untouched()
            self.path.unlink(missing_ok=True)
            removed = self.created_dir is None or _remove_created(
                self.path.parent, self.created_dir
            )
            if untouched and removed:
                self.times.restore()
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()


def check_not_in_use(out_dir: Path) -> None:
    """``OutputDirBusyError`` when another run holds ``out_dir``'s lock (``slidedp validate``:
    the refusal ``train`` would meet). Creates nothing; its shared lock, held for an instant,
    delays a starting run's ``acquire`` by at most one of its retries."""
    path = out_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file (or none this process may open): no run holds it
        return
    try:
        if not _flock(fd, fcntl.LOCK_SH, tries=1):
            raise _busy(out_dir, path)
    finally:
        os.close(fd)  # unlocks


_TRIES = 20  # of a lock another process holds for an instant (``check_not_in_use``): 10 ms apart


def _flock(fd: int, kind: int, *, tries: int) -> bool:
    """Whether ``flock(fd, kind)`` was granted within ``tries`` non-blocking attempts."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < tries:
                time.sleep(0.01)
    return False


def _busy(out_dir: Path, path: Path) -> OutputDirBusyError:
    pid, host = _holder(path)
    who = "another run" if pid is None else f"run pid {pid} on host {host}"
    return OutputDirBusyError(
        f"output.dir {out_dir} is in use by {who} (it holds {path}); wait for it to end or "
        "stop it, or choose another output.dir",
        pid=pid,
        host=host,
    )


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (None: it exists)."""
    missing = None
    for parent in (path, *path.parents):
        if parent.exists():
            return missing
        missing = parent
    return missing


def _remove_created(out_dir: Path, created: Path) -> bool:
    """``out_dir`` and its parents up to ``created`` (what ``acquire`` made), while empty;
    whether ``created`` went too."""
    for folder in (out_dir, *out_dir.parents):
        try:
            folder.rmdir()
        except OSError:
            return False
        if folder == created:
            return True
    return False
