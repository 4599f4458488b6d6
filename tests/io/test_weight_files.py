"""Weights that are there but unusable (another format, an empty index, no permission) are one
clear refusal by ``validate`` and ``train`` alike, never a silent seeded init."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli.util import one_error_line, run, snapshot
from engine.tiny import make_model, write_config, write_data
from slidedp.io.hf_load import weight_files

Capsys = pytest.CaptureFixture[str]
VERBS = ("validate", "train")
NO_DAC = [
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models"), "qwen3", tied=False)


@pytest.fixture
def model_copy(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "model"))


def _refused(capsys: Capsys, verb: str, model: Path, *needles: str) -> str:
    """``slidedp VERB`` on ``model``: exit 2, one error line, nothing written."""
    root = model.parent
    config = write_config(root / "c.yaml", model, write_data(root / "d.jsonl", 8), root / "out")
    before = snapshot(root)
    code, _, err = run(capsys, verb, str(config))
    assert code == 2, err
    assert snapshot(root) == before
    return one_error_line(err, verb, *needles)


def _denied(monkeypatch: pytest.MonkeyPatch, method: str, path: Path) -> None:
    """``Path.METHOD`` on ``path`` fails as without permission (the tests run as root)."""
    original: Callable[..., Any] = getattr(Path, method)

    def guarded(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, method, guarded)


def _shard(model: Path, weight_map: dict[str, str]) -> Path:
    """``model``'s weights in two shards, with an index holding ``weight_map``."""
    weights = load_file(model / "model.safetensors")
    names = sorted(weights)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: weights[n] for n in part}, model / f"model-0000{i + 1}-of-00002.safetensors")
    (model / "model.safetensors").unlink()
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickled_weights_are_refused(
    capsys: Capsys, model_copy: Path, verb: str, name: str
) -> None:
    weights = model_copy / "model.safetensors"
    torch.save(load_file(weights), model_copy / name)
    weights.unlink()
    _refused(
        capsys,
        verb,
        model_copy,
        f"{model_copy} holds {name} but no *.safetensors",
        "reads safetensors only",
        "safe_serialization=True",
    )


def test_safetensors_beside_pickled_weights_are_read(model_copy: Path) -> None:
    torch.save({}, model_copy / "pytorch_model.bin")  # hub repositories often carry both
    assert weight_files(model_copy) == [model_copy / "model.safetensors"]


def test_a_config_alone_is_a_seeded_init(capsys: Capsys, model_copy: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    root = model_copy.parent
    config = write_config(root / "c.yaml", model_copy, write_data(root / "d.jsonl", 8), root / "o")
    code, out, err = run(capsys, "validate", str(config))
    assert code == 0, err
    assert "no weights: seeded init" in out


@pytest.mark.parametrize("verb", VERBS)
def test_an_index_naming_no_weights(capsys: Capsys, model_copy: Path, verb: str) -> None:
    index = _shard(model_copy, {})
    _refused(capsys, verb, model_copy, f"{index} names no weights", "fix it, or delete it")


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("shard", ["/etc/passwd", "../model-00001-of-00002.safetensors"])
def test_an_index_naming_a_file_outside_the_model(
    capsys: Capsys, model_copy: Path, verb: str, shard: str
) -> None:
    """Was read as a corrupt safetensors file (``/etc/passwd``) or as another directory's."""
    shutil.copy(
        model_copy / "model.safetensors", model_copy.parent / "model-00001-of-00002.safetensors"
    )
    index = _shard(model_copy, {"model.embed_tokens.weight": shard})
    _refused(capsys, verb, model_copy, f"{index} names a weight file outside {model_copy}",
             "shard names are relative to the model directory")  # fmt: skip


@pytest.mark.parametrize("verb", VERBS)
def test_an_unlistable_model_directory(
    capsys: Capsys, monkeypatch: pytest.MonkeyPatch, model_copy: Path, verb: str
) -> None:
    _denied(monkeypatch, "iterdir", model_copy)
    _refused(
        capsys,
        verb,
        model_copy,
        f"cannot list the model directory {model_copy}: permission denied",
        "fix its permissions",
    )


@pytest.mark.parametrize("verb", VERBS)
def test_an_unreadable_index(
    capsys: Capsys, monkeypatch: pytest.MonkeyPatch, model_copy: Path, verb: str
) -> None:
    index = _shard(model_copy, {"model.norm.weight": "model-00001-of-00002.safetensors"})
    _denied(monkeypatch, "open", index)
    _refused(
        capsys, verb, model_copy, f"cannot read {index}: permission denied", "fix its permissions"
    )


@pytest.mark.parametrize("verb", VERBS)
def test_an_unreadable_safetensors_file(
    capsys: Capsys, monkeypatch: pytest.MonkeyPatch, model_copy: Path, verb: str
) -> None:
    weights = model_copy / "model.safetensors"
    _denied(monkeypatch, "open", weights)
    line = _refused(
        capsys, verb, model_copy, f"cannot read {weights}: permission denied", "fix its permissions"
    )
    assert "corrupt" not in line


@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root needs setpriv"
)
def test_a_directory_without_read_permission_for_real(model_copy: Path) -> None:
    """chmod 111: config.json can be opened, the directory not listed (where ``glob`` saw no
    weights); as root, run without the capabilities that bypass permissions."""
    root = model_copy.parent
    config = write_config(root / "c.yaml", model_copy, write_data(root / "d.jsonl", 8), root / "o")
    model_copy.chmod(0o111)
    try:
        done = subprocess.run(
            [
                *(NO_DAC if os.geteuid() == 0 else []),
                sys.executable,
                "-m",
                "slidedp",
                "validate",
                str(config),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        model_copy.chmod(0o755)
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, "validate", f"cannot list the model directory {model_copy}")


@pytest.mark.parametrize(
    ("sharded", "verb"),
    [(False, "validate"), (True, "validate"), pytest.param(True, "train", marks=pytest.mark.e2e)],
)
def test_the_hub_cache_layout_of_symlinks_loads(
    capsys: Capsys, monkeypatch: pytest.MonkeyPatch, model_copy: Path, sharded: bool, verb: str
) -> None:
    """The Hugging Face cache keeps ``snapshots/REV/NAME`` as symlinks to ``blobs/HASH``: the
    files resolve outside the snapshot directory, yet are the model's own; ``model.path: .``
    from inside it (a relative model directory) too."""
    if sharded:
        index = _shard(model_copy, {})
        shards = sorted(model_copy.glob("model-0000*"))
        weight_map = {name: shard.name for shard in shards for name in load_file(shard)}
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    blobs, snapshot_dir = model_copy.parent / "blobs", model_copy.parent / "snapshots" / "abc"
    blobs.mkdir()
    snapshot_dir.mkdir(parents=True)
    for i, file in enumerate(sorted(model_copy.iterdir())):
        blob = blobs / f"hash{i}"
        shutil.move(file, blob)
        (snapshot_dir / file.name).symlink_to(os.path.relpath(blob, snapshot_dir))
    root = model_copy.parent
    data = write_data(root / "d.jsonl", 8)
    config = write_config(root / "c.yaml", Path("."), data, root / "o", train={"max_steps": 1})
    monkeypatch.chdir(snapshot_dir)
    code, out, err = run(capsys, verb, str(config))
    assert code == 0, err
    assert "seeded init" not in out
