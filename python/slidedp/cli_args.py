"""Argument types and checks of the command line's options, shared by its verbs: a bad value
is argparse's one usage line (exit 2), an output path that cannot be written is refused before
anything is measured.

Example::

    parser.add_argument("--steps", type=count(1), default=5)
    parser.add_argument("--ratios", type=ratios, default="0,1")
    writable("--json", args.json)  # before the measuring, not after it
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from slidedp.errors import ConfigError


def count(least: int) -> Callable[[str], int]:
    """An integer of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        return value

    return parse


def counts(text: str) -> list[int]:
    """Comma-separated integers, each at least 1 (thread counts, batch sizes)."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers >= 1 such as 1,2,4, got {text!r}"
        )
    return values


def ratios(text: str) -> str:
    """Comma-separated offload ratios, each in [0, 1] (kept as text: the profile's key)."""
    for item in text.split(","):
        try:
            ok = 0.0 <= float(item) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(
                f"must be ratios in [0, 1] such as 0,0.5,1, got {text!r}"
            )
    return text


def listed(known: Sequence[str]) -> Callable[[str], str]:
    """Comma-separated names, each one of ``known`` (kept as text)."""

    def parse(text: str) -> str:
        unknown = [name for name in text.split(",") if name and name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r} (known: {', '.join(known)})")
        return text

    return parse


def positive(text: str) -> float:
    """A number above 0 (a rate, a bandwidth)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def writable(flag: str, path: str | None) -> None:
    """Refuse ``flag``'s file ``path`` (None: not given) where it cannot be written: a
    directory, or a place under a file or a read-only directory. A missing folder is created
    now, as ``output.dir`` and ``slidedp plan --out`` are, so that the write after the
    measuring cannot fail on it."""
    if path is None:
        return
    out = Path(path)
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ConfigError(f"{flag} {out}: cannot write a file there ({blocked} is a file)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {out}: cannot write a file there ({e.strerror})") from None
    if out.is_dir() or not os.access(out.parent, os.W_OK):
        raise ConfigError(f"{flag} {out}: cannot write a file there")


@contextlib.contextmanager
def quiet_closed_stdout() -> Iterator[None]:
    """Stop printing, quietly, where the reader closed stdout (``slidedp estimate | head``):
    the rest goes to /dev/null, so neither this nor the interpreter's last flush complains."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
