"""Several ranks on one host, one host state: the process group, the shared store, the data slice.

Every rank is one process (``slidedp.runtime.launch`` starts them, or ``torchrun``: both set
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``). Rank 0 creates the host
store and loads the weights once; it broadcasts the store's name through the process group and
the others attach (rank 0 stays in the group's barrier until they have). Rank ``r`` computes rows
``[r*B/R, (r+1)*B/R)`` of every global batch; the loss is the mean over the label tokens of the
whole global batch (the count is all-reduced first).

A group's update belongs to one rank, ``owner(group) = group % R`` (its UpdateWorker submits it
and publishes the version); every rank uses its own range of the store's staging and gradient
slots, so the store is created with ``R x`` the configured slot counts.

A failure on one rank poisons the store (every version waiter in every rank wakes with
``StorePoisonedError``) and exits the process; peers blocked in a collective get an error from the
process group, and a peer that hangs is killed by the launcher. Ranks that stop because a peer
failed exit with ``EXIT_PEER_FAILED`` without printing: the failing rank's error is shown once.

Example::

    ctx = Dist.from_env()                 # None without RANK/WORLD_SIZE in the environment
    if ctx is not None:
        ctx.init(torch.device("cpu"), timeout_s=60)
        store = ctx.share_store(lambda: HostStore.create(...))
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slidedp.config import RuntimeSection, TrainSection
from slidedp.data.batch import Batch
from slidedp.errors import (
    ConfigError,
    PeerFailedError,
    StorePoisonedError,
    UpdateFailedError,
    VersionTimeoutError,
)
from slidedp.store import HostStore

EXIT_PEER_FAILED = 3  # this rank stopped because another one failed (it prints nothing)
EXIT_STOPPED_WITH_PEERS = 4  # an agreed stop on a signal; rank 0 saved, printed and exits 2
_SHARED: list[HostStore] = []  # the stores this rank shares with its peers (poisoned on failure)


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int

    @staticmethod
    def from_env() -> Dist | None:
        """The rank this process is, from a launcher's environment; None when not launched."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return Dist(rank, world, int(os.environ.get("LOCAL_RANK", rank)))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def owner(self, group: int) -> int:
        """The rank that updates ``group`` and publishes its versions."""
        return group % self.world

    def init(self, device: torch.device, timeout_s: float) -> None:
        """Join the process group: NCCL on CUDA, gloo on CPU."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )

    def share_store(self, create: Callable[[], HostStore]) -> HostStore:
        """Rank 0 runs ``create`` (store + weights); the others attach by its name."""
        store = create() if self.main else None
        names = [store.name if store is not None else ""]
        dist.broadcast_object_list(names, src=0)
        if store is None:
            store = HostStore.attach(names[0])
        dist.barrier()  # rank 0 (the store's creator) stays alive until every rank attached
        _SHARED.append(store)
        return store

    def rows(self, batch: Batch) -> Batch:
        """This rank's rows of the global batch (same padded width as the whole batch)."""
        per = batch.input_ids.shape[0] // self.world
        part = slice(self.rank * per, (self.rank + 1) * per)
        pos = None if batch.position_ids is None else batch.position_ids[part]
        return Batch(batch.input_ids[part], batch.attention_mask[part], batch.labels[part], pos)


def finish() -> None:
    """A successful rank leaves together with the others: without the barrier rank 0 (host of
    the rendezvous store) can exit while a peer's NCCL watchdog still polls it."""
    if dist.is_initialized():
        collective(dist.barrier)
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum of ``values`` over the ranks (one small collective, float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    collective(lambda: dist.all_reduce(t))
    return [float(v) for v in t.cpu()]


def collective(op: Callable[[], object]) -> None:
    """Run a collective; its failure means a peer died or failed: ``PeerFailedError``."""
    try:
        op()
    except (RuntimeError, dist.DistError) as e:
        raise PeerFailedError(f"a collective failed, another rank stopped: {e}") from e


def is_poisoned(store: HostStore) -> bool:
    """Whether some rank declared the store failed (a zero-timeout wait that cannot succeed)."""
    try:
        store.wait_version(0, 2**32 - 1, 0.0)
    except StorePoisonedError:
        return True
    except VersionTimeoutError:
        return False
    return False


def fail(error: BaseException) -> bool:
    """This rank is failing with ``error``: wake every peer (poison the shared stores). Returns
    whether the error is only this rank's reaction to another rank's failure."""
    if isinstance(error, UpdateFailedError):  # this rank's worker poisoned the store itself
        by_peer = False
    else:
        by_peer = isinstance(error, StorePoisonedError | PeerFailedError) or any(
            is_poisoned(s) for s in _SHARED
        )
    for store in _SHARED:
        store.poison()
    return by_peer


def check_config(world: int, runtime: RuntimeSection, train: TrainSection) -> None:
    """What a run of ``world`` ranks needs from the config (checked before any rank starts)."""
    configured = runtime.world
    if configured not in (1, world):
        raise ConfigError(
            f"launched with {world} ranks but the config asks for {configured} "
            "(runtime.ranks/runtime.gpus): make them agree"
        )
    if train.global_batch_size % world:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by the "
            f"{world} ranks: set it to a multiple of {world}"
        )


def start(
    ctx: Dist, device: torch.device, runtime: RuntimeSection, train: TrainSection
) -> torch.device:
    """Checks the config against the launch, joins the process group; this rank's device."""
    check_config(ctx.world, runtime, train)
    device = rank_device(ctx, device.type)
    ctx.init(device, runtime.version_timeout_s)
    return device


def rank_device(ctx: Dist, device_type: str) -> torch.device:
    """This rank's device: its own GPU; on CPU the ranks share the cores."""
    if device_type == "cuda":
        return torch.device("cuda", ctx.local_rank)
    torch.set_num_threads(max(1, torch.get_num_threads() // ctx.world))
    return torch.device("cpu")
