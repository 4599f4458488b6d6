"""The launcher's watch loop, with fake rank processes (no real ranks started)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cli.util import one_error_line, run
from engine.tiny import make_model, write_config, write_data
from slidedp.runtime import launch as launch_module
from slidedp.runtime.dist import EXIT_PEER_FAILED, EXIT_STOPPED_WITH_PEERS


@pytest.fixture(autouse=True)
def _own_handlers() -> Iterator[None]:
    """The handlers a launch leaves behind are put back after each test."""
    handlers = {sig: signal.getsignal(sig) for sig in launch_module.FORWARDED}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


class _Proc:
    """A rank that runs for ``polls`` polls, then has exited with ``code``; ``on_poll`` runs
    at each poll (to signal the launcher mid-watch). Signals it gets are kept in ``got``;
    with ``dies``, the first one ends it (a rank that has no handler for it yet)."""

    def __init__(
        self, code: int, polls: int, on_poll: Callable[[], None] = lambda: None, dies: bool = False
    ) -> None:
        self.code, self.polls, self.on_poll, self.dies = code, polls, on_poll, dies
        self.got: list[str] = []

    def poll(self) -> int | None:
        self.on_poll()
        self.polls -= 1
        return None if self.polls >= 0 else self.code

    def send_signal(self, sig: int) -> None:
        self.got.append(signal.Signals(sig).name)
        if self.dies:
            self.code, self.polls = -sig, -1

    def kill(self) -> None:
        self.got.append("SIGKILL")
        self.code, self.polls = -signal.SIGKILL, -1

    def wait(self) -> int:
        return self.code

    @property
    def returncode(self) -> int:
        return self.code


def _launch_fakes(
    monkeypatch: pytest.MonkeyPatch,
    procs: list[_Proc],
    node: launch_module.Node | None = None,
    envs: list[dict[str, str]] | None = None,
    timeout_s: float | None = None,
    spec: launch_module.LaunchSpec | None = None,
) -> int:
    fakes = iter(procs)

    def popen(*args: object, env: dict[str, str], **kwargs: object) -> _Proc:
        if envs is not None:
            envs.append(env)
        return next(fakes)

    monkeypatch.setattr("slidedp.runtime.launch.subprocess.Popen", popen)
    monkeypatch.setattr("slidedp.runtime.launch.time.sleep", lambda s: None)
    return launch_module.launch(
        len(procs),
        ["train", "x.yaml"],
        node=node,
        timeout_s=timeout_s,
        spec=spec or launch_module.LaunchSpec(),
    )


NODE_1 = launch_module.Node(nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29511)


def test_a_node_launcher_numbers_its_ranks_after_the_nodes_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    envs: list[dict[str, str]] = []
    assert _launch_fakes(monkeypatch, [_Proc(0, 1), _Proc(0, 1)], NODE_1, envs) == 0
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    assert [[e[k] for k in keys] for e in envs] == [
        ["2", "0", "4", "2", "10.0.0.1", "29511"],
        ["3", "1", "4", "2", "10.0.0.1", "29511"],
    ]


def test_another_node_s_agreed_stop_exits_2_with_a_line_saying_node_0_saved(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 (node 0) saved; this node's ranks all left with it, and its operator hears how
    to go on (node 0's log alone says where it saved)."""
    procs = [_Proc(EXIT_STOPPED_WITH_PEERS, 1), _Proc(EXIT_STOPPED_WITH_PEERS, 2)]
    assert _launch_fakes(monkeypatch, procs, NODE_1) == 2
    assert capsys.readouterr().err.splitlines() == [
        "slidedp train: stopped with every node by a signal: node 0 saved a checkpoint (its log "
        "says which); continue with train.resume=auto on every node"
    ]


def test_a_rank_that_refused_with_its_own_line_gets_no_second_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank exits 2 having printed why (a config the nodes disagree on); its peer stops."""
    procs = [_Proc(2, 1), _Proc(EXIT_PEER_FAILED, 2)]
    assert _launch_fakes(monkeypatch, procs, NODE_1) == 2
    assert capsys.readouterr().err == ""


def test_ranks_stopped_by_another_node_make_one_line_saying_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    procs = [_Proc(EXIT_PEER_FAILED, 1), _Proc(EXIT_PEER_FAILED, 2)]
    assert _launch_fakes(monkeypatch, procs, NODE_1) == EXIT_PEER_FAILED
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "slidedp train: node 1's ranks [2, 3] stopped: a rank of another node failed "
        "(its node says which)"
    ]


def test_ranks_that_exit_between_two_polls_are_still_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both ranks exit in the same polling interval (the failing one and its peer): the
    failure is reported, never taken for success."""
    assert _launch_fakes(monkeypatch, [_Proc(EXIT_PEER_FAILED, 1), _Proc(1, 1)]) == 1
    assert "rank 1 exited with 1; stopped ranks [0]" in capsys.readouterr().err


def test_a_rank_killed_for_hanging_is_named_as_hung_not_as_killed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 timed out waiting for rank 1 and left as a peer (silent); rank 1 never exits
    and the launcher kills it: the line says rank 1 hung (was "killed by SIGKILL", the
    launcher's own kill)."""
    monkeypatch.setattr(launch_module, "GRACE_S", 0.0)
    procs = [_Proc(EXIT_PEER_FAILED, 1), _Proc(0, 10**9), _Proc(EXIT_PEER_FAILED, 2)]
    assert _launch_fakes(monkeypatch, procs) == 1
    assert procs[1].got == ["SIGKILL"]
    assert capsys.readouterr().err.splitlines() == [
        "slidedp train: rank 1 stopped responding: still running 0 s after ranks [0, 2] "
        "stopped on a collective that failed or timed out (runtime.version_timeout_s); killed"
    ]


def test_an_agreed_stop_exits_2_and_the_launcher_adds_no_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 saved and exits 2, the others EXIT_STOPPED_WITH_PEERS: not a failure."""
    procs = [_Proc(2, 3), _Proc(EXIT_STOPPED_WITH_PEERS, 1), _Proc(EXIT_STOPPED_WITH_PEERS, 2)]
    assert _launch_fakes(monkeypatch, procs) == 2
    assert capsys.readouterr().err == ""


def _signal_launcher_at(*polls_and_signals: tuple[int, signal.Signals]) -> Callable[[], None]:
    """An ``on_poll`` that sends the launcher (this process) each signal at its poll count."""
    count = 0
    plan = dict(polls_and_signals)

    def on_poll() -> None:
        nonlocal count
        count += 1
        if count in plan:
            os.kill(os.getpid(), plan[count])

    return on_poll


def test_signals_are_forwarded_once_then_a_second_one_kills_the_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hup = _Proc(2, 4, _signal_launcher_at((2, signal.SIGHUP)))
    peer = _Proc(EXIT_STOPPED_WITH_PEERS, 5)
    assert _launch_fakes(monkeypatch, [hup, peer]) == 2
    assert hup.got == peer.got == ["SIGTERM"]  # SIGHUP goes on as SIGTERM
    # slidedp train exits with the ranks' verdict: a late signal must not change its code
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in launch_module.FORWARDED)

    stuck = [_Proc(0, 10**6, _signal_launcher_at((2, signal.SIGINT), (4, signal.SIGINT))),
             _Proc(0, 10**6)]  # fmt: skip
    assert _launch_fakes(monkeypatch, stuck) == 128 + signal.SIGINT
    assert stuck[0].got == stuck[1].got == ["SIGINT", "SIGKILL"]
    assert capsys.readouterr().err.splitlines() == [
        "slidedp train: a second SIGINT killed the ranks before they exited"
    ]  # not "rank 0 was killed by SIGKILL": the kill was the launcher's own


def test_ranks_a_forwarded_signal_ends_outside_the_loop_make_one_line_saying_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM while the ranks start: rank 1 has no handler yet and dies of it, rank 0 sees
    its peer fail. One line names the signal (was "rank 1 was killed by SIGTERM", exit 1)."""
    procs = [
        _Proc(EXIT_PEER_FAILED, 5, _signal_launcher_at((2, signal.SIGTERM))),
        _Proc(0, 10**6, dies=True),
    ]
    assert _launch_fakes(monkeypatch, procs) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [
        "slidedp train: stopped by SIGTERM outside the training loop (starting or finishing), "
        "where no checkpoint is taken: train.resume=auto continues from the last one saved, "
        "if any"
    ]
    # the bench's ranks save nothing to resume from, and the bench goes on after them: its
    # handlers are given back (here the default; the train launch above left SIGTERM ignored)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    procs = [
        _Proc(EXIT_PEER_FAILED, 5, _signal_launcher_at((2, signal.SIGTERM))),
        _Proc(0, 10**6, dies=True),
    ]
    bench = launch_module.LaunchSpec(
        name="slidedp bench train: ours on 2 ranks", training_run=False
    )
    assert _launch_fakes(monkeypatch, procs, spec=bench) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert capsys.readouterr().err.splitlines() == [
        "slidedp bench train: ours on 2 ranks: stopped by SIGTERM outside the training loop "
        "(starting or finishing), where no checkpoint is taken"
    ]


def test_the_launcher_runs_the_preflight_before_starting_any_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal of a several-rank run is the one line of the checks, not one per rank plus
    the launcher's report (here: a new run over a checkpoint an interrupted copy left)."""
    model = make_model(tmp_path, "qwen3", tied=True)
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    config = write_config(tmp_path / "c.yaml", model, data, out, runtime={"ranks": 2})

    def no_launch(*args: object) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch_module, "launch", no_launch)
    code, _, err = run(capsys, "train", str(config))
    assert code == 2
    one_error_line(err, "train", "already holds checkpoint-2", "train.resume=auto")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]


def test_ranks_still_running_at_the_timeout_are_killed_and_the_launch_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``timeout_s`` (a policy trial's bound): every rank still running then is killed, one
    line says so, and the code is ``EXIT_TIMED_OUT``; a launch that ends in time is not cut."""
    hung = [_Proc(0, 10**9), _Proc(0, 10**9)]
    assert _launch_fakes(monkeypatch, hung, timeout_s=0.0) == launch_module.EXIT_TIMED_OUT
    assert [p.got for p in hung] == [["SIGKILL"], ["SIGKILL"]]
    assert capsys.readouterr().err == "slidedp train: the ranks ran past 0 s and were stopped\n"
    assert _launch_fakes(monkeypatch, [_Proc(0, 3), _Proc(0, 5)], timeout_s=60.0) == 0


def test_a_rank_a_repeated_signal_ends_after_a_saved_stop_is_no_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 saved, said so and exits 2; rank 1, past its loop, dies of a second copy of
    the signal (a scheduler signals every process): exit 2, no line after rank 0's."""
    procs = [_Proc(2, 3, _signal_launcher_at((1, signal.SIGINT))), _Proc(0, 10**6, dies=True)]
    assert _launch_fakes(monkeypatch, procs) == 2
    assert capsys.readouterr().err == ""


def test_a_crash_before_a_second_signal_is_reported_as_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 was SIGKILLed (the OOM killer) before the second Ctrl-C killed rank 0: the
    line names rank 1's death, not the second signal."""
    at = _signal_launcher_at((1, signal.SIGINT), (3, signal.SIGINT))
    procs = [_Proc(0, 10**6, at), _Proc(-signal.SIGKILL, 1)]
    monkeypatch.setattr(launch_module, "GRACE_S", 60.0)
    assert _launch_fakes(monkeypatch, procs) == 1
    assert procs[0].got == ["SIGINT", "SIGKILL"]
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err


def test_a_launched_rank_dies_of_sigint_before_its_loop_instead_of_raising() -> None:
    """A forwarded Ctrl-C while a rank starts ends it as SIGTERM does (the launcher reports
    the signal once), not as a KeyboardInterrupt raised through torch's C++ frames."""
    code = (
        "import os, signal, time\n"
        f"os.environ[{launch_module.LAUNCHER_PID!r}] = str(os.getppid())\n"
        "from slidedp.runtime.launch import watch_launcher\n"
        "watch_launcher()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stderr == ""
