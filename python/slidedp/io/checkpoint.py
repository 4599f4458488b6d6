"""Training checkpoints: written atomically, found again, loaded straight into the host store.

A checkpoint is ``OUTPUT/checkpoint-STEP/`` (STEP = steps completed)::

    config.json, tokenizer files, model.safetensors        an HF model directory (f32 master
      (or model-0000k-of-0000n.safetensors + index)        weights): from_pretrained loads it
    optimizer/exp_avg*.safetensors, exp_avg_sq*...          Adam moments, same names and shapes
    rng_state.json                                          python, numpy, torch (and CUDA) RNG
    trainer_state.json                                      step, Adam step, skips, schedule...

Atomic: everything is written into the hidden ``OUTPUT/.checkpoint-STEP.tmp``, every file and
directory fsync'd, then the directory is renamed to ``checkpoint-STEP`` (the commit point: a
crash before it leaves no ``checkpoint-*`` behind, the previous checkpoints untouched), then the
``OUTPUT/latest`` pointer (the name, one line) is replaced atomically, then the oldest
checkpoints beyond ``save_total_limit`` are removed. ``resume: auto`` takes the newest complete
checkpoint (the one ``latest`` names, unless a crash hit between the rename and the pointer).
Nothing is ever written into an existing checkpoint. Tensors stream from the store's views to
the files and back (``safe_open`` per tensor), so saving and loading never hold a second copy
of the state in memory. The data position is the step (``batch(t)`` is a pure function of t).

Example::

    path = save_checkpoint(out, adapter, store, Progress(step=20, adam_step=20), meta)
    state = read_state(path); load_tensors(path, adapter, store)   # in the resumed run
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import safe_open

from slidedp.errors import CheckpointError
from slidedp.io.export import DEFAULT_MAX_SHARD_BYTES, copy_tokenizer, write_region
from slidedp.models.hf import HFAdapter
from slidedp.store import HostStore, StateRegion

FORMAT = 1
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.json"
OPTIMIZER_DIR = "optimizer"
LATEST = "latest"
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


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """``out_dir/checkpoint-N`` directories holding a trainer state, oldest first."""
    if not out_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in out_dir.iterdir()
        if (m := _NAME.fullmatch(p.name)) and (p / STATE_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """STEP of a ``checkpoint-STEP`` directory (its trainer state's, whatever its name)."""
    return int(read_state(path)["progress"]["step"])


def resolve_resume(resume: str, out_dir: Path) -> Path | None:
    """The checkpoint ``train.resume`` names (``""``: none, ``auto``: the newest, or a path)."""
    existing = complete_checkpoints(out_dir)
    if resume == "":
        if existing:
            raise CheckpointError(
                f"{out_dir} already holds {existing[-1].name}: set train.resume=auto to continue "
                "from it, or choose another output.dir (a new run never overwrites checkpoints)"
            )
        return None
    if resume == "auto":
        return existing[-1] if existing else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"train.resume={resume} is not a complete slidedp checkpoint (no {STATE_FILE}): "
            "give a checkpoint-STEP directory, auto, or '' to start afresh"
        )
    return path


def read_state(path: Path) -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path / STATE_FILE}: {e}") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {state.get('format')!r}, this slidedp reads {FORMAT}"
        )
    return state


def check_resumable(
    path: Path, state: dict[str, Any], *, max_steps: int, global_batch_size: int
) -> Progress:
    """The progress to continue from, or one clear error when this config cannot continue."""
    progress = Progress(**state["progress"])
    if progress.step > max_steps:
        raise CheckpointError(
            f"{path.name} is at step {progress.step}, beyond train.max_steps={max_steps}: "
            f"raise train.max_steps or resume from an earlier checkpoint"
        )
    saved_batch = state["train"]["global_batch_size"]
    if saved_batch != global_batch_size:
        raise CheckpointError(
            f"{path.name} was trained with train.global_batch_size={saved_batch}, this config "
            f"has {global_batch_size}: the data would not continue where it stopped; set it back"
        )
    return progress


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


def read_rng(path: Path) -> dict[str, Any]:
    try:
        rng: dict[str, Any] = json.loads((path / RNG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path / RNG_FILE}: {e}") from None
    return rng


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
    adapter.config.save_pretrained(tmp)
    copy_tokenizer(adapter.path, tmp)
    (tmp / OPTIMIZER_DIR).mkdir()
    for prefix, where, region in _TENSOR_FILES:
        write_region(adapter, store, region, tmp / where, prefix, max_shard_bytes)
    (tmp / RNG_FILE).write_text(json.dumps(capture_rng()))
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")  # last: marks complete


def save_checkpoint(
    out_dir: Path,
    adapter: HFAdapter,
    store: HostStore,
    progress: Progress,
    meta: dict[str, Any],
    *,
    total_limit: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``out_dir/checkpoint-STEP`` atomically from the (drained) store; point ``latest``
    at it; keep the newest ``total_limit`` checkpoints (0: all). ``meta`` is recorded as is."""
    final = out_dir / f"checkpoint-{progress.step}"
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
    if total_limit:
        for old in complete_checkpoints(out_dir)[:-total_limit]:
            if old != final:
                doomed = old.rename(out_dir / f".{old.name}.deleting")  # never half a checkpoint
                shutil.rmtree(doomed)
    return final


def _tensor_files(path: Path, prefix: str) -> list[Path]:
    index = path / f"{prefix}.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / f"{prefix}.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path} is incomplete: no {prefix}.safetensors nor its index")
    return [single]


def load_tensors(path: Path, adapter: HFAdapter, store: HostStore) -> None:
    """Master weights and Adam moments of checkpoint ``path`` into ``store``, tensor by tensor,
    after checking every name, shape and dtype (an incompatible checkpoint changes nothing)."""
    shapes = adapter.shapes()
    plan: list[tuple[Path, StateRegion]] = []
    for prefix, where, region in _TENSOR_FILES:
        seen: set[str] = set()
        for file in _tensor_files(path / where, prefix):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    info = f.get_slice(name)
                    got = tuple(info.get_shape())
                    if name not in shapes or got != shapes[name] or info.get_dtype() != "F32":
                        here = list(shapes[name]) if name in shapes else "absent"
                        raise CheckpointError(
                            f"{path.name} does not fit this model: '{name}' is "
                            f"{info.get_dtype()}{list(got)} there, {here} here; resume with the "
                            "model it was trained from (model.path) or start afresh"
                        )
                    seen.add(name)
            plan.append((file, region))
        missing = sorted(set(shapes) - seen)
        if missing:
            raise CheckpointError(
                f"{path.name} does not fit this model: {prefix} lacks '{missing[0]}' "
                f"({len(missing)} missing); resume with the model it was trained from"
            )
    for file, region in plan:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                store.param(name, region).copy_(f.get_tensor(name))


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # the files are never modified in place: sharing them is safe
    except OSError:
        shutil.copy2(src, dst)


def export_checkpoint(checkpoint: Path, out_dir: Path, *, replace: bool = False) -> Path:
    """The HF model part of ``checkpoint`` (or of the checkpoint ``checkpoint/latest`` names)
    as ``out_dir``: config, tokenizer, f32 weights (hard links when possible)."""
    if (checkpoint / LATEST).is_file():
        checkpoint = checkpoint / (checkpoint / LATEST).read_text().strip()
    if not (checkpoint / STATE_FILE).is_file():
        raise CheckpointError(
            f"{checkpoint} is not a complete slidedp checkpoint (no {STATE_FILE}): give "
            "OUTPUT/checkpoint-STEP or an output directory with a 'latest' pointer"
        )
    if out_dir.exists() and any(out_dir.iterdir()):
        if not replace:
            raise CheckpointError(f"{out_dir} exists and is not empty: choose a new directory")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in checkpoint.iterdir():
        if src.is_file() and src.name not in (STATE_FILE, RNG_FILE):
            _link_or_copy(src, out_dir / src.name)
    return out_dir
