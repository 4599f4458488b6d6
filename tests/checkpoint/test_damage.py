"""Damaged and cut-short checkpoints through the CLI: an explicit resume path is refused (exit 2,
one line naming checkpoint, file, damage and the previous checkpoint), ``train.resume=auto``
skips the damaged newest one with one warning line, and a refusal changes no byte of the output
directory. ``validate`` decides exactly as ``train``."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from cli.util import one_error_line, run
from engine.tiny import make_model, read_metrics, write_config, write_data

pytestmark = pytest.mark.e2e  # every test here trains end to end

Capsys = pytest.CaptureFixture[str]
VERBS = ("validate", "train")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoint-2 and checkpoint-4 (copied by each test)."""
    root = tmp_path_factory.mktemp("trained")
    model = make_model(root, "qwen3", tied=True)
    data = write_data(root / "data.jsonl", 16)
    config = write_config(
        root / "c.yaml",
        model,
        data,
        root / "out",
        train={"max_steps": 4},
        output={"save_steps": 2, "export": False},
    )
    from slidedp.cli import main

    assert main(["train", str(config)]) == 0
    return root


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run: its config points at ``tmp_path/out``."""
    shutil.copytree(trained / "out", tmp_path / "out")
    text = (trained / "c.yaml").read_text().replace(str(trained / "out"), str(tmp_path / "out"))
    (tmp_path / "c.yaml").write_text(text)
    return tmp_path


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _cut_short(path: Path) -> str:
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)
    return "model.safetensors has"


def _garbled_header(path: Path) -> str:  # same size: only the checksums tell which file changed
    file = path / "optimizer" / "exp_avg.safetensors"
    with file.open("r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 16)
    return "optimizer/exp_avg.safetensors differs from what was saved (CRC-32"


def _state_without_progress(path: Path) -> str:  # an older checkpoint: no manifest
    (path / "manifest.json").unlink()
    state = json.loads((path / "trainer_state.json").read_text())
    del state["progress"]
    (path / "trainer_state.json").write_text(json.dumps(state))
    return "trainer_state.json lacks 'progress.step'"


def _state_data_not_an_object(path: Path) -> str:  # an older checkpoint: no manifest
    (path / "manifest.json").unlink()
    state = json.loads((path / "trainer_state.json").read_text())
    state["data"] = None
    (path / "trainer_state.json").write_text(json.dumps(state))
    return "trainer_state.json's 'data' is not a JSON object"


def _rng_missing(path: Path) -> str:
    (path / "rng_state.json").unlink()
    return "rng_state.json is missing"


DAMAGE: dict[str, Callable[[Path], str]] = {
    "cut-short": _cut_short,
    "garbled-header": _garbled_header,
    "state-lacks-fields": _state_without_progress,
    "state-data-garbled": _state_data_not_an_object,
    "rng-missing": _rng_missing,
}


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_named_by_path_is_refused_and_nothing_changes(
    capsys: Capsys, run_dir: Path, damage: str, verb: str
) -> None:
    out = run_dir / "out"
    newest = out / "checkpoint-4"
    needle = DAMAGE[damage](newest)
    before = _tree(run_dir)
    code, _, err = run(
        capsys, verb, str(run_dir / "c.yaml"), f"train.resume={newest}", "train.max_steps=6"
    )
    assert code == 2, err
    one_error_line(
        err, verb, f"checkpoint {newest} is damaged: {needle}", f"train.resume={out}/checkpoint-2"
    )
    assert _tree(run_dir) == before


def test_damaged_data_bytes_are_found_by_the_checksums_when_asked(
    capsys: Capsys, run_dir: Path
) -> None:
    newest = run_dir / "out" / "checkpoint-4"
    file = newest / "optimizer" / "exp_avg_sq.safetensors"
    with file.open("r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\xc0\x7f")  # a NaN where a moment was: the header still reads
    args = ("validate", str(run_dir / "c.yaml"), "train.resume=auto")
    assert run(capsys, *args)[0] == 0  # sizes and headers only
    code, _, err = run(capsys, *args, "train.verify_checksums=true")
    assert code == 0
    one_error_line(err.replace(": warning: ", ": error: "), "validate", "damaged checkpoint-4 (")
    assert "optimizer/exp_avg_sq.safetensors differs from what was saved" in err


@pytest.mark.parametrize("missing", ["trainer_state.json", "optimizer/exp_avg_sq.safetensors"])
def test_auto_skips_a_cut_short_newest_checkpoint_with_one_warning_and_continues_exactly(
    capsys: Capsys, run_dir: Path, missing: str
) -> None:
    out = run_dir / "out"
    intact = _tree(out / "checkpoint-4")
    (out / "checkpoint-4" / missing).unlink()  # a copy interrupted
    damaged = _tree(out / "checkpoint-4")
    config = str(run_dir / "c.yaml")
    before = _tree(run_dir)
    for verb in VERBS:
        code, _, err = run(capsys, verb, config, "train.resume=auto")
        assert code == 0, err
        line = one_error_line(err.replace(": warning: ", ": error: "), verb)
        assert f"damaged checkpoint-4 ({missing} is missing): skipped, resuming from" in line
        assert f"{out}/checkpoint-2" in line
        if verb == "validate":
            assert _tree(run_dir) == before
    # steps 3 and 4 again, bit-identical: the same checkpoint-4; the damaged one set aside
    assert _tree(out / "checkpoint-4") == intact
    assert _tree(out / "checkpoint-4.damaged") == damaged
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]


def test_auto_refuses_when_every_checkpoint_is_damaged(capsys: Capsys, run_dir: Path) -> None:
    out = run_dir / "out"
    for step in (2, 4):
        (out / f"checkpoint-{step}" / "rng_state.json").unlink()
    before = _tree(run_dir)
    for verb in VERBS:
        code, _, err = run(capsys, verb, str(run_dir / "c.yaml"), "train.resume=auto")
        assert code == 2
        one_error_line(err, verb, "every checkpoint in", "checkpoint-4: rng_state.json is missing")
    assert _tree(run_dir) == before


def test_a_checkpoint_without_a_manifest_still_resumes_silently(
    capsys: Capsys, run_dir: Path
) -> None:
    out = run_dir / "out"
    (out / "checkpoint-2" / "manifest.json").unlink()  # as written before manifests existed
    shutil.rmtree(out / "checkpoint-4")
    code, _, err = run(capsys, "train", str(run_dir / "c.yaml"), "train.resume=auto")
    assert (code, err) == (0, "")
    assert json.loads((out / "checkpoint-4" / "manifest.json").read_text())["files"]


def test_auto_skips_a_checkpoint_without_a_manifest_whose_tensors_do_not_fit(
    capsys: Capsys, run_dir: Path
) -> None:
    # with a manifest such a checkpoint is intact and of another model (refused as that);
    # without one, a renamed tensor may be a garbled header: damage, the older one resumed
    out = run_dir / "out"
    newest = out / "checkpoint-4"
    (newest / "manifest.json").unlink()
    file = newest / "model.safetensors"
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name + "_garbled"] = tensors.pop(name)
    save_file(tensors, file)
    code, _, err = run(capsys, "validate", str(run_dir / "c.yaml"), "train.resume=auto")
    assert code == 0, err
    one_error_line(err.replace(": warning: ", ": error: "), "validate",
                   "damaged checkpoint-4 (", f"{out}/checkpoint-2")  # fmt: skip


def test_the_manifest_lists_every_file_with_its_size(run_dir: Path) -> None:
    path = run_dir / "out" / "checkpoint-4"
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {"manifest.json"}
    assert all(files[name]["bytes"] == (path / name).stat().st_size for name in files)
