"""Training checkpoints: written atomically, found again, loaded straight into the host store.

``OUTPUT/checkpoint-STEP/``: an HF model directory of the f32 master weights, ``optimizer/``
(Adam moments, same names and shapes), ``rng_state.json``, ``trainer_state.json`` and
``manifest.json`` (every file's size and CRC-32); ``OUTPUT/latest`` names the newest.
Invariants: written into ``.checkpoint-STEP.tmp``, fsync'd, then renamed (the commit point),
then ``latest`` replaced atomically, then the oldest beyond ``save_total_limit`` removed; nothing
is written into an existing checkpoint; tensors stream between the store's views and the files
(never a second copy of the state); the data position is the step (docs/checkpoints.md).

Example::

    path = save_checkpoint(out, adapter, store, Progress(step=20, adam_step=20), meta)
    load_tensors(path, adapter, store)   # in the resumed run, once io.resume checked it
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import random
import re
import shutil
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from slidedp.errors import NO_SPACE_ERRNOS, CheckpointError, DiskFullError
from slidedp.io.export import DEFAULT_MAX_SHARD_BYTES, copy_tokenizer, write_region
from slidedp.io.manifest import MANIFEST, read_manifest, size_problem, write_manifest
from slidedp.models.hf import HFAdapter
from slidedp.store import HostStore, StateRegion

FORMAT = 1
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.json"
OPTIMIZER_DIR = "optimizer"
LATEST = "latest"
FINAL = "final"  # OUTPUT/final: a run's export
FINAL_FROM = ".slidedp-final"  # OUTPUT/.slidedp-final: the checkpoint final/ was exported from
_NOT_EXPORTED = (STATE_FILE, RNG_FILE, MANIFEST)  # a checkpoint's files beside the HF model
# (file prefix, directory inside the checkpoint, store region)
_TENSOR_FILES: tuple[tuple[str, str, StateRegion], ...] = (
    ("model", ".", "master"),
    ("exp_avg", OPTIMIZER_DIR, "exp_avg"),
    ("exp_avg_sq", OPTIMIZER_DIR, "exp_avg_sq"),
)
_NAME = re.compile(r"checkpoint-(\d+)")


@dataclass
class Progress:
    """Where training stands after ``step`` completed steps."""

    step: int = 0  # steps completed: the resumed run starts with 0-based step ``step``
    adam_step: int = 0  # updates applied (skipped steps do not count)
    skipped_steps: int = 0
    consecutive_skips: int = 0


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Every ``out_dir/checkpoint-N`` directory, intact or not, oldest first."""
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found) if p.is_dir()]


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """``out_dir/checkpoint-N`` directories holding a trainer state, oldest first."""
    return [p for p in checkpoint_dirs(out_dir) if (p / STATE_FILE).is_file()]


def capture_rng() -> dict[str, Any]:
    """Every RNG state training may consume, JSON-ready."""
    version, internal, gauss = random.getstate()
    # the legacy global numpy RNG is what user code and libraries may draw from
    numpy_state = np.random.get_state(legacy=True)  # noqa: NPY002
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], numpy_state)

    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": b64(torch.get_rng_state()),
        "cuda": [b64(s) for s in cuda],
    }


def restore_rng(rng: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``. CUDA states are restored when the GPU count is the same
    (with another count there is no one-to-one map; the engine draws no CUDA random numbers)."""

    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))  # noqa: NPY002
    torch.set_rng_state(tensor(rng["torch"]))
    if rng["cuda"] and torch.cuda.is_available() and torch.cuda.device_count() == len(rng["cuda"]):
        torch.cuda.set_rng_state_all([tensor(s) for s in rng["cuda"]])


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory (deepest first), under ``root``."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_contents(
    tmp: Path,
    adapter: HFAdapter,
    store: HostStore,
    state: dict[str, Any],
    max_shard_bytes: int,
) -> None:
    config = copy.deepcopy(adapter.config)
    config.dtype = torch.float32  # the weights' dtype here, whatever the source model's said
    config.save_pretrained(tmp)
    copy_tokenizer(adapter.path, tmp)
    (tmp / OPTIMIZER_DIR).mkdir()
    for prefix, where, region in _TENSOR_FILES:
        write_region(adapter, store, region, tmp / where, prefix, max_shard_bytes)
    (tmp / RNG_FILE).write_text(json.dumps(capture_rng()))
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    write_manifest(tmp)  # last: sizes and checksums of everything above


@dataclass(frozen=True)
class Retention:
    """Which checkpoints of the output directory a save keeps: the newest ``total_limit``
    (0: all). A damaged ``checkpoint-STEP`` listed in ``set_aside`` is renamed
    ``checkpoint-STEP.damaged`` first (kept for the user, never written into). Checkpoints in
    ``keep`` (the best one, ``io.best``) are never removed: kept beside the newest
    ``total_limit``, or one of them."""

    total_limit: int = 0
    set_aside: Collection[Path] = ()
    keep: Collection[Path] = ()


def save_checkpoint(
    out_dir: Path,
    adapter: HFAdapter,
    store: HostStore,
    progress: Progress,
    meta: dict[str, Any],
    *,
    retention: Retention = Retention(),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``out_dir/checkpoint-STEP`` atomically from the (drained) store; point ``latest``
    at it; then rotate as ``retention`` says. ``meta`` is recorded as is."""
    set_aside = retention.set_aside
    final = out_dir / f"checkpoint-{progress.step}"
    if final.exists() and final in set_aside:
        final.rename(_free_name(final.with_name(f"{final.name}.damaged")))
    if final.exists():
        raise CheckpointError(
            f"{final} already exists and a checkpoint is never written into: move it away, or "
            "resume from it with train.resume"
        )
    for stale in [*out_dir.glob(".checkpoint-*.tmp"), *out_dir.glob(".checkpoint-*.deleting")]:
        shutil.rmtree(stale)  # left by a run killed while saving or rotating
    tmp = out_dir / f".{final.name}.tmp"
    tmp.mkdir(parents=True)
    state = {"format": FORMAT, "progress": asdict(progress), **meta}
    try:
        _write_contents(tmp, adapter, store, state, max_shard_bytes)
        _fsync_tree(tmp)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(out_dir)
    pointer = out_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync(pointer)
    pointer.replace(out_dir / LATEST)
    _fsync(out_dir)
    rotate_checkpoints(out_dir, retention, newest=final)
    return final


def rotate_checkpoints(out_dir: Path, retention: Retention, newest: Path) -> None:
    """Remove the complete checkpoints of ``out_dir`` older than the newest
    ``retention.total_limit`` (0: none), except those of ``retention.keep`` and ``newest``."""
    if not retention.total_limit:
        return
    for old in complete_checkpoints(out_dir)[: -retention.total_limit]:
        if old != newest and old not in retention.keep:
            doomed = old.rename(out_dir / f".{old.name}.deleting")  # never half a checkpoint
            shutil.rmtree(doomed)


def _free_name(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... : the first that does not exist."""
    n, free = 1, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.name}-{n}")
    return free


def _tensor_files(path: Path, where: str, prefix: str) -> list[Path]:
    """The files of one state region (``ValueError`` naming what is missing or unreadable)."""
    folder = path / where
    index = folder / f"{prefix}.safetensors.index.json"
    rel = index.relative_to(path)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [folder / f for f in sorted(set(weight_map.values()))]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{rel} is unreadable or garbled") from None
    single = folder / f"{prefix}.safetensors"
    if not single.is_file():
        raise ValueError(f"{single.relative_to(path)} is missing (nor is there an index)")
    return [single]


def tensor_plan(path: Path, adapter: HFAdapter) -> list[tuple[Path, StateRegion]]:
    """Every tensor file of checkpoint ``path`` with its region, each header checked against the
    model (names, shapes, f32; no tensor data read): ``CheckpointError`` when it does not fit,
    ``ValueError`` naming the file when a file is missing or its header unreadable."""
    shapes = adapter.shapes()
    buffers = adapter.buffers.persistent
    plan: list[tuple[Path, StateRegion]] = []
    for prefix, where, region in _TENSOR_FILES:
        seen: set[str] = set()
        for file in _tensor_files(path, where, prefix):
            try:
                with safe_open(str(file), framework="pt") as f:
                    infos = {n: f.get_slice(n) for n in f.keys()}  # noqa: SIM118 (not a mapping)
                    header = {n: (tuple(i.get_shape()), i.get_dtype()) for n, i in infos.items()}
            except (SafetensorError, OSError) as e:
                raise ValueError(
                    f"{file.relative_to(path)} has an unreadable safetensors header ({e})"
                ) from None
            for name, (got, dtype) in header.items():
                if region == "master" and got == buffers.get(name):
                    continue  # a layer's buffer: ``read_buffers`` reads it
                if name not in shapes or got != shapes[name] or dtype != "F32":
                    here = list(shapes[name]) if name in shapes else "absent"
                    raise CheckpointError(
                        f"{path.name} does not fit this model: '{name}' is {dtype}{list(got)} "
                        f"there, {here} here; resume with the model it was trained from "
                        "(model.path), or start afresh in another output.dir"
                    )
                seen.add(name)
            plan.append((file, region))
        _check_names(path, prefix, region, set(shapes), seen, adapter.frozen)
    return plan


def _check_names(
    path: Path,
    prefix: str,
    region: StateRegion,
    stored: set[str],
    seen: set[str],
    frozen: Collection[str],
) -> None:
    """``CheckpointError`` unless ``seen`` are the names ``region`` holds for this model: every
    stored parameter's master weights, the trained ones' moments (``train.freeze``)."""
    if region != "master" and seen != stored - set(frozen):  # the moments: of trained ones
        there, here = sorted(stored - seen), sorted(frozen)
        raise CheckpointError(
            f"{path.name} was trained with another train.freeze: it froze {len(there)} "
            f"parameter(s) ({', '.join(there[:2]) or 'none'}), this config freezes {len(here)} "
            f"({', '.join(here[:2]) or 'none'}); set train.freeze as it was, or start a new run "
            "from its weights (model.path)"
        )
    missing = sorted(stored - seen)
    if region == "master" and missing:
        raise CheckpointError(
            f"{path.name} does not fit this model: {prefix} lacks '{missing[0]}' "
            f"({len(missing)} missing); resume with the model it was trained from"
        )


def load_tensors(path: Path, adapter: HFAdapter, store: HostStore) -> None:
    """Master weights and Adam moments of checkpoint ``path`` into ``store``, tensor by tensor,
    after checking every name, shape and dtype (an incompatible checkpoint changes nothing).
    A file that cannot be read raises ``ValueError`` naming it (``io.resume`` reports it)."""
    for file, region in tensor_plan(path, adapter):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if name not in adapter.buffers.persistent:
                        store.param(name, region).copy_(f.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file.relative_to(path)} cannot be read ({e})") from None


def _weights_problem(checkpoint: Path) -> str | None:
    """Without a manifest: the first weight file whose safetensors header safetensors refuses
    (garbled, or describing more bytes than the file holds), else None."""
    for file in sorted(checkpoint.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            return f"{file.name} has an unreadable safetensors header ({e})"
    return None


def export_checkpoint(checkpoint: Path, out_dir: Path, *, replace: bool = False) -> Path:
    """The HF model part of ``checkpoint`` (or of the checkpoint ``checkpoint/latest`` names)
    as ``out_dir``: config, tokenizer, f32 weights, copied into a temporary sibling and renamed
    into place (nothing half-written is left). Refused before anything is written: a damaged
    checkpoint (manifest sizes, or without one the safetensors headers), a target that is a
    file, not empty (unless ``replace``), or inside a checkpoint or model directory."""
    if not checkpoint.exists():
        raise CheckpointError(f"{checkpoint} does not exist: give OUTPUT/checkpoint-STEP or OUTPUT")
    if (checkpoint / LATEST).is_file():
        checkpoint = checkpoint / (checkpoint / LATEST).read_text().strip()
    if not (checkpoint / STATE_FILE).is_file():
        raise CheckpointError(
            f"{checkpoint} is not a complete slidedp checkpoint (no {STATE_FILE}): give "
            "OUTPUT/checkpoint-STEP or an output directory with a 'latest' pointer"
        )
    try:
        manifest = read_manifest(checkpoint)
        problem = _weights_problem(checkpoint) if manifest is None else None
        problem = problem or (None if manifest is None else size_problem(checkpoint, manifest))
    except ValueError as e:
        problem = str(e)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {checkpoint} is damaged: {problem}; export an earlier checkpoint"
        )
    _check_export_target(out_dir, replace)
    if out_dir.name == FINAL:  # by hand into a run's final/: the run's record of it is void
        (out_dir.parent / FINAL_FROM).unlink(missing_ok=True)
    files = [f for f in checkpoint.iterdir() if f.is_file() and f.name not in _NOT_EXPORTED]
    temp = out_dir.with_name(f".{out_dir.name}.tmp")  # renamed into place once complete
    old = out_dir.with_name(f".{out_dir.name}.old")  # the export replaced, until then
    shutil.rmtree(temp, ignore_errors=True)  # an interrupted export's
    if old.exists() and not out_dir.exists():  # interrupted between the two renames
        old.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    try:
        temp.mkdir(parents=True)
        for src in files:  # copies, not links: the export is the user's to change
            shutil.copyfile(src, temp / src.name)
        _fsync_tree(temp)
        if out_dir.exists():  # set aside until the new one is in place: never no export
            out_dir.rename(old)
        temp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        if e.errno not in NO_SPACE_ERRNOS:
            raise
        need = sum(f.stat().st_size for f in files)
        raise DiskFullError(
            f"no room to export {checkpoint} into {out_dir} ({e.strerror}): it needs {need:,} "
            "bytes; free space (or raise the file size limit) and export again"
        ) from None
    _fsync(out_dir.parent)
    return out_dir


def export_final(out_dir: Path, last: Path, *, fresh: bool) -> str:
    """A run's last checkpoint ``last`` exported as ``out_dir/final`` (replacing an earlier
    export of the run), and the line saying so. ``fresh``: this run saved ``last``; one that
    did not (resumed at ``train.max_steps``) keeps a ``final/`` already exported from it, with
    whatever the user changed in it."""
    final, marker = out_dir / FINAL, out_dir / FINAL_FROM
    with contextlib.suppress(OSError):
        if not fresh and final.is_dir() and marker.read_text().strip() == last.name:
            return (f"nothing to train: {last.name} is at train.max_steps; {final} is its "
                    "export, kept as it is")  # fmt: skip
    marker.unlink(missing_ok=True)  # final/ is not last's until the export is complete
    export_checkpoint(last, final, replace=True)
    marker.write_text(f"{last.name}\n")
    return f"exported {final}"


def _check_export_target(out_dir: Path, replace: bool) -> None:
    """``out_dir`` can become the export: a new or empty directory (any, with ``replace``),
    outside every checkpoint and model directory, under a directory."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} exists and is a file: choose a new directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not replace:
        raise CheckpointError(f"{out_dir} exists and is not empty: choose a new directory")
    target = out_dir.resolve()
    for parent in [target, *target.parents]:
        checkpoint = (parent / STATE_FILE).exists() or (parent / MANIFEST).exists()
        model = (parent / "config.json").exists() and any(parent.glob("*.safetensors"))
        if checkpoint or (model and parent != target):  # an earlier export may be replaced
            raise CheckpointError(
                f"{out_dir} is inside the checkpoint or model directory {parent}, which is never "
                "written into: choose a directory outside it"
            )
        if parent.exists() and not parent.is_dir():
            raise CheckpointError(f"{out_dir} cannot be created: {parent} is a file")
