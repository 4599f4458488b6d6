"""Several nodes meet, and check before training that they run the same thing.

``join(ctx, timeout_s, facts)`` is the store the process group is built on (``Dist.init``):
global rank 0 hosts it at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent does when torchrun
started the ranks), every rank reports its node, its launch and ``facts`` (``config_facts``: the
resolved config keys that must agree), and rank 0 compares each report with its own as it
arrives and publishes a verdict. A node started with another config or launch, twice, late or
never is one line on every node within ``runtime.version_timeout_s`` (exit 2), never c10d's
timeouts. ``start_facts``: what the nodes compare once loaded (``dist.check_nodes_agree``).

Example::

    store = join(ctx, 600.0, {"device": "cpu"} | config_facts(cfg))
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # public, not in its stubs
    PrefixStore,
    Store,
    TCPStore,
)

from slidedp.config import TrainConfig, config_to_dict
from slidedp.errors import ConfigError, PeerFailedError
from slidedp.plan.policy import effective_runtime

if TYPE_CHECKING:
    from slidedp.data.batches import Batches
    from slidedp.runtime.dist import Dist
    from slidedp.runtime.trainer import Trainer

POLL_S = 0.05  # how often rank 0 looks for reports, and the others for its verdict
VERDICT_GRACE_S = 10.0  # a rank waits this much longer for the verdict than rank 0 for reports
HEARD_S = 5.0  # rank 0 waits at most this long for the ranks to read its refusal

# Config keys each node may set its own way (flat names, as config_to_dict's):
PER_NODE = frozenset(
    {
        # each node's own copy: the weights and the tokenized data are compared once loaded
        "model.path", "data.path", "data.eval_path", "data.sources",
        "train.resume",  # a path on this node: the start step and the weights are compared
        "train.verify_checksums",  # how carefully this node reads its own files
        # global rank 0 alone writes these; tensorboard's default is what the node installed
        "output.dir", "output.tensorboard", "output.report_to",
        # where this node is and how it reaches node 0 (the meeting proves the port)
        "runtime.node_rank", "runtime.master_addr", "runtime.master_port",
        # compared as launched (torchrun leaves them at 1) and resolved (auto is cuda on GPUs)
        "runtime.nodes", "runtime.ranks", "runtime.gpus", "runtime.device",
        "runtime.update_threads", "runtime.kernel_warmup",  # the node's cores; when it compiles
        "runtime.trace_path", "runtime.trace_step",  # this node's own trace
        # how a layout is chosen (several nodes keep the fixed one): the layout keys are compared
        "runtime.policy", "runtime.policy_validate_steps", "runtime.policy_calibrate_steps",
        "runtime.policy_force",
    }
)  # fmt: skip
HINTS = {  # how to fix a difference of these facts (any other: the config's)
    "ranks per node": "start every node with the same runtime.gpus/runtime.ranks (torchrun: "
    "--nproc-per-node)",
    "runtime.nodes": "start every node with the same runtime.nodes (torchrun: --nnodes)",
}


def config_facts(cfg: TrainConfig) -> dict[str, str]:
    """The resolved config keys every node must share (``PER_NODE`` left out), as JSON."""
    resolved = dataclasses.replace(cfg, runtime=effective_runtime(cfg.runtime))
    return {
        f"{section}.{key}": json.dumps(value, sort_keys=True)
        for section, keys in config_to_dict(resolved).items()
        for key, value in keys.items()
        if f"{section}.{key}" not in PER_NODE
    }


def start_facts(trainer: Trainer) -> dict[str, str]:
    """What every node must start from alike once loaded: the step, the tokenized data (its
    counts and a hash of its tokens, not its path: copies elsewhere are the same data) and a
    checksum of the loaded weights."""
    master = trainer.engine.kernels.sum_squares(trainer.store.region("master"))
    held = None if trainer.evaluator is None else trainer.evaluator.data
    return (
        {"start step": str(trainer.progress.step)}
        | _data_facts("data", trainer.data)
        | ({} if held is None else _data_facts("held-out data", held))
        | {"weights checksum": f"{master:.12g}"}  # any thread split agrees
    )


def _data_facts(name: str, data: Batches) -> dict[str, str]:
    """``data``'s counts and a hash of its tokens (not its files' paths)."""
    counts = dataclasses.asdict(data.report)
    tokens = hashlib.blake2b(digest_size=16)
    for part in (data.samples.tokens, data.samples.trained, data.samples.offsets):
        tokens.update(part.tobytes())
    return {f"{name} {k}": str(v) for k, v in counts.items() if k not in ("path", "sources")} | {
        f"{name} tokens (hash)": tokens.hexdigest()[:16]
    }


def join(ctx: Dist, timeout_s: float, facts: dict[str, str]) -> Store:
    """The run's store, once every node joined with the same ``facts`` (see the module)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + timeout_s
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
    if ctx.rank == 0 and not agent:
        store = _host(addr, port, timeout_s)
    else:
        store = _client(ctx.rank, addr, port, timeout_s, deadline)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's agent store lives on
    meeting = PrefixStore(f"slidedp-meet-{restart}", store)
    launch = {"runtime.nodes": str(ctx.nodes), "ranks per node": str(ctx.local_world)}
    mine = {"rank": ctx.rank, "node": ctx.node, "facts": launch | facts}
    try:
        arrival = meeting.add("arrived", 1)
        meeting.set(f"report-{arrival}", json.dumps(mine))
        if ctx.main:
            verdict = _reports_verdict(meeting, mine, ctx.world, ctx.nodes, timeout_s, deadline)
            meeting.set("verdict", verdict)
            if verdict:  # the store ends with this process: every rank that joined hears it
                _await_hearers(meeting)
        else:
            verdict = _await_verdict(meeting, timeout_s + VERDICT_GRACE_S)
            meeting.add("heard", 1)
            if not verdict and arrival > ctx.world:  # the ranks met without it: a copy
                raise ConfigError(
                    f"rank {ctx.rank} joined after all {ctx.world} ranks had met (node "
                    f"{ctx.node} started twice?): start each node once, with its own "
                    "runtime.node_rank"
                )
    except dist.DistError as e:  # node 0 left: it says why
        raise PeerFailedError(f"node 0 left while the nodes met: {e}") from None
    except BaseException:  # this rank leaves (a timeout, a signal): rank 0 must not go on
        with contextlib.suppress(dist.DistError):
            meeting.add("left", 1)
        raise
    if verdict:  # each node's local rank 0 says it, its other ranks stop as peers
        raise ConfigError(verdict) if ctx.local_rank == 0 else PeerFailedError(verdict)
    return store


def _host(addr: str, port: int, timeout_s: float) -> Store:
    """Node 0's store, listening at ``port`` (it waits for no one: ``join`` counts them)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:  # it listens on every interface; its own client needs no route to master_addr
        return TCPStore("127.0.0.1", port, is_master=True, timeout=timeout,
                        wait_for_workers=False, multi_tenant=True)  # fmt: skip
    except dist.DistError as e:
        if "EADDRINUSE" in str(e):
            raise ConfigError(
                f"runtime.master_port {port} is in use on node 0 (another run, or node 0 "
                "started twice): choose another port"
            ) from None
        raise ConfigError(
            f"node 0 cannot listen at {addr}:{port} ({str(e).splitlines()[0]}): check "
            "runtime.master_addr/master_port"
        ) from None


def _client(rank: int, addr: str, port: int, timeout_s: float, deadline: float) -> Store:
    """A client of node 0's store, within ``deadline``: a plain TCP connect first (c10d's own
    retries log pages of C++ frames), then c10d's handshake on a thread (against a listener
    that is not a store it waits forever)."""
    where = f"{addr}:{port}"
    _reach(addr, port, deadline, f"rank {rank} could not join the run's ranks at {where} "
           f"within {timeout_s:g} s")  # fmt: skip
    made: list[Store | BaseException] = []

    def connect() -> None:
        try:
            left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
            made.append(TCPStore(addr, port, is_master=False, timeout=left))
        except BaseException as e:  # handed to the caller
            made.append(e)

    thread = threading.Thread(target=connect, name="slidedp-store-connect", daemon=True)
    thread.start()
    thread.join(max(1.0, deadline - time.monotonic()))
    if made and isinstance(made[0], Store):
        made[0].set_timeout(datetime.timedelta(seconds=timeout_s))  # the group's, not what was left
        return made[0]
    why = "it did not answer as node 0's store" if not made else str(made[0]).splitlines()[0]
    raise ConfigError(
        f"rank {rank} could not join the run's ranks at {where} within {timeout_s:g} s ({why}): "
        "check runtime.master_addr/master_port (another program may listen there)"
    )


def _reach(addr: str, port: int, deadline: float, failed: str) -> None:
    """Wait until ``addr:port`` accepts a TCP connection; ``failed`` then the reason past
    ``deadline``."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"{failed} ({e.strerror or e}): start every node, check "
                    "runtime.master_addr/master_port and that the port is reachable"
                ) from None
        time.sleep(0.2)


def _reports_verdict(
    meeting: Store,
    mine: dict[str, Any],
    world: int,
    nodes: int,
    timeout_s: float,
    deadline: float,
) -> str:
    """Rank 0: each rank's report as it arrives compared with ``mine``; the refusal's line,
    or "" once all ``world`` ranks joined alike."""
    joined: dict[int, int] = {}  # rank -> node
    read = 0
    while True:
        left = meeting.add("left", 0)  # read first: a rank reports before it can leave
        while read < meeting.add("arrived", 0) and meeting.check([f"report-{read + 1}"]):
            read += 1
            report = json.loads(meeting.get(f"report-{read}"))
            problem = _differs(report, mine)
            if problem is None and report["rank"] in joined:
                problem = (f"rank {report['rank']} joined twice (node {report['node']} "
                           "started twice?): start each node once, with its own "
                           "runtime.node_rank")  # fmt: skip
            if problem is not None:
                return problem
            joined[report["rank"]] = report["node"]
        if left:
            return ("a rank left while the nodes met (stopped, or its runtime.version_timeout_s "
                    "ran out): start every node again")  # fmt: skip
        if len(joined) == world:
            return ""
        if time.monotonic() >= deadline:
            per_node = world // nodes
            whole = [n for n in range(nodes) if list(joined.values()).count(n) == per_node]
            late = [n for n in range(nodes) if n not in whole]
            return (
                f"waited {timeout_s:g} s (runtime.version_timeout_s), {len(whole)} of {nodes} "
                f"nodes joined: start node {late[0]} (runtime.node_rank={late[0]}) and check "
                "that its runtime.master_addr/master_port reach node 0"
            )
        time.sleep(POLL_S)


def _differs(report: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """The line naming the first fact of ``report`` (another node's) that is not ``mine``."""
    theirs, ours = report["facts"], mine["facts"]
    for key, value in ours.items():
        if theirs.get(key) != value:
            hint = HINTS.get(key, "start every node with the same config")
            return (f"node {report['node']}'s {key} is {theirs.get(key, '(not set)')}, node "
                    f"{mine['node']}'s {value}: {hint}")  # fmt: skip
    return None


def _await_verdict(meeting: Store, wait_s: float) -> str:
    """Rank 0's verdict ("" to go on), within ``wait_s``."""
    end = time.monotonic() + wait_s
    while not meeting.check(["verdict"]):
        if time.monotonic() >= end:
            raise ConfigError(
                f"node 0 did not say within {wait_s:g} s whether every node joined: look at node "
                "0's log"
            )
        time.sleep(POLL_S)
    return bytes(meeting.get("verdict")).decode()


def _await_hearers(meeting: Store) -> None:
    """Rank 0: until every other rank that joined read the verdict (``HEARD_S`` at most)."""
    end = time.monotonic() + HEARD_S
    while meeting.add("heard", 0) < meeting.add("arrived", 0) - 1 and time.monotonic() < end:
        time.sleep(POLL_S)
