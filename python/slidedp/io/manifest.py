"""A checkpoint's manifest: every file's size and CRC-32, written at save time, checked on resume.

``checkpoint-STEP/manifest.json`` lists each file (relative path) with its size and CRC-32
(computed right after the file is written, still in the page cache). On resume the sizes are
always checked; the checksums when ``train.verify_checksums`` asks or a file of the right size
cannot be read. Checkpoints older than the manifest: only the needed files' presence.

Example::

    write_manifest(tmp)                         # after every other file is written
    problem = size_problem(path)                # None, or e.g. "optimizer/exp_avg.safetensors
    problem = checksum_problem(path)            #   has 96 bytes, 4,096 when saved (cut short)"
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
_CHUNK = 16 << 20


def crc32(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_manifest(root: Path) -> None:
    """``root/manifest.json`` for every file under ``root`` (written last)."""
    files = {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "crc32": crc32(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (root / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1) + "\n")


def read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    """The files the manifest of checkpoint ``path`` lists; None for a checkpoint without one.
    A manifest that cannot be read is itself damage: ``ValueError`` saying what is wrong."""
    file = path / MANIFEST
    if not file.exists():
        return None
    try:
        files = json.loads(file.read_text())["files"]
        if all(isinstance(e["bytes"], int) and isinstance(e["crc32"], str) for e in files.values()):
            return dict(files)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        pass
    raise ValueError(f"{MANIFEST} is unreadable or garbled")


def size_problem(path: Path, manifest: dict[str, dict[str, Any]]) -> str | None:
    """The first file of ``manifest`` missing from checkpoint ``path`` or of another size."""
    for name, entry in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            how = "cut short" if size < entry["bytes"] else "overwritten"
            return f"{name} has {size:,} bytes, {entry['bytes']:,} when saved ({how})"
    return None


def checksum_problem(path: Path, manifest: dict[str, dict[str, Any]]) -> str | None:
    """The first file of ``manifest`` whose content differs from what was saved."""
    problem = size_problem(path, manifest)
    if problem is not None:
        return problem
    for name, entry in manifest.items():
        got = crc32(path / name)
        if got != entry["crc32"]:
            return f"{name} differs from what was saved (CRC-32 {got}, {entry['crc32']} when saved)"
    return None
