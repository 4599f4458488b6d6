"""What a resume says about keys changed since its checkpoint, and what a run does with an
earlier run's export (``final/``): never replaced without a checkpoint of that run, kept as the
user left it when a finished run is started again."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from cli.util import one_error_line, run, snapshot
from engine.tiny import make_model, write_config, write_data
from slidedp.cli import main
from slidedp.io.checkpoint import FINAL_FROM
from slidedp.io.run_lock import LOCK_FILE

Capsys = pytest.CaptureFixture[str]


def _warnings(err: str, verb: str) -> list[str]:
    assert "Traceback" not in err
    prefix = f"slidedp {verb}: warning: "
    return [line.removeprefix(prefix) for line in err.splitlines() if line.startswith(prefix)]


@pytest.fixture
def finished(tmp_path: Path) -> tuple[Path, Path]:
    """(config, output dir) of a 4-step cosine run with warm-up that has finished."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 16)
    train = {"max_steps": 4, "lr_scheduler": "cosine", "warmup_steps": 1}
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, train=train,
                          output={"dir": str(out), "save_steps": 2})  # fmt: skip
    assert main(["train", str(config)]) == 0
    return config, out


@pytest.mark.e2e
@pytest.mark.parametrize("verb", ["validate", "train"])
def test_a_resume_names_the_optimizer_keys_changed_and_the_learning_rate_it_continues_at(
    capsys: Capsys, finished: tuple[Path, Path], verb: str
) -> None:
    config, _ = finished
    code, _, err = run(capsys, verb, str(config), "train.resume=auto", "train.max_steps=6",
                       "train.weight_decay=0.1")  # fmt: skip
    assert code == 0, err
    [line] = _warnings(err, verb)
    assert line.startswith(
        "resuming checkpoint-4 with train.max_steps 4 -> 6, train.weight_decay 0.0 -> 0.1: "
        "step 5 trains at learning rate "
    ), line
    # the cosine schedule ended at 0 at step 4 of 4; over 6 steps step 5 is past its middle
    found = re.search(r"learning rate (\S+) where the checkpoint's schedule gives (\S+)$", line)
    assert found is not None, line
    now, then = float(found[1]), float(found[2])
    assert then == 0.0
    assert 0 < now < 1e-3


@pytest.mark.e2e
def test_a_resume_keeping_the_schedule_or_moving_the_data_says_what_it_should(
    capsys: Capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A constant schedule ignores max_steps: no line. The same file by another path: none.
    A data file moved: one line saying the run continues on it (its order depends on the
    data keys alone). Fields a checkpoint lacks or holds oddly are not compared."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 16)
    train = {"max_steps": 2, "lr_scheduler": "constant"}
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out", train=train)
    assert run(capsys, "train", str(config))[0] == 0
    code, _, err = run(capsys, "validate", str(config), "train.resume=auto", "train.max_steps=3")
    assert code == 0
    assert _warnings(err, "validate") == []
    monkeypatch.chdir(tmp_path)
    code, _, err = run(
        capsys, "validate", str(config), "train.resume=auto", "data.path=./data.jsonl"
    )
    assert code == 0
    assert _warnings(err, "validate") == []
    state_file = tmp_path / "out/checkpoint-2/trainer_state.json"
    state = json.loads(state_file.read_text())
    (tmp_path / "out/checkpoint-2/manifest.json").unlink()  # (it would call the edit damage)
    for odd in ({"plan": None}, {"plan": {"optim": {"betas": [0.9]}}}, {"lr_schedule": None}):
        state_file.write_text(json.dumps(state | odd))
        code, _, err = run(capsys, "validate", str(config), "train.resume=auto",
                           "train.learning_rate=0.5")  # fmt: skip
        assert code == 0, err
        assert len(_warnings(err, "validate")) == ("lr_schedule" not in odd), err
    moved = shutil.copy(data, tmp_path / "moved.jsonl")
    code, _, err = run(capsys, "validate", str(config), "train.resume=auto", f"data.path={moved}")
    assert code == 0, err
    assert _warnings(err, "validate") == [
        f"resuming checkpoint-2, trained on {data}, on {moved}: it continues at step 2 of this "
        "data's order (right for a file moved; another file's samples differ)"
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("verb", ["validate", "train"])
def test_an_earlier_run_s_export_without_its_checkpoints_is_never_replaced(
    capsys: Capsys, finished: tuple[Path, Path], verb: str
) -> None:
    """Checkpoints deleted to save space, ``final/`` kept: a new run there (or ``auto``, which
    finds nothing to continue) would overwrite the trained model; refused, nothing changed."""
    config, out = finished
    for checkpoint in out.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    (out / "latest").unlink()
    before = snapshot(out, itself=True)
    for resume in ("", "auto"):
        code, _, err = run(capsys, verb, str(config), f"train.resume={resume}")
        assert code == 2
        one_error_line(err, verb, f"{out} holds final/ of an earlier run and no checkpoint",
                       "choose another output.dir")  # fmt: skip
        assert snapshot(out, itself=True) == before
    code, _, err = run(capsys, verb, str(config), "output.export=false")  # final/ untouched
    assert code == 0, err


@pytest.mark.e2e
def test_a_finished_run_started_again_keeps_its_export_as_the_user_left_it(
    capsys: Capsys, finished: tuple[Path, Path]
) -> None:
    config, out = finished
    (out / "final/NOTES.md").write_text("mine")
    code, stdout, err = run(capsys, "train", str(config), "train.resume=auto")
    assert code == 0, err
    assert f"nothing to train: checkpoint-4 is at train.max_steps; {out / 'final'} is its " \
        "export, kept as it is" in stdout  # fmt: skip
    assert (out / "final/NOTES.md").read_text() == "mine"
    # an export that did not complete is redone: final/ is not checkpoint-4's
    (out / FINAL_FROM).unlink()
    code, stdout, err = run(capsys, "train", str(config), "train.resume=auto")
    assert code == 0, err
    assert f"exported {out / 'final'}" in stdout
    assert not (out / "final/NOTES.md").exists()
    assert (out / FINAL_FROM).read_text() == "checkpoint-4\n"
    # a checkpoint-4 saved anew (from another run's, by path) is exported, though no step ran
    shutil.rmtree(out / "checkpoint-4")
    other = out.parent / "other"
    assert (
        run(capsys, "train", str(config), f"output.dir={other}", "train.learning_rate=0.5")[0] == 0
    )
    code, stdout, err = run(capsys, "train", str(config), f"train.resume={other / 'checkpoint-4'}")
    assert code == 0, err
    assert f"exported {out / 'final'}" in stdout
    exported = (out / "final/model.safetensors").read_bytes()
    assert exported == (other / "final/model.safetensors").read_bytes()
    # an export by hand into final/ voids the run's record of it: the next run exports again
    assert main(["export", str(out / "checkpoint-2"), str(out / "final")]) == 2  # not empty
    shutil.rmtree(out / "final")
    assert main(["export", str(out / "checkpoint-2"), str(out / "final")]) == 0
    assert not (out / FINAL_FROM).exists()


@pytest.mark.e2e
@pytest.mark.parametrize("verb", ["validate", "train"])
def test_a_final_that_is_a_link_or_a_file_is_refused_before_training(
    capsys: Capsys, tmp_path: Path, verb: str
) -> None:
    """Found before the first step (was: trained, saved, then 'unexpected OSError: Cannot
    call rmtree on a symbolic link')."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 16)
    out = tmp_path / "out"
    out.mkdir()
    config = write_config(tmp_path / "c.yaml", model, data, out, train={"max_steps": 1})
    (tmp_path / "elsewhere").mkdir()
    (out / "final").symlink_to(tmp_path / "elsewhere")
    code, _, err = run(capsys, verb, str(config))
    assert code == 2
    one_error_line(err, verb, f"{out / 'final'} is a symbolic link", "output.export=false")
    (out / "final").unlink()
    (out / "final").write_text("x")
    code, _, err = run(capsys, verb, str(config))
    assert code == 2
    one_error_line(err, verb, f"{out / 'final'} is not a directory")
    assert sorted(p.name for p in out.iterdir()) == ["final"]


@pytest.mark.e2e
def test_validate_refuses_a_directory_another_run_holds_as_train_does(
    capsys: Capsys, finished: tuple[Path, Path]
) -> None:
    config, out = finished
    holder = os.open(out / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.pwrite(holder, b"4242 somehost\n", 0)
        for verb in ("validate", "train"):
            code, _, err = run(capsys, verb, str(config), "train.resume=auto")
            assert code == 2
            one_error_line(err, verb, "is in use by run pid 4242 on host somehost")
    finally:
        os.close(holder)
    assert run(capsys, "validate", str(config), "train.resume=auto")[0] == 0


@pytest.mark.e2e
def test_an_export_says_the_dtype_of_its_weights(tmp_path: Path) -> None:
    """A source model's config says bfloat16 (every hub model's does); the export holds F32
    master weights, and says so: transformers then loads them as they are, not rounded."""
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    config_file = model / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"dtype": "bfloat16"}))
    data = write_data(tmp_path / "data.jsonl", 16)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, train={"max_steps": 1})
    assert main(["train", str(config)]) == 0
    assert str(AutoConfig.from_pretrained(out / "final").dtype) == "torch.float32"
    loaded = AutoModelForCausalLM.from_pretrained(out / "final")
    with safe_open(out / "final/model.safetensors", "pt") as weights:
        name = "model.layers.0.mlp.up_proj.weight"
        assert loaded.state_dict()[name].dtype == weights.get_tensor(name).dtype
        assert loaded.state_dict()[name].equal(weights.get_tensor(name))


@pytest.mark.e2e
def test_a_resume_given_an_output_directory_takes_the_checkpoint_its_latest_names(
    capsys: Capsys, finished: tuple[Path, Path], tmp_path: Path
) -> None:
    """As ``slidedp export OUTPUT`` does (was: 'is not a slidedp checkpoint')."""
    config, out = finished
    code, stdout, err = run(capsys, "validate", str(config), f"train.resume={out}",
                            f"output.dir={tmp_path / 'more'}", "train.max_steps=4")  # fmt: skip
    assert code == 0, err
    assert f"resume   from {out / 'checkpoint-4'} (step 4)" in stdout
