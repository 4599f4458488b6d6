"""SIGTERM/SIGINT with several ranks: every rank stops after the same step, rank 0 checkpoints and
says so once, and ``train.resume=auto`` continues bit for bit (same rank count: same sums)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.tiny import make_model, read_metrics, write_config, write_data
from multirank.ranks import latest_step, run_ranks, start_train, wait_for_steps
from slidedp.runtime.dist import EXIT_STOPPED_WITH_PEERS
from slidedp.runtime.stop_signals import StopSignals


def _config(tmp_path: Path, out: Path, steps: int, **train: object) -> Path:
    model = make_model(tmp_path, "qwen3", tied=False, layers=3)
    data = write_data(tmp_path / "data.jsonl", 30)
    train = {"max_steps": steps, "global_batch_size": 4, "max_grad_norm": 1.0,
             "lr_scheduler": "constant", **train}  # fmt: skip
    runtime = {"ranks": 2, "version_timeout_s": 300}  # a hang would outlast the test's bound
    return write_config(tmp_path / f"{out.name}.yaml", model, data, out, train=train,
                        runtime=runtime, output={"tensorboard": False})  # fmt: skip


def _assert_same_checkpoints(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert files, a
    assert files == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for f in files:
        ta, tb = load_file(a / f), load_file(b / f)
        assert set(ta) == set(tb)
        for name in ta:
            assert torch.equal(ta[name], tb[name]), f"{f}: {name}"


@pytest.mark.e2e
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 alone is signalled during step 2 (as a scheduler might): rank 0 never saw a
    signal, yet both stop after step 2; then a resume matches an uninterrupted run."""
    out = tmp_path / "run"
    config = _config(tmp_path, out, steps=5)
    assert run_ranks(config, 2, term=(1, 1)) == [2, EXIT_STOPPED_WITH_PEERS]
    err = capfd.readouterr().err
    assert err.count("stopped by a signal to another rank after step 2: saved") == 1, err
    assert latest_step(out) == 2
    assert not (out / "final").exists()
    assert [m["step"] for m in read_metrics(out)] == [1, 2]

    assert run_ranks(config, 2, ["train.resume=auto"]) == [0, 0]
    straight = tmp_path / "straight"
    assert run_ranks(_config(tmp_path, straight, steps=5), 2) == [0, 0]
    losses = [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(out)]
    assert losses == [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(straight)]
    _assert_same_checkpoints(out / "checkpoint-5", straight / "checkpoint-5")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.e2e
def test_sigterm_to_the_launcher_checkpoints_once_and_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_train(_config(tmp_path, out, steps=10_000))
    ranks = wait_for_steps(proc, out, 1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1, err
    assert "stopped by SIGTERM after step" in err
    stopped = latest_step(out)
    assert 1 <= stopped < 10_000
    assert f"checkpoint-{stopped}" in err
    assert len(read_metrics(out)) == stopped  # no rank went a step further
    assert all(_gone(pid) for pid in ranks)


@pytest.mark.e2e
def test_a_dead_launcher_makes_the_ranks_checkpoint_and_exit(tmp_path: Path) -> None:
    """SIGKILL to the launcher (nothing can be forwarded): each rank sees its parent gone, sends
    itself SIGTERM and stops as on any SIGTERM, with a checkpoint."""
    out = tmp_path / "run"
    proc = start_train(_config(tmp_path, out, steps=10_000))
    ranks = wait_for_steps(proc, out, 1)
    proc.kill()
    proc.wait(timeout=10)  # the ranks hold its stderr pipe until they are done
    deadline = time.monotonic() + 60
    while not all(_gone(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the ranks outlived their launcher"
        time.sleep(0.1)
    stopped = latest_step(out)
    assert stopped == len(read_metrics(out))
    assert (out / f"checkpoint-{stopped}" / "model.safetensors").is_file()
    assert not list(out.glob(".checkpoint-*"))  # no half-written checkpoint
    assert proc.stderr is not None
    with proc.stderr:  # each rank notices on its own: rank 0 may be second
        err = proc.stderr.read()
    assert re.search(r"stopped by (SIGTERM|a signal to another rank) after step \d+: saved", err)


def test_a_repeated_sigterm_is_absorbed_and_a_second_sigint_interrupts() -> None:
    """A scheduler's SIGTERM reaches a rank directly and again through its launcher: the
    second must not kill the rank mid-save. A second Ctrl-C still interrupts at once."""
    # Ctrl-C as an interpreter starts with it (a test worker's own may have been set otherwise)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the default action would end the test process
            assert stop.received == signal.SIGTERM
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, interrupt)


def test_a_launched_rank_absorbs_a_repeated_sigint_too() -> None:
    """A rank the launcher started has SIGINT's default action (it dies of it outside the
    loop): inside, a Ctrl-C reaching it directly and again through the launcher must not kill
    it mid-save; the launcher's own second signal kills the ranks."""
    interrupt = signal.signal(signal.SIGINT, signal.SIG_DFL)
    terminate = signal.getsignal(signal.SIGTERM)
    try:
        with StopSignals(absorb_repeats=True) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the default action would end the test process
            assert stop.received == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # leaving: still absorbed
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        with StopSignals(absorb_repeats=True):
            pass  # no signal: the rank goes on (a final save), with the action it had
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, terminate)
