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
import os
from collections.abc import Callable, Sequence
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


def writable(flag: str, path: str | None) -> None:
    """Refuse ``flag``'s file ``path`` (None: not given) where it cannot be written: a
    directory, or a place under a file or a read-only directory."""
    if path is None:
        return
    out = Path(path)
    parent = next((p for p in (out.parent, *out.parent.parents) if p.exists()), Path("."))
    if out.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {out}: cannot write a file there")
