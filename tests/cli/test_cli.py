"""The verbs' normal output and the CLI's error contract: exit codes, --debug, Ctrl-C."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import slidedp.preflight
from cli.util import one_error_line, run, tiny_run_config
from engine.tiny import read_metrics
from slidedp.config import RESOLVED_CONFIG, config_from_dict

Capsys = pytest.CaptureFixture[str]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return tiny_run_config(tmp_path)


def test_validate_prints_an_ok_summary_and_writes_nothing(capsys: Capsys, config: Path) -> None:
    code, out, err = run(capsys, "validate", str(config), "train.max_steps=2")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"slidedp validate: OK ({config})"
    topics = [line.split()[0] for line in lines[1:]]
    assert topics == ["device", "model", "policy", "resume", "host", "output", "data"]
    assert "qwen3" in lines[2]
    assert "1 safetensors file(s), headers match" in lines[2]
    assert "8 samples" in lines[7]
    assert not (config.parent / "out").exists()
    assert not list(config.parent.glob(".slidedp-write-probe-*"))


@pytest.mark.e2e
def test_train_prints_and_saves_the_resolved_config(capsys: Capsys, config: Path) -> None:
    code, out, err = run(capsys, "train", str(config), "train.max_steps=2")
    assert code == 0, err
    out_dir = config.parent / "out"
    saved = yaml.safe_load((out_dir / RESOLVED_CONFIG).read_text())
    assert saved["train"]["max_steps"] == 2  # the override applied
    assert saved["train"]["adam_beta2"] == 0.999  # a default filled in
    assert config_from_dict(saved).output.dir == str(out_dir)
    header, _, rest = out.partition("\n")
    assert header == (
        f"slidedp train: resolved config (saved as {out_dir}/{RESOLVED_CONFIG} if the checks pass):"
    )  # a refused run writes nothing
    assert yaml.safe_load(rest[: rest.index("runtime:")]) == {
        k: v for k, v in saved.items() if k != "runtime"
    }
    assert len(read_metrics(out_dir)) == 2


def test_the_resolved_config_is_saved_after_every_check_and_before_training(
    capsys: Capsys, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved = config.parent / "out" / RESOLVED_CONFIG
    seen: list[str] = []

    class FakeTrainer:
        def __init__(self, cfg: object, **_: object) -> None:
            seen.append(f"build, saved={resolved.exists()}")

        @property
        def trackers(self) -> None:  # opened before the first write: a refusal if they fail
            seen.append(f"trackers, saved={resolved.exists()}")

        def run(self) -> None:
            seen.append(f"run, saved={resolved.exists()}")

    monkeypatch.setattr("slidedp.runtime.trainer.Trainer", FakeTrainer)
    assert run(capsys, "train", str(config))[0] == 0
    assert seen == ["build, saved=False", "trackers, saved=False", "run, saved=True"]


def _raise(error: BaseException) -> object:
    def fail(*args: object, **kwargs: object) -> object:
        raise error

    return fail


def test_an_unexpected_error_is_one_line_with_a_hint_and_exit_1(
    capsys: Capsys, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slidedp.preflight, "validate", _raise(RuntimeError("disk\non fire")))
    code, _, err = run(capsys, "validate", str(config))
    assert code == 1
    one_error_line(err, "validate", "unexpected RuntimeError: disk on fire", "rerun with --debug")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(
    capsys: Capsys, config: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.setattr(slidedp.preflight, "validate", _raise(RuntimeError("boom")))
    argv = ["validate", str(config)]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1] == "slidedp validate: error: unexpected RuntimeError: boom"
    code, _, err = run(capsys, "--debug", "train", str(config), "train.max_stpes=1")
    assert code == 2
    assert "Traceback" in err
    assert err.splitlines()[-1].startswith("slidedp train: error: unknown key 'train.max_stpes'")


def test_ctrl_c_is_one_line_and_exit_130(
    capsys: Capsys, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slidedp.preflight, "validate", _raise(KeyboardInterrupt()))
    code, _, err = run(capsys, "validate", str(config))
    assert (code, err) == (130, "slidedp validate: interrupted\n")


@pytest.mark.e2e
def test_the_process_exit_code_and_no_traceback(tmp_path: Path) -> None:
    """The one test through a real process: the exit status the shell sees."""
    done = subprocess.run(
        [sys.executable, "-m", "slidedp", "train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    one_error_line(done.stderr, "train", "cannot read config")


def test_env_reports_the_machine(capsys: Capsys) -> None:
    code, out, _ = run(capsys, "env")
    assert code == 0
    for topic in ("slidedp ", "host kernels: ISA ", "CPU: ", "memory: MemTotal ", "/dev/shm: "):
        assert any(line.startswith(topic) for line in out.splitlines()), topic
    assert "ulimit -l: " in out
    assert "GPUs: " in out


def test_env_json_has_the_same_facts_as_numbers(capsys: Capsys) -> None:
    code, out, _ = run(capsys, "env", "--json")
    assert code == 0
    info = json.loads(out)
    assert set(info) >= {"versions", "host_kernels", "cpu", "memory", "shm", "gpus", "gpu_links"}
    assert info["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["host_kernels"]["isa"] in info["host_kernels"]["supported_isas"]
    assert 0 < info["memory"]["mem_available_bytes"] <= info["memory"]["mem_total_bytes"]
    stat = os.statvfs("/dev/shm")
    assert info["shm"]["size_bytes"] == stat.f_blocks * stat.f_frsize
    assert info["cpu"]["usable_cores"] == len(os.sched_getaffinity(0))


def test_overrides_may_follow_the_options(capsys: Capsys) -> None:
    """`slidedp plan c.yaml --out p.yaml train.max_steps=5` (argparse alone leaves the late
    override over); a late option, or a bare override to a verb without a config (the bench's
    go through `--set`), is still refused."""
    from slidedp.cli import parse_args

    args = parse_args(["plan", "c.yaml", "a.b=1", "--out", "p.yaml", "train.max_steps=5"])
    assert (args.config, args.out) == ("c.yaml", "p.yaml")
    assert args.overrides == ["a.b=1", "train.max_steps=5"]
    for bad in (["plan", "c.yaml", "--out", "p.yaml", "--bogus"],
                ["env", "train.max_steps=5"],
                ["bench", "train", "--shape", "tiny", "runtime.policy=auto"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert "unrecognized arguments" in capsys.readouterr().err
