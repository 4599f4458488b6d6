"""Resume through the trainer: bit-identical continuation, SIGTERM, refusals, non-finite skips."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.cli import main
from slidedp.config import load_config
from slidedp.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteError,
    TrainingInterruptedError,
)
from slidedp.io.resume import kept_records
from slidedp.runtime.trainer import Trainer
from slidedp.store import StateRegion

REGIONS: tuple[StateRegion, ...] = ("master", "exp_avg", "exp_avg_sq")


def _trainer(config: Path, *overrides: str) -> Trainer:
    return Trainer(load_config(config, list(overrides)), log=False)


def _assert_same_state(a: Trainer, b: Trainer) -> None:
    a.engine.drain()
    b.engine.drain()
    for region in REGIONS:  # bitwise: NaN equals NaN here
        bits_a, bits_b = (t.store.region(region).view(torch.int32) for t in (a, b))
        assert torch.equal(bits_a, bits_b), region


@pytest.mark.e2e
@pytest.mark.parametrize(
    "train",
    [
        {"lr_scheduler": "linear", "max_grad_norm": 0.0},  # updates overlap the backward
        {"lr_scheduler": "cosine", "warmup_steps": 2, "max_grad_norm": 0.05},  # clipping bites
    ],
    ids=["linear-overlap", "cosine-warmup-clipped"],
)
def test_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(
    tmp_path: Path, train: dict[str, Any]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 16)
    train = {"max_steps": 4, **train}
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "full", train=train)
    full = _trainer(config, "output.save_steps=2")
    full_records = full.run()
    assert any(r["clip_coef"] < 1 for r in full_records) == (train["max_grad_norm"] > 0)
    assert [p.name for p in sorted((tmp_path / "full").glob("checkpoint-*"))] == [
        "checkpoint-2",
        "checkpoint-4",
    ]

    resumed = _trainer(
        config,
        f"output.dir={tmp_path / 'resumed'}",
        f"train.resume={tmp_path / 'full/checkpoint-2'}",
    )
    assert resumed.progress.step == 2
    records = resumed.run()
    assert [r["step"] for r in records] == [3, 4]
    for key in ("loss", "grad_norm", "clip_coef", "lr"):
        assert [r[key] for r in records] == [r[key] for r in full_records[2:]], key
    _assert_same_state(full, resumed)
    state = json.loads((tmp_path / "resumed/checkpoint-4/trainer_state.json").read_text())
    assert state["progress"]["adam_step"] == 4
    assert state["world_size"] == 1


@pytest.mark.e2e
def test_a_signal_mid_run_saves_after_the_step_and_auto_resume_continues_exactly(
    tmp_path: Path,
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 16)
    out = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", model, data, out, train={"max_steps": 4})
    trainer = _trainer(config)
    real_lr_at = trainer.lr_at
    sent: list[int] = []

    def lr_at_sending_sigterm(t: int) -> float:
        if t == 1 and not sent:  # during step 2 (1-based), as a scheduler's SIGTERM would
            sent.append(t)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_lr_at(t)

    trainer.lr_at = lr_at_sending_sigterm
    with pytest.raises(TrainingInterruptedError, match=r"stopped by SIGTERM after step 2: saved"):
        trainer.run()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers given back
    assert (out / "latest").read_text() == "checkpoint-2\n"
    assert not (out / "final").exists()
    assert [m["step"] for m in read_metrics(out)] == [1, 2]

    resumed = _trainer(config, "train.resume=auto")
    assert resumed.progress.step == 2
    resumed.run()
    straight = _trainer(config, f"output.dir={tmp_path / 'straight'}")
    straight.run()
    _assert_same_state(straight, resumed)
    losses = [(m["step"], m["loss"]) for m in read_metrics(out)]  # the file continued
    assert losses == [(m["step"], m["loss"]) for m in read_metrics(tmp_path / "straight")]


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_to_a_cli_run_saves_a_checkpoint_and_auto_resume_continues_exactly(
    tmp_path: Path,
) -> None:
    """The real thing, in a subprocess (slow: ~10 s of imports): exit code, one stderr line."""
    model = make_model(tmp_path, "llama", tied=False)
    data = write_data(tmp_path / "data.jsonl", 16)
    out = tmp_path / "run"
    train = {"lr_scheduler": "constant", "max_steps": 10_000}  # constant: max_steps is free
    config = write_config(tmp_path / "c.yaml", model, data, out, train=train)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slidedp", "train", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None, "the run ended before the signal"
        assert time.monotonic() < deadline, "no step within 2 minutes"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "stopped by SIGTERM after step" in err
    assert err.count("\n") == 1
    stopped = int((out / "latest").read_text().strip().removeprefix("checkpoint-"))
    assert 1 <= stopped < 10_000

    total = f"train.max_steps={stopped + 2}"
    resumed = _trainer(config, "train.resume=auto", total)
    assert resumed.progress.step == stopped
    resumed.run()
    straight = _trainer(config, f"output.dir={tmp_path / 'straight'}", total)
    straight.run()
    _assert_same_state(straight, resumed)
    losses = [m["loss"] for m in read_metrics(out)]
    assert losses == [m["loss"] for m in read_metrics(tmp_path / "straight")]


@pytest.mark.e2e
def test_resume_refusals_are_one_clear_line_the_same_for_validate_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=2)
    data = write_data(tmp_path / "data.jsonl", 16)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out, train={"max_steps": 2})
    assert main(["train", str(config)]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    deeper = make_model(tmp_path, "qwen3", tied=True, layers=3)
    cases = [
        ([], "already holds checkpoint-2: set train.resume=auto"),
        (["train.resume=auto", "train.max_steps=1"], "beyond train.max_steps=1"),
        (["train.resume=auto", "train.global_batch_size=2"], "global_batch_size=4"),
        # the held-out split and the order would change: held-out samples trained on
        (["train.resume=auto", "train.seed=7"], "train.seed=42, this config has 7"),
        (["train.resume=auto", "data.shuffle=true"], "data.shuffle=false"),
        (
            [f"model.path={deeper}", f"train.resume={out / 'checkpoint-2'}"],
            "checkpoint-2 does not fit this model",
        ),
    ]
    for (overrides, message), verb in itertools.product(cases, ("validate", "train")):
        capsys.readouterr()
        target = out if overrides[:1] != [f"model.path={deeper}"] else tmp_path / "other"
        assert main([verb, str(config), f"output.dir={target}", *overrides]) == 2, verb
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert message in err
        assert "damaged" not in err, err  # intact: refused for what it is, not as damage
        assert err.startswith(f"slidedp {verb}: error: ")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert main(["train", str(config), "train.resume=auto"]) == 0  # done already: re-exports
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after.pop(out / "resolved_config.yaml") != before.pop(out / "resolved_config.yaml")
    assert after == before  # checkpoint, metrics and final/ as they were


def test_a_torn_last_metrics_line_goes_with_the_later_steps_and_a_garbled_one_is_named(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": step, "loss": 1.0}) for step in (1, 2, 3)]
    path.write_text("\n".join(records) + "\n" + '{"step": 4, "lo')  # died writing step 4
    assert kept_records(path, 2) == records[:2]
    path.write_text("\n".join(records))  # a whole record that lacks only its newline is kept
    assert kept_records(path, 3) == records
    for garbled in (b"{garbled", b'{"step": "2"}', b'{"step": null}', b"\xff\xfe"):
        path.write_bytes(b"\n".join([records[0].encode(), garbled, records[2].encode()]) + b"\n")
        with pytest.raises(CheckpointError, match=r"metrics.jsonl:2 is not a step record; mend"):
            kept_records(path, 2)


def _data_with_poison(path: Path, poisoned_steps: set[int], steps: int, batch: int) -> Path:
    """Token 255 (whose embedding row is NaN) only in the batches of ``poisoned_steps``."""
    gen = torch.Generator().manual_seed(3)
    with path.open("w") as f:
        for line in range(steps * batch):
            ids = torch.randint(0, 200, (12,), generator=gen).tolist()
            if line // batch in poisoned_steps and line % batch == 0:
                ids[5] = 255
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def _poisoned_model(tmp_path: Path) -> Path:
    model = make_model(tmp_path, "llama", tied=False)  # untied: the NaN row stays in its tokens
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"][255] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.e2e
def test_skip_leaves_the_state_untouched_counts_the_step_and_limits_the_streak(
    tmp_path: Path,
) -> None:
    model = _poisoned_model(tmp_path)
    data = _data_with_poison(tmp_path / "data.jsonl", {1, 3, 4}, steps=5, batch=4)
    train = {"lr_scheduler": "constant", "on_nonfinite": "skip", "max_steps": 2}
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "two", train=train)
    two = _trainer(config)
    records = two.run()
    assert records[1]["skipped"] is True
    assert records[1]["nonfinite"] == "loss"
    assert "loss" not in records[1]
    one = _trainer(config, "train.max_steps=1", f"output.dir={tmp_path / 'one'}")
    one.run()
    _assert_same_state(one, two)  # the skipped step applied nothing
    assert all(two.store.version(g) == 2 for g in range(two.store.num_groups))
    state = json.loads((tmp_path / "two/checkpoint-2/trainer_state.json").read_text())
    assert state["progress"] == {
        "step": 2,
        "adam_step": 1,
        "skipped_steps": 1,
        "consecutive_skips": 1,
    }

    streak = _trainer(
        config,
        "train.max_steps=5",
        "train.max_consecutive_skips=1",
        f"output.dir={tmp_path / 'streak'}",
    )
    with pytest.raises(NonFiniteError, match=r"2 non-finite steps in a row") as info:
        streak.run()
    assert info.value.step == 4

    stop = _trainer(config, "train.on_nonfinite=stop", f"output.dir={tmp_path / 'stop'}")
    with pytest.raises(NonFiniteError, match="loss is not finite") as info:
        stop.run()
    assert info.value.step == 1


def test_skip_without_clipping_is_rejected_at_config_time(tmp_path: Path) -> None:
    model = make_model(tmp_path, "llama", tied=False)
    data = write_data(tmp_path / "data.jsonl", 4)
    config = write_config(tmp_path / "c.yaml", model, data, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"on_nonfinite=skip needs train\.max_grad_norm > 0"):
        load_config(config, ["train.on_nonfinite=skip", "train.max_grad_norm=0"])
