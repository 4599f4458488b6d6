"""Several ranks on one node or several, one host state per node: groups, shared store, data slice.

One process per rank (``runtime.launch`` or ``torchrun``, the usual environment variables). A
node's local rank 0 creates its host store and loads the weights once; the node's other ranks
attach. Rank ``r`` of ``R`` computes rows ``[r*B/R, (r+1)*B/R)``; the loss is the mean over the
whole global batch's label tokens. With ``runtime.context_parallel: C`` the groups of C
consecutive ranks read the same rows (``R/C`` groups), each rank a shard of their tokens
(``runtime.context_parallel``). Invariants: a group's update belongs to local rank
``group % L`` of each node; across nodes the owners all-reduce their node's sum before the
update, so every node's host state stays identical; a failed rank poisons its node's store and
peers exit with ``EXIT_PEER_FAILED`` without printing (the failing rank's error shows once).

Example::

    ctx = Dist.from_env()                 # None without RANK/WORLD_SIZE in the environment
    ctx.init(torch.device("cpu"), timeout_s=60)  # where ctx is not None
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from slidedp.config import TrainConfig, TrainSection
from slidedp.config_runtime import RuntimeSection
from slidedp.data.batch import Batch
from slidedp.errors import (
    ConfigError,
    PeerFailedError,
    StorePoisonedError,
    UpdateFailedError,
)
from slidedp.plan.policy import effective_runtime, resident_ranks_message
from slidedp.runtime.context_parallel import ContextGroup
from slidedp.runtime.node_meet import config_facts, join
from slidedp.store import HostStore

EXIT_PEER_FAILED = 3  # this rank stopped because another one failed (it prints nothing)
EXIT_STOPPED_WITH_PEERS = 4  # an agreed stop on a signal; rank 0 saved, printed and exits 2
LAUNCHER_PID = "SLIDEDP_LAUNCHER_PID"  # set for the ranks runtime.launch starts
_SHARED: list[HostStore] = []  # the stores this rank shares with its peers (poisoned on failure)


def group_owner(group: int, local_world: int) -> int:
    """The local rank of ``local_world`` that updates ``group`` and publishes its versions:
    round-robin (the step-time model's update lanes take the same)."""
    return group % local_world


@dataclass
class Dist:
    rank: int  # over all nodes
    world: int  # ranks over all nodes
    local_rank: int
    local_world: int  # ranks of this node (they share one host store)
    # set by ``init``: this node's ranks, and the owners of this rank's groups on every node
    # (None: one node; the node's collectives then run in the default group)
    node_group: dist.ProcessGroup | None = field(default=None, repr=False)
    cross_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # runtime.context_parallel: consecutive ranks that split each row's tokens (set before
    # ``init``); ``init`` joins this rank's context group
    context_size: int = 1
    context_attention: Literal["auto", "ulysses", "allgather"] = "auto"  # runtime.context_attention
    context: ContextGroup | None = field(default=None, repr=False)
    # what every node must share (``node_meet.join``, set before ``init``): the device type
    # and the config's keys
    agree: dict[str, str] = field(default_factory=dict, repr=False)

    @staticmethod
    def from_env() -> Dist | None:
        """The rank this process is, from a launcher's environment; None when not launched."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % local_world or rank % local_world != local_rank:
            raise ConfigError(
                f"rank {rank} of {world} is local rank {local_rank} of {local_world}: slidedp "
                "needs the same number of ranks on every node, numbered node by node "
                "(as torchrun and slidedp train launch them)"
            )
        return Dist(rank, world, local_rank, local_world)

    @property
    def main(self) -> bool:
        """Global rank 0: prints, checks, writes the checkpoints."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return self.world // self.local_world

    @property
    def node(self) -> int:
        return self.rank // self.local_world

    def owner(self, group: int) -> int:
        """The local rank that updates ``group`` and publishes its versions on every node."""
        return group_owner(group, self.local_world)

    def owns(self, group: int) -> bool:
        return self.owner(group) == self.local_rank

    @property
    def data_world(self) -> int:
        """Groups that read different rows (ranks / context_parallel)."""
        return self.world // self.context_size

    def node_rank_of(self, local_rank: int) -> int:
        """The global rank of this node's ``local_rank``."""
        return self.node * self.local_world + local_rank

    def init(self, device: torch.device, timeout_s: float, *, host_sum: bool = False) -> None:
        """Join the process group: NCCL on CUDA, gloo on CPU; with several nodes, the node and
        cross groups too (gloo cross groups with ``host_sum``: they sum host memory)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        # several nodes meet and compare their launch and config first (one line, not a hang)
        store = join(self, timeout_s, self.agree) if self.nodes > 1 else None
        try:
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                store=store,
                rank=self.rank,
                world_size=self.world,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
        except (dist.DistNetworkError, dist.DistStoreError) as e:  # one line, not c10d's frames
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise ConfigError(
                f"rank {self.rank} could not join the run's ranks at {where} within "
                f"{timeout_s:g} s ({str(e).splitlines()[0]}): start every node, check "
                "runtime.master_addr/master_port and that the port is reachable"
            ) from None
        if self.context_size > 1:
            r = self.context_size
            groups = [list(range(g * r, (g + 1) * r)) for g in range(self.world // r)]
            mine = self._member_of(groups, timeout, None)
            self.context = ContextGroup(self.rank % r, r, mine, self.context_attention)
        if self.nodes == 1:
            return
        L, N = self.local_world, self.nodes
        nodes = [[n * L + lr for lr in range(L)] for n in range(N)]
        cross = [[n * L + lr for n in range(N)] for lr in range(L)]
        self.node_group = self._member_of(nodes, timeout, None)
        self.cross_group = self._member_of(cross, timeout, "gloo" if host_sum else None)

    def new_node_group(self, timeout_s: float) -> dist.ProcessGroup:
        """Another group of this node's ranks (every rank of every node calls it, in the same
        order): a communicator of its own, whose collectives never queue behind the default
        group's (NCCL runs one group's collectives in the order they were issued)."""
        L = self.local_world
        nodes = [[n * L + lr for lr in range(L)] for n in range(self.nodes)]
        return self._member_of(nodes, datetime.timedelta(seconds=timeout_s), None)

    def _member_of(
        self, groups: list[list[int]], timeout: datetime.timedelta, backend: str | None
    ) -> dist.ProcessGroup:
        """Creates every group of ``groups`` (every rank creates every group, in the same
        order: torch.distributed's rule); the one this rank is in."""
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if self.rank in ranks:
                mine = group
        assert isinstance(mine, dist.ProcessGroup), f"rank {self.rank} is in no group"
        return mine

    def share_store(self, create: Callable[[], HostStore]) -> HostStore:
        """The node's local rank 0 runs ``create`` (store + weights); the others attach by its
        name."""
        store = create() if self.local_rank == 0 else None
        names = [store.name if store is not None else ""]
        dist.broadcast_object_list(names, src=self.node_rank_of(0), group=self.node_group)
        if store is None:
            store = HostStore.attach(names[0])
        dist.barrier(group=self.node_group)  # the creator stays alive until every rank attached
        _SHARED.append(store)
        return store

    def node_pids(self) -> list[int]:
        """The process ids of this node's ranks, by local rank, then their launcher's (the
        ranks' parent, when ``runtime.launch`` started them): the run's processes on this
        node. One collective in the node's group (every rank calls it, once, at start)."""
        pids: list[int | None] = [None] * self.local_world
        collective(lambda: dist.all_gather_object(pids, os.getpid(), group=self.node_group))
        launcher = [int(os.environ[LAUNCHER_PID])] if LAUNCHER_PID in os.environ else []
        return [int(pid) for pid in pids if pid is not None] + launcher

    def across_nodes(self, t: torch.Tensor) -> None:
        """Sum ``t`` (an owner's node-summed gradient) over the owners on every node, in place."""
        if self.cross_group is not None:
            collective(lambda: dist.all_reduce(t, group=self.cross_group))

    def rows(self, batch: Batch) -> Batch:
        """This rank's rows of the global batch (same padded width as the whole batch); the
        ranks of one context group read the same rows."""
        per = batch.input_ids.shape[0] // self.data_world
        group = self.rank // self.context_size
        part = slice(group * per, (group + 1) * per)
        pos = None if batch.position_ids is None else batch.position_ids[part]
        return Batch(batch.input_ids[part], batch.attention_mask[part], batch.labels[part], pos)


def finish() -> None:
    """A successful rank leaves together with the others: without the barrier rank 0 (host of
    the rendezvous store) can exit while a peer's NCCL watchdog still polls it."""
    if dist.is_initialized():
        collective(dist.barrier)
        dist.destroy_process_group()


def all_reduce_sum(
    values: list[float], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Sum of ``values`` over the ranks of ``group`` (default: all; one small collective,
    float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    collective(lambda: dist.all_reduce(t, group=group))
    return [float(v) for v in t.cpu()]


def all_reduce_tensor(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum ``t`` (on this rank's device) over the ranks of ``group`` (default: all), in place."""
    collective(lambda: dist.all_reduce(t, group=group))


def collective(op: Callable[[], object]) -> None:
    """Run a collective; its failure means a peer died or failed: ``PeerFailedError``."""
    try:
        op()
    except (RuntimeError, dist.DistError) as e:
        raise PeerFailedError(f"a collective failed, another rank stopped: {e}") from e


def fail(error: BaseException) -> bool:
    """This rank is failing with ``error``: wake every peer (poison the shared stores). Returns
    whether another rank reports the failure: ``error`` is a reaction to a peer's, or another
    rank's failure claimed the node's store first (several ranks failing together print one
    line). The first store shared (the host store) decides, in every process: a failure's
    poison of it is an atomic claim (the update worker's too); a reaction's claims nothing,
    so it never silences a failure that comes after it."""
    reaction = isinstance(error, StorePoisonedError | PeerFailedError)
    claims = not reaction and not isinstance(error, UpdateFailedError)  # the worker claimed
    first = [store.poison(claim=claims and i == 0) for i, store in enumerate(_SHARED)]
    if reaction:
        return True
    if isinstance(error, UpdateFailedError):
        return not error.first
    return bool(first) and not first[0]


def check_nodes_agree(ctx: Dist, facts: Callable[[], dict[str, str]]) -> None:
    """Several nodes start from the same state: each node's local rank 0 reports ``facts()``
    (``node_meet.start_facts``: the start step, the data, a checksum of the weights it
    loaded); rank 0 raises a ``ConfigError`` naming the first that differs from node 0's, the
    others wait for it to exit (and stop as its peers). Every node reads its own model, data
    and checkpoint files. ``facts`` is called on the nodes' local rank 0 only, never on one
    node (the checksum reads the whole master)."""
    if ctx.nodes == 1:
        return
    gathered: list[dict[str, str] | None] = [None] * ctx.world
    mine = facts() if ctx.local_rank == 0 else None
    collective(lambda: dist.all_gather_object(gathered, mine))
    reports = [f for f in gathered if f is not None]
    for node, report in enumerate(reports[1:], start=1):
        differs = [k for k in reports[0] if report.get(k) != reports[0][k]]
        if not differs:
            continue
        if not ctx.main:
            collective(dist.barrier)  # fails once rank 0 has exited with the error below
        key = differs[0]
        raise ConfigError(
            f"node {node}'s {key} is {report[key]}, node 0's {reports[0][key]}: every node "
            "must see the same model.path, data files (path, sources, eval_path) and output.dir "
            "checkpoints (a shared filesystem, or identical copies)"
        )


def check_config(
    local_world: int, runtime: RuntimeSection, train: TrainSection, *, nodes: int = 1
) -> None:
    """What a run of ``nodes`` nodes of ``local_world`` ranks needs from the config (checked
    before any rank starts, and by each rank against its launch)."""
    configured = runtime.launch.world
    if configured not in (1, local_world):
        raise ConfigError(
            f"launched with {local_world} ranks per node but the config asks for {configured} "
            "(runtime.ranks/runtime.gpus): make them agree"
        )
    if runtime.launch.nodes not in (1, nodes):
        raise ConfigError(
            f"launched on {nodes} nodes but the config asks for "
            f"runtime.nodes={runtime.launch.nodes}: "
            "make them agree"
        )
    world = local_world * nodes
    context = runtime.launch.context_parallel
    if world % context:
        raise ConfigError(
            f"runtime.context_parallel={context} does not divide the {world} ranks: set it to a "
            f"divisor of {world}"
        )
    message = resident_ranks_message(
        runtime if runtime.autopolicy.policy == "auto" else effective_runtime(runtime), world
    )
    if message is not None:
        raise ConfigError(message)
    groups = world // context  # each context group reads its own rows
    if train.global_batch_size % groups:
        what = f"{world} ranks ({nodes} nodes x {local_world})"
        if context > 1:
            what = f"{groups} groups of runtime.context_parallel={context} ranks"
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by the "
            f"{what}: set it to a multiple of {groups}"
        )


def start(ctx: Dist, device: torch.device, cfg: TrainConfig) -> torch.device:
    """Checks the config against the launch, joins the process groups (several nodes: once
    they agree on the config); this rank's device."""
    runtime = cfg.runtime
    check_config(ctx.local_world, runtime, cfg.train, nodes=ctx.nodes)
    device = rank_device(ctx, device.type)
    if ctx.nodes > 1:
        ctx.agree = {"device": device.type} | config_facts(cfg)

    # the route the engine will run: a policy file's grad_route counts (the host sum needs
    # gloo cross groups, NCCL refuses host memory)
    route = effective_runtime(runtime).layout.grad_route
    ctx.context_size = runtime.launch.context_parallel
    ctx.context_attention = runtime.launch.context_attention
    ctx.init(device, runtime.launch.version_timeout_s, host_sum=route == "cpu")
    return device


def rank_device(ctx: Dist, device_type: str) -> torch.device:
    """This rank's device: its own GPU; on CPU the node's ranks share its cores."""
    if device_type == "cuda":
        return torch.device("cuda", ctx.local_rank)
    torch.set_num_threads(max(1, torch.get_num_threads() // ctx.local_world))
    return torch.device("cpu")
