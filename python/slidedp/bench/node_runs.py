"""Simulated nodes on one host: ``slidedp train`` once per node, each launching its own ranks
with its own host store and, on CUDA, its own GPUs.

``node_launches`` is pure (each node's command and environment); ``run_nodes`` starts them and
waits. Each node inherits this environment plus ``OMP_NUM_THREADS`` (cores / nodes),
``runtime.update_threads`` (the same per rank as 1 node of N x R ranks), on CUDA
``CUDA_VISIBLE_DEVICES`` (node ``n`` the GPUs ``n*R .. (n+1)*R - 1``: no two nodes share one),
with ``nccl_net`` NCCL's socket transport, with ``nccl_log`` its INFO log (``nccl_transports``).

Example::

    shape = NodeShape(nodes=2, ranks=1, device="cuda", gpus=visible_gpus())
    launches = node_launches(config, out, shape, port=free_port(), cores=os.cpu_count() or 1,
                             nccl_net=True)
    run_nodes(launches, timeout_s=600)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import torch

from slidedp.errors import ConfigError
from slidedp.runtime.zygote import ForkedRank, start_child

# NCCL between processes of one host as between machines: no CUDA P2P (NVLink), no shared
# memory, no InfiniBand: its socket transport, on the loopback interface. NCCL then takes the
# other GPU for another machine's (no P2P or SHM path to it); NET_DISABLE_INTRA=0 (NCCL's
# default, RCCL's is 1) keeps the network allowed between ranks of one host.
NCCL_NET_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_NET_DISABLE_INTRA": "0",
}
# "Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0": transport and its kind
_VIA = re.compile(r" via ((?:P2P|SHM|NET|COLLNET)/[^/\s]+)")

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class NodeLaunch:
    """One simulated node's ``slidedp train``: its command, what it adds to this process's
    environment, and where its stderr goes."""

    argv: list[str]
    env: dict[str, str]
    stderr: Path


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """This process's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]

    return [str(i) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class NodeShape:
    """The simulated nodes: ``nodes`` launchers of ``ranks`` ranks each on ``device``; on CUDA
    ``gpus`` are the GPUs this process sees (``visible_gpus``), node ``n`` takes its share."""

    nodes: int
    ranks: int
    device: Device
    gpus: Sequence[str] = ()


def node_launches(
    config: Path,
    out: Path,
    shape: NodeShape,
    *,
    port: int,
    cores: int,
    nccl_net: bool = False,
    nccl_log: Path | None = None,
    module: str = "slidedp",
) -> list[NodeLaunch]:
    """``shape``'s launchers for ``slidedp train CONFIG`` writing to ``out`` (rank 0 alone
    writes there), meeting at ``127.0.0.1:port`` (module docstring). ``module`` runs instead
    of ``slidedp`` (a test's wrapper of its CLI)."""
    nodes, ranks, device, gpus = shape.nodes, shape.ranks, shape.device, shape.gpus
    world = nodes * ranks
    if device == "cuda" and len(gpus) < world:
        raise ConfigError(
            f"{nodes} node(s) x {ranks} GPU(s) need {world} GPUs, this process sees "
            f"{len(gpus)} (CUDA_VISIBLE_DEVICES={','.join(gpus) or 'none'})"
        )
    if nccl_net and device != "cuda":
        raise ConfigError("the NCCL network transport needs CUDA (CPU ranks use gloo)")
    overrides = [
        f"output.dir={out}",
        f"runtime.nodes={nodes}",
        "runtime.master_addr=127.0.0.1",
        f"runtime.master_port={port}",
    ]
    env = {"OMP_NUM_THREADS": str(max(1, cores // nodes))}
    if device == "cuda":
        overrides += ["runtime.device=cuda", f"runtime.gpus={ranks}", "train.dtype=bfloat16"]
        overrides.append(f"runtime.update_threads={max(1, cores // world)}")
        if nccl_net:
            env |= NCCL_NET_ENV
        if nccl_log is not None:
            env |= {
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT",
                "NCCL_DEBUG_FILE": str(nccl_log / "nccl.%h.%p.log"),
            }
    else:
        overrides += [
            f"runtime.ranks={ranks}",
            f"runtime.update_threads={max(1, cores // (2 * world))}",
        ]
    command = [sys.executable, "-m", module, "train", str(config), *overrides]
    launches = []
    for n in range(nodes):
        node_env = dict(env)
        if device == "cuda":
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[n * ranks : (n + 1) * ranks])
        stderr = out.parent / f"{out.name}.node{n}.stderr"
        launches.append(NodeLaunch([*command, f"runtime.node_rank={n}"], node_env, stderr))
    return launches


def run_nodes(launches: Sequence[NodeLaunch], timeout_s: float) -> None:
    """Start every node, wait for all; a node that fails, or a run past ``timeout_s`` (a node
    hung: every collective times out sooner), is a ``ConfigError`` with the nodes' stderr."""
    procs = []
    for launch in launches:
        launch.stderr.parent.mkdir(parents=True, exist_ok=True)
        if "NCCL_DEBUG_FILE" in launch.env:
            Path(launch.env["NCCL_DEBUG_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        # files, not pipes: a node never blocks on them
        with launch.stderr.open("w") as err, open(os.devnull, "w") as quiet:
            procs.append(_start(launch, os.environ | launch.env, (quiet, err)))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        raise ConfigError(
            f"the {len(procs)}-node run did not finish in {timeout_s:g} s: a node hung "
            f"({_errors(launches)})"
        ) from None
    if any(p.returncode for p in procs):
        codes = [p.returncode for p in procs]
        raise ConfigError(f"the {len(procs)}-node run failed {codes}: {_errors(launches)}")


def _start(
    launch: NodeLaunch, env: dict[str, str], output: tuple[IO[str], IO[str]]
) -> ForkedRank | subprocess.Popen[bytes]:
    """A node's ``python -m MODULE ARGV`` through ``runtime.zygote.start_child`` (forked from
    the bench's zygote); any other command as it is."""
    python, flag, *rest = launch.argv
    if (python, flag) == (sys.executable, "-m") and rest:
        return start_child(rest[0], rest[1:], env, stdio=(None, *output))
    return subprocess.Popen(launch.argv, env=env, stdout=output[0], stderr=output[1])


def _errors(launches: Sequence[NodeLaunch]) -> str:
    """Each node's last words on stderr, and NCCL's warnings where its log went to files."""
    said = []
    for n, x in enumerate(launches):
        words = " ".join(x.stderr.read_text().split()[-60:]) or "(nothing on stderr)"
        if "NCCL_DEBUG_FILE" in x.env:
            warnings = _nccl_lines(Path(x.env["NCCL_DEBUG_FILE"]).parent, " NCCL WARN ")
            words += "".join(f" [{w}]" for w in warnings[:5])
        said.append(f"node {n}: {words}")
    return " | ".join(said)


def nccl_transports(nccl_log: Path) -> list[str]:
    """The transports NCCL connected with (``NET/Socket``, ``P2P/CUMEM``, ``SHM/direct``, ...)
    in the INFO logs of ``nccl_log``; empty when none was logged."""
    return sorted({m for line in _nccl_lines(nccl_log, " via ") for m in _VIA.findall(line)})


def _nccl_lines(nccl_log: Path, needle: str) -> list[str]:
    """The distinct lines of NCCL's logs in ``nccl_log`` that contain ``needle``, sorted."""
    lines: set[str] = set()
    for log in nccl_log.glob("nccl.*.log"):
        lines.update(x.strip() for x in log.read_text(errors="replace").splitlines() if needle in x)
    return sorted(lines)
