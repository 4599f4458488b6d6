"""Trackers (``output.report_to``): TensorBoard and W&B (offline) get the config, the plan and
every step record of ``metrics.jsonl``."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from cli.util import run
from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp import config
from slidedp.config import OutputSection
from slidedp.errors import ConfigError
from slidedp.runtime.trackers import TensorBoardTracker, Trackers, WandbTracker, check_trackers


def _train_with_wandb_offline(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, str]:
    """Three steps of the tiny model with W&B recording locally: OUTPUT and what it printed."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # local files only
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out,
                          output={"report_to": ["wandb"]})  # fmt: skip
    code, printed, err = run(capsys, "train", str(config), "train.max_steps=3")
    assert code == 0, err
    return out, printed


@pytest.mark.e2e
def test_wandb_offline_gets_the_config_the_plan_and_every_record(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = _train_with_wandb_offline(capsys, tmp_path, monkeypatch)
    records = read_metrics(out)
    assert len(records) == 3
    # W&B: one offline run; its record log holds every step's numbers, the config and the plan
    (log,) = out.glob("wandb/offline-run-*/run-*.wandb")
    raw = log.read_bytes()
    for record in records:
        for key in ("loss", "grad_norm", "tokens_per_s", "step_time_s"):
            value = record[key]  # W&B writes an integral float as an integer
            text = str(int(value)) if float(value).is_integer() else json.dumps(value)
            assert text.encode() in raw, (key, value)
    assert b"global_batch_size" in raw  # the resolved config
    assert b"param_route" in raw  # the plan's policy


def test_wandb_that_cannot_start_is_one_config_error_and_leaves_no_run_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")

    def refuse(**keys: str) -> None:  # as wandb.init with a key but no server, after its files
        (Path(keys["dir"]) / "wandb" / "run-1").mkdir(parents=True)
        raise wandb.errors.CommError("Timed out while retrying")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError) as refused:
        WandbTracker(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert "W&B did not start (CommError: Timed out while retrying): check the network" in message
    assert "WANDB_MODE=offline records locally only" in message
    assert not (tmp_path / "wandb").exists()  # nothing of the refused run left


@pytest.mark.e2e
def test_wandb_without_a_key_is_refused_alike_by_validate_and_train_before_anything_is_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logged_in: list[bool] = [False]
    monkeypatch.setattr(wandb, "login", lambda **_: logged_in[0])  # no key found (prompt=False)
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    out.mkdir()
    config = write_config(tmp_path / "c.yaml", model, data, out,
                          output={"report_to": ["wandb"]})  # fmt: skip
    for verb in ("validate", "train"):
        code, _, err = run(capsys, verb, str(config), "train.max_steps=2")
        assert code == 2, err
        assert err.count("\n") == 1, err
        assert "output.report_to has wandb but W&B has no API key: run `wandb login`" in err
        assert list(out.iterdir()) == []  # no lock, no resolved config
    logged_in[0] = True
    assert run(capsys, "validate", str(config))[0] == 0
    monkeypatch.setenv("WANDB_MODE", "offline")  # records locally: no key needed
    logged_in[0] = False
    assert run(capsys, "validate", str(config))[0] == 0


class _SummaryWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.texts: dict[str, str] = {}

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.scalars.append((tag, scalar_value, global_step))

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None:
        self.texts[tag] = text_string

    def close(self) -> None:
        pass


def test_tensorboard_gets_the_config_the_plan_and_every_number_of_a_record() -> None:
    writer = _SummaryWriter()
    tracker = TensorBoardTracker(writer)
    tracker.log_run({"train": {"max_steps": 3}}, {"policy": {"param_route": "replicated"}})
    tracker.log_step({"step": 2, "loss": 1.5, "label_tokens": 7, "skipped": False, "x": None})
    tracker.log_step({"step": 4, "eval_loss": 1.25, "eval_perplexity": 3.49})
    assert "    train:\n      max_steps: 3" in writer.texts["config"]
    assert '"param_route": "replicated"' in writer.texts["plan"]
    assert writer.scalars == [("train/loss", 1.5, 2), ("train/label_tokens", 7, 2),
                              ("eval/loss", 1.25, 4), ("eval/perplexity", 3.49, 4)]  # fmt: skip


def test_a_tracker_that_is_not_installed_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert OutputSection(dir="o", tensorboard=False, report_to=["wandb"]).trackers() == ["wandb"]
    both = OutputSection(dir="o", tensorboard=False, report_to=["wandb", "wandb"])
    assert both.trackers() == ["wandb"]
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else found(name))  # fmt: skip
    with pytest.raises(ConfigError, match=r"report_to has wandb but it is not installed: pip"):
        OutputSection(dir="o", report_to=["wandb"])


class _Failing:
    """A tracker whose ``log_step`` fails at ``step`` (a full disk, W&B's server gone)."""

    name = "wandb"

    def __init__(self, step: int, close_fails: bool = False) -> None:
        self.step, self.close_fails = step, close_fails
        self.steps: list[int] = []
        self.closed = 0

    def log_step(self, record: dict[str, Any]) -> None:
        if record["step"] == self.step:
            raise OSError(28, "No space left on device")
        self.steps.append(record["step"])

    def close(self) -> None:
        self.closed += 1
        if self.close_fails:
            raise RuntimeError("upload failed")


def test_a_tracker_that_fails_is_told_once_and_the_others_go_on() -> None:
    said: list[str] = []
    failing, other = _Failing(step=2), _Failing(step=99, close_fails=True)
    trackers = Trackers([failing, other], say=said.append)  # type: ignore[list-item]
    for step in (1, 2, 3):
        trackers.log_step({"step": step, "loss": 1.0})
    trackers.close()
    assert (failing.steps, failing.closed) == ([1], 1)  # closed once, when it failed
    assert (other.steps, other.closed) == ([1, 2, 3], 1)
    assert said == [
        "warning: wandb failed at step 2 (OSError: [Errno 28] No space left on device) and "
        "records nothing more of this run; metrics.jsonl has every step",
        "warning: wandb failed closing (RuntimeError: upload failed) and records nothing more "
        "of this run; metrics.jsonl has every step",
    ]


@pytest.mark.e2e
def test_a_tracker_failing_mid_run_costs_no_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logged = WandbTracker.log_step

    def log_step(self: WandbTracker, record: dict[str, Any]) -> None:
        if record["step"] == 2:
            raise OSError(28, "No space left on device")
        logged(self, record)

    monkeypatch.setattr(WandbTracker, "log_step", log_step)
    out, printed = _train_with_wandb_offline(capsys, tmp_path, monkeypatch)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert sorted(p.name for p in out.glob("*-3")) == ["checkpoint-3"]
    assert (out / "final" / "config.json").is_file()
    assert printed.count("warning: wandb failed at step 2 (OSError: [Errno 28]") == 1


def test_wandb_refused_leaves_an_earlier_runs_wandb_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    runs = tmp_path / "wandb"
    (runs / "run-1" / "logs").mkdir(parents=True)
    (runs / "run-1" / "logs" / "debug.log").write_text("the earlier run's\n")
    (runs / "latest-run").symlink_to("run-1")
    (runs / "debug.log").symlink_to("run-1/logs/debug.log")
    (runs / "settings").write_text("kept\n")

    def tree() -> dict[str, str]:
        return {
            str(p.relative_to(runs)): os.readlink(p) if p.is_symlink() else
            (p.read_text() if p.is_file() else "/")
            for p in sorted(runs.rglob("*"))
        }  # fmt: skip

    before = tree()

    def refuse(**keys: str) -> None:  # as wandb.init does before its server refuses
        new = Path(keys["dir"]) / "wandb"
        (new / "run-2" / "logs").mkdir(parents=True)
        for link, target in (("latest-run", "run-2"), ("debug.log", "run-2/logs/debug.log")):
            (new / link).unlink()
            (new / link).symlink_to(target)
        (new / "settings").write_text("rewritten\n")
        raise wandb.errors.CommError("Timed out while retrying")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError, match="W&B did not start"):
        WandbTracker(tmp_path)
    assert tree() == before


@pytest.mark.parametrize("mode", ["bogus", "", "Offline"])
def test_a_wandb_mode_wandb_does_not_know_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", mode)
    with pytest.raises(
        ConfigError,
        match=rf"^output.report_to has wandb but WANDB_MODE='{mode}' is not a W&B mode: set it "
        "to online, offline or disabled, or unset it$",
    ):
        check_trackers(["wandb"])
    check_trackers(["tensorboard"])  # W&B's variables matter only to W&B


@pytest.mark.parametrize(("start_step", "purge_step"), [(0, None), (3, 4)])
def test_a_resumed_runs_tensorboard_purges_the_steps_after_its_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, start_step: int, purge_step: int | None
) -> None:
    """An earlier run's events of steps after the checkpoint go, as its metrics.jsonl lines do
    (the review: TensorBoard showed steps 1-6, then 4-6 again)."""
    opened: dict[str, Any] = {}
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = lambda **keys: opened.update(keys) or _SummaryWriter()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    TensorBoardTracker.open(tmp_path, start_step)
    assert opened == {"log_dir": str(tmp_path / "tensorboard"), "purge_step": purge_step}


def test_tensorboard_off_and_in_report_to_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(config, "_tensorboard_installed", lambda: True)
    with pytest.raises(ConfigError, match=r"output\.tensorboard=false but output\.report_to "
                       "has tensorboard: take one out"):  # fmt: skip
        OutputSection(dir="o", tensorboard=False, report_to=["tensorboard"])
