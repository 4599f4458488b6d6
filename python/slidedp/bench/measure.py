"""What every system of ``slidedp bench train`` shares: the run spec, synthetic tokens, step
timing with warm-up discarded, and the host memory (PSS) of a process tree.

Each system runs in its own subprocess (``slidedp.bench.worker``) so that GPU peak reserved and
host PSS belong to that system alone; the parent samples the PSS of the child's process tree
(``/proc/PID/smaps_rollup``; PSS charges a shared page to each of its users in proportion, so
the host store, shared memory, is counted once).

Example::

    times = timed_steps(lambda step: train_step(step), warmup=3, steps=5, device=device)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from slidedp.runtime.lanes import synchronize


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One system at one batch size; crosses the process boundary as JSON."""

    system: str  # ours | reference | fsdp2 | a peer (bench.peers) | collectives | peak
    config_dir: str  # holds the model's config.json (random init from it)
    batch: int  # sequences per rank and step: the global batch is batch x world / context
    seq_len: int
    warmup: int  # steps run first and discarded
    steps: int  # steps measured
    device: str  # cpu | cuda
    seed: int = 0
    ours: dict[str, Any] = field(default_factory=dict)  # our resolved config (all sections)
    world: int = 1  # ranks (GPUs, or CPU processes); > 1: the worker launches them
    layer_numel: int = 0  # collectives: elements of the model's largest decoder layer
    gpu_limit_gib: float = 0.0  # > 0: each rank's CUDA allocator is capped there (worker)
    host_limit_gib: float = 0.0  # > 0: the run is killed, as OOM, when its PSS passes it (child)
    timeout_s: float = 0.0  # > 0: the run is killed past it and reported as a timeout (child)
    peer: dict[str, Any] = field(default_factory=dict)  # a peer's config overrides (--peer-set)
    variant: str = ""  # LABEL of --systems SYSTEM:LABEL: runs as ``system``, with its own ``peer``
    # ours on several ranks with runtime.policy=auto choosing the routes too (--routes auto)
    auto_routes: bool = False
    # ours on several ranks: the launcher's plan (``Plan.to_json`` file) every rank runs
    plan_file: str = ""
    # ours on several ranks: ranks that split each row (runtime.context_parallel); ``batch``
    # is then each group's rows
    context: int = 1
    # ours starts from this model directory's safetensors (``--shape DIR`` with weights: the
    # time to the first step of a real model); every other system from ``config_dir``
    weights_dir: str = ""

    @property
    def global_batch(self) -> int:
        return self.batch * self.world // self.context

    @property
    def full_system(self) -> str:
        """The system as ``--systems`` names it, and the report: SYSTEM or SYSTEM:LABEL."""
        return f"{self.system}:{self.variant}" if self.variant else self.system

    @property
    def name(self) -> str:
        """Unique within one bench run: system, batch, and for several ranks world and routes."""
        name = f"{self.full_system}-b{self.batch}"
        if self.world > 1:
            name += f"-x{self.world}"
            if self.system == "ours" and self.auto_routes:
                name += "-auto"
            elif self.system == "ours":
                runtime = self.ours["runtime"]
                name += f"-{runtime['param_route']}-{runtime['grad_route']}"
            if self.context > 1:
                name += f"-cp{self.context}"
        return name

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RunSpec:
        return cls(**raw)


def synthetic_tokens(
    vocab_size: int, batch: int, seq_len: int, steps: int, seed: int
) -> torch.Tensor:
    """[steps, batch, seq_len] uniform random token ids, the same for every system."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (steps, batch, seq_len), generator=gen)


def timed_steps(
    step: Callable[[int], object], *, warmup: int, steps: int, device: torch.device
) -> list[float]:
    """Wall seconds of each measured call ``step(t)`` (device synchronised before and after
    each, so queued GPU work is inside the interval it was issued in); warm-up not returned."""
    times: list[float] = []
    for t in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step(t)
        synchronize(device)
        if t >= warmup:
            times.append(time.perf_counter() - start)
    return times


def process_pss_bytes(pid: int) -> int:
    """PSS of one process, its anonymous memory counted whole (0 if it is gone or unreadable):
    a process forked from a zygote shares the pages of its imports copy-on-write, which a fresh
    interpreter would hold alone (for one, ``Anonymous`` is ``Pss_Anon``); files and shared
    memory (the ranks' store) stay split between the processes that map them."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    kib = {
        k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in text.splitlines()[1:])
    }
    return (kib.get("Pss", 0) - kib.get("Pss_Anon", 0) + kib.get("Anonymous", 0)) * 1024


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now (from ``/proc/*/task/*/children``)."""
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except (FileNotFoundError, ProcessLookupError):
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            tree.extend(children)
            frontier.extend(children)
    return tree


def tree_pss_bytes(pid: int) -> int:
    """PSS summed over ``pid``'s process tree."""
    return sum(process_pss_bytes(p) for p in process_tree(pid))


GPU_MEMORY_KEYS = ("gpu_peak_reserved_bytes", "gpu_peak_allocated_bytes", "gpu_alloc_retries")


def gpu_memory(device: torch.device) -> dict[str, int | None]:
    """Peak reserved/allocated bytes of this process on ``device`` and the caching allocator's
    retries (a failed ``cudaMalloc`` that freed every cached block and tried again: a run at
    the edge of the device's memory, each retry a synchronising pass); None on CPU."""
    if device.type != "cuda":
        return dict.fromkeys(GPU_MEMORY_KEYS)
    stats = torch.cuda.memory_stats(device)
    return {
        "gpu_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "gpu_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "gpu_alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }
