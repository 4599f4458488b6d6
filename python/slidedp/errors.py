"""The exception tree of slidedp. Every error the engine raises is one of these.

Each class also derives from the builtin a caller would naturally catch (``MemoryError`` for a
store that does not fit, ``TimeoutError`` for a version wait, ...), and the Rust side attaches
the numbers that matter as attributes (``needed_bytes``, ``layer``, ``expected``, ...).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class SlidedpError(Exception):
    """Base class of every slidedp error."""


def exception_line(e: BaseException) -> str:
    """``e`` as one line, its type and its message's first paragraph (torch's compiler errors
    carry the cause there and pages of advice after it)."""
    first = str(e).strip().split("\n\n", 1)[0]
    return " ".join(f"{type(e).__name__}: {first}".split())


class OutOfSharedMemoryError(SlidedpError, MemoryError):
    """The host store does not fit; ``needed_bytes`` and ``available_bytes`` say by how much."""

    needed_bytes: int
    available_bytes: int


class OutOfDeviceMemoryError(SlidedpError, MemoryError):
    """A run's estimated GPU peak exceeds the device; ``needed_bytes`` and ``available_bytes``."""

    needed_bytes: int
    available_bytes: int


class StoreAttachError(SlidedpError, RuntimeError):
    """A process could not attach to a host store by name."""


class LayerOutOfRangeError(SlidedpError, IndexError):
    """A layer index beyond the store's ``layers``."""

    layer: int
    layers: int


class UnknownParameterError(SlidedpError, KeyError):
    """A parameter name that the store layout does not contain."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvalidLayoutError(SlidedpError, ValueError):
    """A store spec that cannot be laid out (duplicates, empty shapes, no groups)."""


class VersionTimeoutError(SlidedpError, TimeoutError):
    """A version wait ran out of time; ``layer``, ``expected``, ``got`` and ``timeout_ms``."""

    layer: int
    expected: int
    got: int
    timeout_ms: int


class StorePoisonedError(SlidedpError, RuntimeError):
    """Another process declared the store failed while this one waited on ``layer``."""

    layer: int


class PeerFailedError(SlidedpError, RuntimeError):
    """A collective failed because another rank died or raised (that rank reports its error)."""


class UpdateFailedError(SlidedpError, RuntimeError):
    """A host parameter update failed; later updates were skipped and the store poisoned.
    ``first``: 1 when this failure poisoned the store before any other rank's did (the one
    reported where several ranks fail together), else 0."""

    first: int = 1


class UpdateTimeoutError(SlidedpError, TimeoutError):
    """Updates were still pending when ``drain`` gave up; ``pending`` and ``timeout_ms``."""

    pending: int
    timeout_ms: int


class LengthMismatchError(SlidedpError, ValueError):
    """Buffers of different lengths passed to one kernel; ``expected`` and ``got``."""

    expected: int
    got: int


class IsaUnsupportedError(SlidedpError, RuntimeError):
    """An instruction-set path this CPU cannot run."""


class InvalidArgumentError(SlidedpError, ValueError):
    """An argument outside its valid range."""


class HostIOError(SlidedpError, OSError):
    """An operating-system call of the host engine failed."""


class EnginePanicError(SlidedpError, RuntimeError):
    """A bug in the Rust engine (a panic), turned into an exception instead of an abort."""


class ConfigError(SlidedpError, ValueError):
    """A training config that cannot be used (unknown key, bad value, unreadable file).

    ``problems`` holds one line per problem found: a config is checked as a whole and every
    problem is reported at once (``str(error)`` is those lines joined by newlines)."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class DataError(SlidedpError, ValueError):
    """Training data that cannot be read (bad JSONL line, missing field, too few sequences)."""


class ModelLoadError(SlidedpError, ValueError):
    """A model directory that cannot be loaded (no config.json, unsupported architecture,
    missing or mis-shaped weights)."""


class NonFiniteError(SlidedpError, FloatingPointError):
    """A non-finite loss or gradient norm; raised before any update of that step is applied.
    ``step`` is the 0-based step, ``what`` names the quantity."""

    def __init__(self, message: str, *, step: int, what: str) -> None:
        super().__init__(message)
        self.step = step
        self.what = what


class CheckpointError(SlidedpError, ValueError):
    """A checkpoint that cannot be written or resumed from (incompatible with the model or the
    config, incomplete, or an existing checkpoint that would be written into)."""


class TrainingInterruptedError(SlidedpError, RuntimeError):
    """Training stopped on SIGTERM/SIGINT after saving a checkpoint; ``signal_name``,
    ``step`` (steps completed) and ``checkpoint`` (its directory)."""

    def __init__(self, message: str, *, signal_name: str, step: int, checkpoint: str) -> None:
        super().__init__(message)
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint


class OutputDirBusyError(SlidedpError, RuntimeError):
    """Another run holds the lock of ``output.dir`` (``io.run_lock``); ``pid`` and ``host``
    name it (``pid`` None while it has not written them)."""

    def __init__(self, message: str, *, pid: int | None, host: str) -> None:
        super().__init__(message)
        self.pid = pid
        self.host = host


class DiskFullError(SlidedpError, OSError):
    """``output.dir``'s filesystem cannot hold the run's checkpoints (found before the first
    step), or ran out of space while saving one (``io.disk_space``) or exporting one."""


# the errors of a write that found no room: the filesystem or the user's quota full, a file
# larger than the limit (``ulimit -f``)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


_collected_problems: ContextVar[list[str] | None] = ContextVar("collected_problems", default=None)


def require(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok`` (config validation); inside
    ``collect_problems()`` the message is recorded instead, so that checking goes on."""
    if ok:
        return
    problems = _collected_problems.get()
    if problems is None:
        raise ConfigError(message)
    problems.append(message)


@contextmanager
def collect_problems() -> Iterator[list[str]]:
    """Within the block, failed ``require`` checks append to the yielded list instead of raising
    (the config loader uses it to report every problem of a config at once)."""
    problems: list[str] = []
    token = _collected_problems.set(problems)
    try:
        yield problems
    finally:
        _collected_problems.reset(token)
