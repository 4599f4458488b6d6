"""``slidedp train`` with ``runtime.ranks``/``runtime.gpus`` > 1 or ``runtime.nodes`` > 1: one
process per local rank, watched.

Each rank is ``python -m slidedp train CONFIG ...`` with torchrun's environment; ranks are
numbered node by node (``RANK = node_rank * L + local_rank``) and meet at node 0's
``master_addr:master_port``. Invariants: when a rank fails the others exit and any still running
``GRACE_S`` later is killed; the exit code is the first failing rank's, with one line naming it.
SIGTERM/SIGINT are forwarded (SIGHUP as SIGTERM): the ranks agree on a step, rank 0 saves, all
exit 2; a second signal kills them. With ``own_session`` a rank whose launcher died sends itself
SIGTERM (``watch_launcher``). Given a ``Zygote``, the ranks are forked from a copy of the
launcher taken after its imports instead of started as fresh interpreters.

Example::

    sys.exit(launch(2, ["train", "run.yaml", "train.max_steps=5"]))
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Protocol

from slidedp.runtime.dist import EXIT_PEER_FAILED, EXIT_STOPPED_WITH_PEERS
from slidedp.runtime.dist import LAUNCHER_PID as LAUNCHER_PID  # set for the ranks started here
from slidedp.runtime.zygote import Zygote, children_zygote

GRACE_S = 10.0  # survivors of a failure get this long to exit on their own
FORWARDED = {
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGINT: signal.SIGINT,
    signal.SIGHUP: signal.SIGTERM,
}  # signal to the launcher -> signal to the ranks
EXIT_SAVED_AND_STOPPED = 2  # rank 0's code after an agreed stop (as one process's)
EXIT_REFUSED = 2  # a rank refused bad input, having said why in one line
EXIT_TIMED_OUT = 124  # the ranks ran past the launch's timeout (as timeout(1) says it)
WATCH_S = 0.5  # how often a rank looks whether its launcher is still there


def free_port() -> int:
    """A TCP port free on localhost now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


@dataclass(frozen=True)
class Node:
    """This machine's part of a run of several nodes (``runtime.nodes`` > 1)."""

    nodes: int
    node_rank: int
    master_addr: str
    master_port: int


class Rank(Protocol):
    """A rank process as the watch loop drives it (``subprocess.Popen``, ``ForkedRank``)."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class LaunchSpec:
    """What the ranks run and where they write: ``python -m MODULE ARGV``, ``name`` heading
    the failure line; ``own_session``: each rank in its own session, watching its launcher
    (``watch_launcher``); ``stdout``, ``stderr``: where the ranks write (None: this
    process's); ``training_run``: the ranks are ``slidedp train``'s, whose verdict this
    process exits with: a stop's line says how to go on, and once a stop signal came the later
    ones stay ignored (a late Ctrl-C must not turn a saved stop's exit 2 into 130)."""

    module: str = "slidedp"
    name: str = "slidedp train"
    own_session: bool = True
    training_run: bool = True
    stdout: IO[bytes] | None = None
    stderr: IO[bytes] | None = None


def launch(
    world: int,
    argv: list[str],
    *,
    node: Node | None = None,
    timeout_s: float | None = None,
    spec: LaunchSpec = LaunchSpec(),
    zygote: Zygote | None = None,
) -> int:
    """Run ``spec``'s ``python -m MODULE ARGV`` as ``world`` ranks of this node; 0 when every
    rank succeeded. ``timeout_s``: ranks still running then are killed, and the exit code is
    ``EXIT_TIMED_OUT``. ``zygote``: the ranks are forked from it, which is closed once they
    run (None: from the zygote of ``runtime.zygote.children_forked`` inside one, else fresh
    interpreters)."""
    module, own_session = spec.module, spec.own_session
    stdout, stderr = spec.stdout, spec.stderr
    node = node or Node(1, 0, "127.0.0.1", free_port())
    procs: list[Rank] = []
    forking = zygote or children_zygote()
    for local in range(world):
        env = os.environ | {
            "RANK": str(node.node_rank * world + local),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(node.nodes * world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": str(node.node_rank),
            "MASTER_ADDR": node.master_addr,
            "MASTER_PORT": str(node.master_port),
        }
        if own_session:
            env[LAUNCHER_PID] = str(os.getpid())
        if forking is not None:
            procs.append(forking.start(module, argv, env, own_session=own_session,
                                       output=(stdout, stderr)))  # fmt: skip
            continue
        command = [sys.executable, "-m", module, *argv]
        procs.append(subprocess.Popen(command, env=env, start_new_session=own_session,
                                      stdout=stdout, stderr=stderr))  # fmt: skip
    if zygote is not None:  # its work is done: the launcher's children are the ranks alone
        zygote.close()
    end = None if timeout_s is None else time.monotonic() + timeout_s
    # held to the verdict: a late signal interrupts nothing
    with _forwarding(procs, spec.training_run) as received:
        try:
            first, hung = _watch(procs, end)
        finally:
            for p in procs:  # an error here: no rank outlives the launcher
                if p.poll() is None:
                    p.kill()
                p.wait()
        ended = _Ended([p.wait() for p in procs], first, hung, received)
        return _verdict(ended, spec, node, timeout_s)


@dataclass
class _Received:
    """The stop signals the launcher received while the ranks ran, and the ranks a second
    one killed."""

    signals: list[signal.Signals] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Ended:
    """How one launch's ranks ended: their exit codes; (local rank, exit code) of the first
    failure (None: none failed); the ranks killed here for not exiting after the others
    stopped (``GRACE_S``); the signals received."""

    codes: list[int]
    first: tuple[int, int] | None
    hung: list[int]
    received: _Received


def _verdict(ended: _Ended, spec: LaunchSpec, node: Node, timeout_s: float | None) -> int:
    """The launch's exit code, with one line on stderr saying why where no rank said it."""
    world, base = len(ended.codes), node.node_rank * len(ended.codes)
    stopped = [EXIT_STOPPED_WITH_PEERS] * world
    if node.node_rank == 0:
        stopped[0] = EXIT_SAVED_AND_STOPPED

    def say(line: str) -> None:
        print(f"{spec.name}: {line}", file=sys.stderr, flush=True)

    if ended.codes == stopped:  # an agreed stop: rank 0 (node 0) said what it saved
        if node.node_rank > 0:  # this node's operator hears it too
            say("stopped with every node by a signal: node 0 saved a checkpoint (its log says "
                "which); continue with train.resume=auto on every node")  # fmt: skip
        return EXIT_SAVED_AND_STOPPED
    if ended.first is None:
        return 0
    local, code = ended.first
    signals, hung, codes = ended.received.signals, ended.hung, ended.codes
    if code == EXIT_REFUSED and not signals:  # the rank's own line says why
        return code

    if code == EXIT_TIMED_OUT:
        say(f"the ranks ran past {timeout_s:.0f} s and were stopped")
        return EXIT_TIMED_OUT
    saved = EXIT_STOPPED_WITH_PEERS in codes or (
        node.node_rank == 0 and codes[0] == EXIT_SAVED_AND_STOPPED
    )
    if signals and saved:  # rank 0 said what it saved (a peer leaves with 4 only after that):
        return EXIT_SAVED_AND_STOPPED  # a rank a repeated signal ended since is no failure
    if local in ended.received.killed:
        say(f"a second {signals[1].name} killed the ranks before they exited")
        return 128 + signals[1]
    if signals and code == -FORWARDED[signals[0]]:  # a rank outside the loop that saves on it
        resume = (": train.resume=auto continues from the last one saved, if any"
                  if spec.training_run else "")  # fmt: skip
        say(f"stopped by {signals[0].name} outside the training loop (starting or finishing), "
            f"where no checkpoint is taken{resume}")  # fmt: skip
        return 128 + signals[0]
    if code == EXIT_PEER_FAILED and hung:  # every rank that exited left as a peer: these hung
        who = f"rank {base + hung[0]}" if len(hung) == 1 else f"ranks {[base + r for r in hung]}"
        rest = [base + r for r in range(world) if r not in hung]
        say(f"{who} stopped responding: still running {GRACE_S:g} s after ranks {rest} "
            "stopped on a collective that failed or timed out (runtime.version_timeout_s); "
            "killed")  # fmt: skip
        return 1
    if node.nodes > 1 and all(c in (EXIT_PEER_FAILED, EXIT_STOPPED_WITH_PEERS) for c in codes):
        what = f"node {node.node_rank}'s ranks {[base + r for r in range(world)]} stopped"
        say(f"{what}: a rank of another node failed (its node says which)")
        return code
    others = [base + r for r in range(world) if r != local]
    say(f"rank {base + local} {_describe(code)}; stopped ranks {others}")
    return 1 if code < 0 else code


def _watch(procs: list[Rank], end: float | None) -> tuple[tuple[int, int] | None, list[int]]:
    """Wait for every rank; (rank, exit code) of the first failure, None when all succeeded,
    and the ranks this killed because they did not exit (hung). Ranks still running
    ``GRACE_S`` after a failure are killed, and at ``end`` (a monotonic time; None: never)
    every rank still running, the first failure then ``EXIT_TIMED_OUT``."""
    first: tuple[int, int] | None = None
    deadline = None
    hung: list[int] = []  # this kill is no failure of theirs to report as one
    while True:
        if end is not None and first is None and time.monotonic() > end:
            first, deadline = (0, EXIT_TIMED_OUT), time.monotonic()  # kill them all below
        codes = [p.poll() for p in procs]  # one snapshot: a rank that exits between the
        for rank, code in enumerate(codes):  # loop test and a poll is never missed
            if code in (None, 0, EXIT_STOPPED_WITH_PEERS) or rank in hung:
                continue  # running, done, left with rank 0, or killed here
            if first is None or first[1] == EXIT_PEER_FAILED:
                if first is None or code != EXIT_PEER_FAILED:
                    first = (rank, code)
                deadline = deadline or time.monotonic() + GRACE_S
        if None not in codes:
            break
        if deadline is not None and time.monotonic() > deadline:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    if rank not in hung:
                        hung.append(rank)
        time.sleep(0.05)
    return first, hung


@contextlib.contextmanager
def _forwarding(procs: list[Rank], ends_process: bool) -> Iterator[_Received]:
    """While inside, the first stop signal to the launcher goes to every rank still running
    (``FORWARDED``); a second one kills them. Yields what it received, as it comes. On the
    way out, with ``ends_process`` and a signal received, the signals stay ignored."""
    received = _Received()

    def forward(signum: int, frame: object) -> None:
        received.signals.append(signal.Signals(signum))
        for rank, p in enumerate(procs):
            if p.poll() is None:
                if len(received.signals) == 1:
                    p.send_signal(FORWARDED[received.signals[0]])
                else:
                    p.kill()
                    if rank not in received.killed:
                        received.killed.append(rank)

    if threading.current_thread() is not threading.main_thread():  # Python's rule for handlers
        yield received
        return
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            if ends_process and received.signals:
                handler = signal.SIG_IGN
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def watch_launcher() -> None:
    """In a rank started by ``launch``: SIGTERM to this rank, once, when the launcher is gone
    (a thread looks every ``WATCH_S``; ``PR_SET_PDEATHSIG`` would signal once per thread).
    SIGINT ends the rank as SIGTERM does until the training loop takes both (``StopSignals``):
    a forwarded Ctrl-C while it starts is no KeyboardInterrupt raised through torch's frames
    and printed by every rank; the launcher says what stopped them, once."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(WATCH_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="slidedp-launcher-watch", daemon=True).start()
