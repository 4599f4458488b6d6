"""Checkpoint files without the engine: layout, atomicity, rotation, loading, export (CPU)."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine.tiny import make_model
from slidedp.cli import main
from slidedp.config import TrainSection
from slidedp.data.config import DataSection
from slidedp.errors import CheckpointError, DiskFullError
from slidedp.io import checkpoint as ckpt
from slidedp.io import export
from slidedp.io.checkpoint import (
    Progress,
    Retention,
    capture_rng,
    export_checkpoint,
    load_tensors,
    restore_rng,
    save_checkpoint,
)
from slidedp.io.resume import plan_resume
from slidedp.models.hf import HFAdapter
from slidedp.store import GroupSpec, HostStore, ParamSpec, StateRegion

REGIONS: tuple[StateRegion, ...] = ("master", "exp_avg", "exp_avg_sq")


def _filled(model: Path, seed: int) -> tuple[HFAdapter, HostStore]:
    """A store with distinct random values in each state region."""
    adapter = HFAdapter.from_dir(model)
    store = HostStore.create(adapter.group_specs(), staging_slots=2)
    gen = torch.Generator().manual_seed(seed)
    for region in REGIONS:
        for _, name in adapter.iter_params():
            view = store.param(name, region)
            view.copy_(torch.randn(view.shape, generator=gen))
    return adapter, store


def _save(out: Path, adapter: HFAdapter, store: HostStore, step: int, **kw: Any) -> Path:
    meta = {"train": {"global_batch_size": 8}}
    return save_checkpoint(out, adapter, store, Progress(step=step, adam_step=step), meta, **kw)


def resolve_resume(resume: str, out: Path, adapter: HFAdapter) -> Path | None:
    """The checkpoint ``train.resume=RESUME`` continues from (None: a new run)."""
    point = plan_resume(
        TrainSection(max_steps=100, resume=resume), DataSection(path="d.jsonl"), out, adapter
    )
    return None if point is None else point.path


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_checkpoint_is_an_hf_model_plus_optimizer_files_and_loads_back_exactly(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path, "llama", tied=False)
    adapter, store = _filled(model, seed=1)
    # ~40 KB shards: the master weights span several files and an index
    path = _save(tmp_path / "out", adapter, store, 7, max_shard_bytes=40_000)
    assert path.name == "checkpoint-7"
    assert (tmp_path / "out" / "latest").read_text() == "checkpoint-7\n"
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    assert len(list((path / "optimizer").glob("exp_avg_sq-*.safetensors"))) > 1
    hf = AutoModelForCausalLM.from_pretrained(path).state_dict()
    for _, name in adapter.iter_params():
        assert torch.equal(hf[name], store.param(name)), name
    shard = sorted((path / "optimizer").glob("exp_avg-*.safetensors"))[0]
    with safe_open(str(shard), "pt") as f:
        first = next(iter(f.keys()))
        assert torch.equal(f.get_tensor(first), store.param(first, "exp_avg"))
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["progress"] == {
        "step": 7,
        "adam_step": 7,
        "skipped_steps": 0,
        "consecutive_skips": 0,
    }

    _, other = _filled(model, seed=2)
    load_tensors(path, adapter, other)
    for region in REGIONS:
        assert torch.equal(other.region(region), store.region(region)), region


def test_every_file_and_directory_is_fsynced_before_the_rename_and_the_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    out = tmp_path / "out"
    synced: list[Path] = []
    real_fsync = ckpt._fsync

    def recording_fsync(path: Path) -> None:
        synced.append(path)
        real_fsync(path)

    monkeypatch.setattr(ckpt, "_fsync", recording_fsync)
    path = _save(out, adapter, store, 5)
    tmp = out / ".checkpoint-5.tmp"
    written = {tmp / p.relative_to(path) for p in path.rglob("*")} | {tmp}
    assert set(synced[: len(written)]) == written  # the content, before the rename
    assert synced[len(written) :] == [out, out / ".latest.tmp", out]


def test_saving_streams_from_the_store_without_copying_tensors(tmp_path: Path) -> None:
    """A 16 MB parameter is written with (far) less than 16 MB allocated: numpy buffers and
    bytes objects are traced by tracemalloc; a ``.tobytes()`` copy would show up in full."""
    store = HostStore.create([GroupSpec("g", [ParamSpec("w", (1024, 4096))])], staging_slots=1)
    store.param("w").normal_()
    tracemalloc.start()
    try:
        export.write_sharded(tmp_path, "model", [("w", store.param("w"))])
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 1 << 20
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], store.param("w"))


def test_a_crash_while_saving_leaves_the_previous_checkpoint_and_latest_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    out = tmp_path / "out"
    first = _save(out, adapter, store, 2)
    before = _tree(first)
    store.region("master").add_(1.0)
    real_write = export.write_region
    calls: list[str] = []

    def fail_on_the_moments(*args: object, **kwargs: object) -> list[Path]:
        calls.append(str(args[2]))
        if args[2] == "exp_avg":  # the weights are already on disk by now
            raise OSError(28, "No space left on device")
        return real_write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ckpt, "write_region", fail_on_the_moments)
    with pytest.raises(OSError, match="No space left"):
        _save(out, adapter, store, 4)
    assert calls == ["master", "exp_avg"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "latest"]
    assert (out / "latest").read_text() == "checkpoint-2\n"
    assert _tree(first) == before
    assert resolve_resume("auto", out, adapter) == first


def test_a_killed_save_leaves_a_hidden_temp_that_resume_ignores_and_the_next_save_removes(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    out = tmp_path / "out"
    first = _save(out, adapter, store, 2)
    stale = out / ".checkpoint-4.tmp"  # what SIGKILL in the middle of a save leaves
    (stale / "optimizer").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    assert resolve_resume("auto", out, adapter) == first
    _save(out, adapter, store, 6)
    assert not stale.exists()


def test_rotation_keeps_the_newest_and_nothing_is_written_into_an_existing_checkpoint(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    out = tmp_path / "out"
    for step in (10, 20, 30):
        _save(out, adapter, store, step, retention=Retention(total_limit=2))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-20", "checkpoint-30", "latest"]
    assert resolve_resume("auto", out, adapter) == out / "checkpoint-30"
    before = _tree(out / "checkpoint-30")
    store.region("master").zero_()
    with pytest.raises(CheckpointError, match="never written into"):
        _save(out, adapter, store, 30)
    assert _tree(out / "checkpoint-30") == before


def test_resume_settings(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    out = tmp_path / "out"
    assert resolve_resume("", out, adapter) is None
    assert resolve_resume("auto", out, adapter) is None  # nothing to resume: a new run
    path = _save(out, adapter, store, 3)
    assert resolve_resume(str(path), tmp_path / "elsewhere", adapter) == path
    with pytest.raises(CheckpointError, match=r"already holds checkpoint-3: set train.resume=auto"):
        resolve_resume("", out, adapter)
    with pytest.raises(CheckpointError, match="is not a slidedp checkpoint"):
        resolve_resume(str(model), out, adapter)


def test_resume_compares_the_data_order_keys_not_the_paths_and_older_states_by_what_they_hold(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    saved = DataSection(path="a.jsonl", eval_fraction=0.1, shuffle=True)
    train = {"global_batch_size": 8, "seed": 42}
    meta = {"train": train, "data": saved.checkpoint_record(next_step=3)}
    path = save_checkpoint(tmp_path / "new", adapter, store, Progress(3, 3), meta)
    older = {"train": train, "data": {"path": "a.jsonl", "sources": [], "seq_len": 16}}
    old = save_checkpoint(tmp_path / "old", adapter, store, Progress(3, 3), older)

    def resume(point: Path, data: DataSection, **keys: Any) -> Path | None:
        section = TrainSection(max_steps=100, resume=str(point), global_batch_size=8, **keys)
        found = plan_resume(section, data, tmp_path / "elsewhere", adapter)
        return None if found is None else found.path

    moved = DataSection(path="moved/a.jsonl", eval_fraction=0.1, shuffle=True)
    assert resume(path, moved) == path  # a dataset moved resumes
    with pytest.raises(CheckpointError, match=r"data.eval_fraction=0.1, this config has 0.2: "):
        resume(path, DataSection(path="a.jsonl", eval_fraction=0.2, shuffle=True))
    with pytest.raises(
        CheckpointError, match=r'data.sources=\[{"format": "auto", "weight": 1.0}\]'
    ):
        resume(path, DataSection(sources=[{"path": "a.jsonl"}, {"path": "b.jsonl"}]))
    with pytest.raises(CheckpointError, match=r"train.seed=42, this config has 7: the data would"):
        resume(path, moved, seed=7)
    assert resume(old, DataSection(path="b.jsonl", seq_len=32)) == old  # no data.order kept
    with pytest.raises(CheckpointError, match=r"train.seed=42, this config has 7"):
        resume(old, moved, seed=7)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(
    tmp_path: Path,
) -> None:
    small = make_model(tmp_path, "qwen3", tied=True, layers=2)
    adapter, store = _filled(small, seed=1)
    path = _save(tmp_path / "out", adapter, store, 3)
    deeper = make_model(tmp_path, "qwen3", tied=True, layers=3)
    other_adapter, other = _filled(deeper, seed=2)
    before = other.region("master").clone()
    with pytest.raises(CheckpointError, match=r"does not fit this model: model lacks") as info:
        load_tensors(path, other_adapter, other)
    assert "\n" not in str(info.value)
    assert torch.equal(other.region("master"), before)

    wider = tmp_path / "wider"
    config = json.loads((small / "config.json").read_text()) | {"intermediate_size": 96}
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps(config))
    wide_adapter, wide = _filled(wider, seed=3)
    with pytest.raises(
        CheckpointError,
        match=r"fit this model: 'model\.layers\.0\.mlp\.[\w.]+' is F32\[\d+, \d+\] there, "
        r"\[\d+, \d+\] here",
    ):
        load_tensors(path, wide_adapter, wide)


def test_rng_states_round_trip() -> None:
    saved = json.loads(json.dumps(capture_rng()))  # what the file holds
    expected = (random.random(), np.random.rand(), torch.rand(3))  # noqa: NPY002
    restore_rng(saved)
    again = (random.random(), np.random.rand(), torch.rand(3))  # noqa: NPY002
    assert expected[:2] == again[:2]
    assert torch.equal(expected[2], again[2])


def test_export_verb_writes_the_hf_part_and_refuses_a_non_empty_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    out = tmp_path / "out"
    _save(out, adapter, store, 3)
    _save(out, adapter, store, 5)
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0  # OUTPUT: its latest
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(hf.model.norm.weight.detach(), store.param("model.norm.weight"))
    capsys.readouterr()
    assert main(["export", str(out / "checkpoint-3"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "exists and is not empty: choose a new directory" in err
    with pytest.raises(CheckpointError, match="not a complete slidedp checkpoint"):
        export_checkpoint(model, tmp_path / "hf2")
    with pytest.raises(CheckpointError, match=r"nope does not exist: give OUTPUT/checkpoint-STEP"):
        export_checkpoint(tmp_path / "nope", tmp_path / "hf2")


def test_an_export_is_a_copy_the_user_may_change_written_whole_or_not_at_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    path = _save(tmp_path / "out", adapter, store, 3)
    saved = _tree(path)
    export_checkpoint(path, tmp_path / "hf")
    for name in ("config.json", "model.safetensors"):  # edited, or saved over by a user
        (tmp_path / "hf" / name).write_text("changed")
    assert _tree(path) == saved

    copy = shutil.copyfile

    def fill_the_disk(src: Path, dst: Path) -> None:  # the first file, then no room
        copy(src, dst)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", fill_the_disk)
    capsys.readouterr()
    assert main(["export", str(path), str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no room to export" in err
    assert "(No space left on device): it needs " in err
    assert sorted(p.name for p in tmp_path.iterdir() if "full" in p.name) == []  # no temp left
    # a replacement interrupted between setting the earlier export aside and renaming the new
    # one in, then one that fails: the earlier export is back, nothing else left
    (tmp_path / "hf").rename(tmp_path / ".hf.old")
    with pytest.raises(DiskFullError):
        export_checkpoint(path, tmp_path / "hf", replace=True)
    assert (tmp_path / "hf/config.json").read_text() == "changed"
    assert sorted(p.name for p in tmp_path.iterdir() if "hf" in p.name) == ["hf"]
    monkeypatch.setattr(shutil, "copyfile", copy)
    export_checkpoint(path, tmp_path / "hf", replace=True)
    assert (tmp_path / "hf/config.json").read_text() != "changed"
    assert sorted(p.name for p in tmp_path.iterdir() if "hf" in p.name) == ["hf"]


def test_an_export_without_a_manifest_checks_the_weights_headers(tmp_path: Path) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    adapter, store = _filled(model, seed=1)
    path = _save(tmp_path / "out", adapter, store, 3)
    (path / "manifest.json").unlink()  # as a checkpoint written before manifests
    weights = path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 8)
    with pytest.raises(CheckpointError, match=r"model.safetensors has an unreadable .*not fully c"):
        export_checkpoint(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
