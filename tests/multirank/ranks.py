"""Run ``slidedp train`` as several ranks inside a test: forked processes with a launcher's
environment (fork skips re-importing torch, so a 2-rank run costs seconds, not tens of them)."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.tiny import read_metrics, write_config
from slidedp.cli import main
from slidedp.store import StateRegion

REGIONS: tuple[StateRegion, ...] = ("master", "exp_avg", "exp_avg_sq")  # a node's optimizer state


@dataclass(frozen=True)
class Faults:
    """What a rank injects: rank ``fail[0]`` raises at step ``fail[1]``, rank ``term[0]`` gets
    SIGTERM at step ``term[1]`` (rank -1: none)."""

    fail: tuple[int, int]
    term: tuple[int, int]


def _rank(
    config: Path,
    rank: int,
    world: int,
    local_world: int,
    port: int,
    overrides: list[str],
    faults: Faults,
    dump: Path | None,
) -> None:
    fail, term = faults.fail, faults.term
    from slidedp.runtime.engine import Engine

    step = Engine.step

    def injected(self: Engine, t: int, *args: Any, **kwargs: Any) -> Any:
        if (rank, t) == fail:  # raises after its collectives started
            raise RuntimeError(f"injected failure on rank {rank}")
        if (rank, t) == term:  # as a scheduler that signals one rank only
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, t, *args, **kwargs)

    # One compute thread: a forked child must not enter the OpenMP pool of a parent that
    # trained in-process (it hangs; a rank alone on its simulated node would keep all cores).
    torch.set_num_threads(1)
    Engine.step = injected  # type: ignore[method-assign]
    if dump is not None:
        dump_node_state(dump, rank, local_world)
    os.environ |= {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local_world),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    os._exit(main(["train", str(config), *overrides]))


def training(metrics: Path, *nodes: subprocess.Popen[str], timeout_s: float) -> None:
    """Until ``metrics`` holds two steps: the nodes train (none of them ended first)."""
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        for n, node in enumerate(nodes):
            assert node.poll() is None, f"node {n} ended before training"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


def dump_node_state(dump: Path, rank: int, local_world: int) -> None:
    """In rank ``rank`` (of nodes of ``local_world`` ranks): once training ends, a node's local
    rank 0 saves its store's final state (``REGIONS``) as ``DUMP/nodeN.pt``."""
    from slidedp.runtime.trainer import Trainer

    run = Trainer.run

    def dumping(self: Trainer) -> Any:
        records = run(self)  # every update of this node is in its store now
        if rank % local_world == 0:
            regions = {r: self.store.region(r).clone() for r in REGIONS}
            torch.save(regions, dump / f"node{rank // local_world}.pt")
        return records

    Trainer.run = dumping  # type: ignore[method-assign]


def run_ranks(
    config: Path,
    world: int,
    overrides: list[str] | None = None,
    fail: tuple[int, int] = (-1, 0),
    term: tuple[int, int] = (-1, 0),
    nodes: int = 1,
    dump: Path | None = None,
) -> list[int]:
    """Exit codes of the ``world`` ranks of ``slidedp train CONFIG OVERRIDES``, as ``nodes``
    simulated nodes of ``world / nodes`` ranks (each node's local rank 0 creates its own host
    store); rank ``fail[0]`` raises at step ``fail[1]``; rank ``term[0]`` gets SIGTERM at step
    ``term[1]``. With ``dump``, each node's local rank 0 saves its store's final state
    (``REGIONS``) as ``DUMP/nodeN.pt``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Garbage of earlier in-process runs (an engine with its threads) must go in this process:
    # a forked rank would inherit it without those threads and tear it down there.
    gc.collect()
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(
            target=_rank,
            args=(
                config,
                r,
                world,
                world // nodes,
                port,
                overrides or [],
                Faults(fail, term),
                dump,
            ),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    codes = [p.exitcode for p in procs]
    for p in procs:  # a hung rank must not outlive the test (the interpreter joins it at exit)
        if p.is_alive():
            p.kill()
            p.join()
    assert all(c is not None for c in codes), f"a rank hung: {codes}"
    return [int(c) for c in codes if c is not None]


def one_and_two_ranks(
    tmp_path: Path, model: Path, data: Path, train: dict[str, Any], runtime: dict[str, Any]
) -> tuple[Path, Path]:
    """The output directories of one training on 1 rank x B (in this process) and on 2 forked
    ranks x B/2 (``runtime`` plus ``ranks: 2``), same model, data and config, no TensorBoard."""
    one, two = tmp_path / "one", tmp_path / "two"
    output = {"tensorboard": False}
    c1 = write_config(tmp_path / "1.yaml", model, data, one, train=train, runtime=runtime,
                      output=output)  # fmt: skip
    c2 = write_config(tmp_path / "2.yaml", model, data, two, train=train,
                      runtime=runtime | {"ranks": 2}, output=output)  # fmt: skip
    assert main(["train", str(c1)]) == 0
    assert run_ranks(c2, 2) == [0, 0]
    return one, two


def assert_same_series(one: Path, two: Path, keys: tuple[str, ...], rtol: float) -> None:
    """Each metric of ``keys`` (``loss``, ``grad_norm`` ...) of every step of run ``two`` is
    run ``one``'s within ``rtol`` relative."""
    m1, m2 = read_metrics(one), read_metrics(two)
    for key in keys:
        a, b = (torch.tensor([m[key] for m in ms], dtype=torch.float64) for ms in (m1, m2))
        try:
            torch.testing.assert_close(b, a, rtol=rtol, atol=0)
        except AssertionError as e:
            raise AssertionError(f"{key}: {e}") from None


def start_train(config: Path) -> subprocess.Popen[str]:
    """``slidedp train CONFIG`` as a real launch (it starts the ranks); stderr kept."""
    return subprocess.Popen(
        [sys.executable, "-m", "slidedp", "train", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it, parents first (none once they are gone)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(p for c in children for p in _tree(int(c)))]


@contextlib.contextmanager
def reaped(*procs: subprocess.Popen[str]) -> Iterator[None]:
    """Each launch of ``procs`` and the processes under it are killed at exit, however the test
    ends: a failed assertion must not leave a 10,000-step launch training on the machine."""
    try:
        yield
    finally:
        pids = [p for proc in procs for p in _tree(proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()


def wait_for_steps(proc: subprocess.Popen[str], out: Path, steps: int) -> list[int]:
    """The ranks' pids, once ``steps`` steps are in the metrics."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        assert proc.poll() is None, "the launch ended before training"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    ranks = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    assert len(ranks) == 2
    return ranks


def latest_step(out: Path) -> int:
    """The step of ``OUT/latest``."""
    return int((out / "latest").read_text().strip().removeprefix("checkpoint-"))
