"""Disk space for checkpoints: checked before the first step, reported when a save runs out.

A checkpoint holds 12 bytes per trained parameter (FP32 master and both Adam moments), 4 per
frozen one (``train.freeze``: master only), the tokenizer and a few JSON files. The preflight
checks that ``output.dir``'s filesystem has room for the checkpoints on disk at once
(``save_total_limit`` plus the one being written, less those there).
Invariant: a save that still runs out raises ``DiskFullError``, one line naming the filesystem,
the bytes needed and free and the intact checkpoint to resume from (the partial one removed).

Example::

    need = checkpoint_bytes(adapter)
    with disk_full_reported(out_dir, need):
        save_checkpoint(out_dir, ...)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slidedp.errors import NO_SPACE_ERRNOS, DiskFullError
from slidedp.io.checkpoint import complete_checkpoints
from slidedp.io.export import TOKENIZER_FILES
from slidedp.io.run_lock import LOCK_FILE
from slidedp.models.hf import HFAdapter

STATE_COPIES = 3  # master weights, exp_avg, exp_avg_sq: FP32 each
MOMENT_COPIES = 2  # of them, what a frozen parameter lacks
# safetensors headers, config, rng and trainer state, manifest: a few KiB on small models, the
# headers grow with the tensor count (~150 B each); 1 MiB covers thousands of tensors
SMALL_FILES_BYTES = 1 << 20


def checkpoint_bytes(adapter: HFAdapter) -> int:
    """The bytes one checkpoint of this model takes."""
    shapes = adapter.shapes()
    frozen = sum(math.prod(shapes[n]) for n in adapter.frozen)
    return (
        export_bytes(adapter)
        + (STATE_COPIES - 1) * 4 * _params(adapter)
        - (MOMENT_COPIES * 4 * frozen)
    )


def export_bytes(adapter: HFAdapter) -> int:
    """The bytes of the HF model part of a checkpoint (an export): f32 weights, tokenizer."""
    source = adapter.path
    tokenizer = 0 if source is None else sum(
        (source / f).stat().st_size for f in TOKENIZER_FILES if (source / f).is_file()
    )  # fmt: skip
    return 4 * _params(adapter) + tokenizer + SMALL_FILES_BYTES


def _params(adapter: HFAdapter) -> int:
    return sum(math.prod(shape) for shape in adapter.shapes().values())


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or of its
    nearest existing parent)."""
    while not path.exists():
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _allocated(path: Path) -> int:
    """Bytes ``path`` holds on its filesystem (0: no such file)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def filesystem_of(path: Path) -> str:
    """The mount point holding ``path`` (or its nearest existing parent)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    device = path.stat().st_dev
    while path != path.parent and path.parent.stat().st_dev == device:
        path = path.parent
    return str(path)


def checkpoints_at_once(total_limit: int, existing: int, saves: int) -> int:
    """How many more checkpoints than the ``existing`` ones the disk holds at the peak, when
    the run writes ``saves`` of them keeping the newest ``total_limit`` (0: all): the one being
    written is on disk beside every kept one until the oldest is removed."""
    if saves == 0:
        return 0
    if total_limit == 0:
        return saves
    if existing >= total_limit:
        return 1
    return min(saves, total_limit + 1 - existing)


def saves_of_run(start_step: int, max_steps: int, save_steps: int) -> int:
    """Checkpoints a run from ``start_step`` writes: every ``save_steps`` and at the end."""
    if start_step >= max_steps:
        return 0
    periodic = 0 if save_steps == 0 else (max_steps - 1) // save_steps - start_step // save_steps
    return periodic + 1


def check_disk_space(
    out_dir: Path,
    *,
    one_bytes: int,
    total_limit: int,
    saves: int,
    best: bool = False,
    final_bytes: int = 0,
) -> str:
    """Raise ``DiskFullError`` unless ``out_dir``'s filesystem can hold the checkpoints the run
    will have on disk at once (``best``: one more, the best one kept beside the newest) and
    ``final_bytes`` (its export, ``final/``); else a summary (checkpoints, bytes, free bytes)."""
    existing = len(complete_checkpoints(out_dir))
    count = checkpoints_at_once(total_limit, existing, saves) + int(best and total_limit > 0)
    # the run's lock file (its own, or one an earlier run left: rewritten in place) counts as
    # free: ``train`` checks while holding it, ``validate`` before it exists; both agree
    need, free = (
        count * one_bytes + final_bytes,
        free_bytes(out_dir) + _allocated(out_dir / LOCK_FILE),
    )
    if need > free:
        limit = f"output.save_total_limit={total_limit}" if total_limit else "every checkpoint kept"
        raise DiskFullError(
            f"output.dir {out_dir} is on {filesystem_of(out_dir)} with {free:,} bytes free, but "
            f"this run needs {need:,} bytes there: {count} checkpoint(s) of {one_bytes:,} bytes "
            f"on disk at once ({limit}, the one being written included)"
            f"{f' and its export of {final_bytes:,}' if final_bytes else ''}; free space, lower "
            "output.save_total_limit, or choose another output.dir"
        )
    export = f" and the export ({final_bytes / 2**30:.2f} GiB)" if final_bytes else ""
    return (
        f"{count} checkpoint(s) of {one_bytes / 2**30:.2f} GiB{export} fit in "
        f"{free / 2**30:.2f} GiB free"
    )


@contextmanager
def disk_full_reported(out_dir: Path, one_bytes: int) -> Iterator[None]:
    """Within the block (a checkpoint save), running out of space raises ``DiskFullError``
    naming the filesystem, bytes needed and free, and the newest intact checkpoint."""
    try:
        yield
    except OSError as e:
        if e.errno not in NO_SPACE_ERRNOS:
            raise
        intact = complete_checkpoints(out_dir)
        resume = (
            f"resume from the intact {intact[-1]} with train.resume=auto"
            if intact
            else "no checkpoint was saved yet"
        )
        raise DiskFullError(
            f"no space left on {filesystem_of(out_dir)} while saving a checkpoint into "
            f"{out_dir}: it needs {one_bytes:,} bytes, {free_bytes(out_dir):,} are free; "
            f"{resume} once there is room"
        ) from None
