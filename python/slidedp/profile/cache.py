"""The measurement cache shared by ``slidedp profile layer`` and ``slidedp profile host``: one
JSON report per key (a hash of the facts the measurement depends on) under
``$XDG_CACHE_HOME/slidedp/profile``, written atomically; a file that does not read is a miss.

Example::

    path = cache_file(None, "host", facts)
    report = read_report(path) or measure()
    keep_report(path, report)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/slidedp/profile`` (``~/.cache`` when unset, as XDG says)."""
    return str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "slidedp" / "profile")


@functools.cache
def cpu_model() -> str:
    """This host's CPU model (``/proc/cpuinfo``), part of every measurement's key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def cache_file(cache_dir: str | None, kind: str, facts: dict[str, Any]) -> Path:
    """Where the ``kind`` report of ``facts`` is cached (``cache_dir`` None: the default)."""
    folder = Path(cache_dir or default_cache_dir()).expanduser()
    return folder / f"{kind}-{cache_key(facts)}.json"


def read_report(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None: no file, or one that does not read as an object."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Written beside, then renamed over: never a half-written cache file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(report, indent=1))
    os.replace(partial, path)


def keep_report(path: Path, report: dict[str, Any]) -> None:
    """``write_report`` into the cache, or one warning line where the cache cannot be written
    (``XDG_CACHE_HOME`` a file, a full or read-only disk): the run goes on, uncached."""
    try:
        write_report(path, report)
    except OSError as e:
        print(
            f"slidedp: warning: not cached: {path}: {e.strerror or e}", file=sys.stderr, flush=True
        )
