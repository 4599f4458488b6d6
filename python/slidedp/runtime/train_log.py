"""What ``slidedp train`` tells the user: a start-up banner, a line per logged step, a progress
bar on a terminal, ``OUTPUT/metrics.jsonl`` and the trackers.

``metrics.jsonl`` holds one object per step (whatever ``log_steps``), with ``tflops``
(``runtime.flops.FLOPS_FORMULA``) and ``mfu``, evaluations' ``eval_*``, and on logged steps the
host PSS of this node's ranks and of rank 0 (``runtime.node_pss``) and GPU reserved bytes; on
resume it keeps the records up to the resumed step. A line
every ``log_steps`` steps averages since the previous one (loss, grad_norm, lr, tokens/s,
TFLOP/s, MFU, exposed waits, memory, ETA). Fields in full: docs/logging.md.

Example::

    log = StepLog(out, flops_per_token=fpt, steps=LogSteps(total=100, start=0, every=10))
    log.step({"step": 1, "loss": 2.3, "tokens": 4096, "seq_len": 512, "step_time_s": 0.2, ...})
    log.close()
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from slidedp.io.resume import kept_records
from slidedp.runtime.flops import FLOPS_FORMULA
from slidedp.runtime.node_pss import NodePss, proc_kib

GIB = float(1 << 30)


def mem_available_bytes() -> int | None:
    return proc_kib("/proc/meminfo", "MemAvailable")


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass(frozen=True)
class RunFacts:
    """What the banner reports, gathered by the trainer."""

    model: str  # model type and path
    params: int
    layers: int
    ranks: int
    global_batch_size: int
    seq_len: int
    start_step: int
    max_steps: int
    resumed_from: str | None
    store_bytes: int
    pinned_bytes: int  # the store this rank page-locked on CUDA (its slots, the mirror's share)
    device: str
    dtype: str
    window: str  # the device window: slots and bytes
    policy: str  # Policy.describe()
    compute: str  # Policy.compute.describe(): the layer kernels, compiled or not
    isa: str
    threads: int
    peak_flops: float | None
    nodes: int = 1  # one host store each
    context_parallel: int = 1  # GPUs sharing each sequence: MFU divides by their summed peak
    startup: str = ""  # StartupClock.line(): how long each part of the build took

    def lines(self) -> list[str]:
        peak = (
            "MFU n/a (no measured peak on this device)"
            if self.peak_flops is None
            else f"MFU = model FLOP/s / {self.peak_flops / 1e12:.0f} TFLOP/s (measured bf16 GEMM)"
        )
        if self.peak_flops is not None and self.context_parallel > 1:
            peak += f" per GPU, x {self.context_parallel} GPUs computing each sequence"
        nodes = f" on {self.nodes} nodes (a host store each)" if self.nodes > 1 else ""
        steps = f"steps {self.start_step + 1}..{self.max_steps} of {self.max_steps}"
        resumed = f" (resumed from {self.resumed_from})" if self.resumed_from else ""
        return [
            f"slidedp train: {self.model}, {self.params:,} parameters, {self.layers} layers",
            f"  {self.ranks} rank(s){nodes}, {self.device} {self.dtype}, "
            f"<= {self.global_batch_size} x {self.seq_len} = "
            f"{self.global_batch_size * self.seq_len:,} tokens per step, {steps}{resumed}",
            f"  device window: {self.window}",
            f"  policy: {self.policy}",
            f"  layer compute: {self.compute}",
            f"  host memory: store {_gib(self.store_bytes)} (shared, in /dev/shm), "
            f"{_gib(mem_available_bytes())} still available; pinned {_gib(self.pinned_bytes)} "
            "(this rank's store slots and mirror)",
            f"  host kernels: {self.isa} path, {self.threads} thread(s)",
            f"  FLOPs per token: {FLOPS_FORMULA}; {peak}",
            *([self.startup] if self.startup else []),
        ]


class StepWriter(Protocol):
    """Where each step record goes besides metrics.jsonl (``runtime.trackers.Trackers``)."""

    def log_step(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LogMemory:
    """What a logged step's record says of memory: the host PSS of ``node_pids`` (this node's
    ranks; empty: this process alone) and of this process, and GPU reserved bytes on ``cuda``."""

    cuda: bool = False
    node_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LogSteps:
    """The run's steps as the log counts them: ``total`` (the last step's number), ``start``
    (the step resumed from; 0: a new run) and a line every ``every`` steps."""

    total: int
    start: int
    every: int


class StepLog:
    """Per-step records in, metrics.jsonl / TensorBoard / stdout out."""

    def __init__(
        self,
        out_dir: Path,
        *,
        flops_per_token: Callable[[int], float],
        steps: LogSteps,
        peak_flops: float | None = None,
        memory: LogMemory = LogMemory(),
        writer: StepWriter | None = None,
        stream: TextIO | None = None,
        batch_gpus: int = 1,
    ) -> None:
        """``peak_flops``: one GPU's; ``batch_gpus``: the GPUs that compute each record's tokens
        together (a context-parallel group splits one batch), whose peaks MFU sums."""
        self.flops_per_token, self.cuda = flops_per_token, memory.cuda
        self.peak_flops = None if peak_flops is None else peak_flops * batch_gpus
        self.total_steps, self.start_step = steps.total, steps.start
        self.log_steps = steps.every
        self.writer, self.stream = writer, stream
        self.tty = stream is not None and stream.isatty()
        self.start_s = time.perf_counter()
        self.interval: list[dict[str, Any]] = []
        self.skipped = 0
        path = out_dir / "metrics.jsonl"
        kept = kept_records(path, steps.start) if steps.start > 0 and path.is_file() else []
        self.metrics = path.open("w")
        self.metrics.writelines(line + "\n" for line in kept)
        self.pss = NodePss(memory.node_pids or (os.getpid(),))  # last: a thread to close

    def step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Enrich one step's record (see the module docstring), write and show it."""
        flops = self.flops_per_token(record["seq_len"]) * record["tokens"]
        record["tflops"] = round(flops / record["step_time_s"] / 1e12, 6)
        record["mfu"] = (
            None if self.peak_flops is None else flops / record["step_time_s"] / (self.peak_flops)
        )
        self.interval.append(record)
        self.skipped += bool(record.get("skipped"))
        logged = record["step"] % self.log_steps == 0 or record["step"] == self.total_steps
        logged = logged or "eval_loss" in record  # an evaluation always gets its line
        if logged:
            pss = self.pss.latest()
            record["host_pss_node_bytes"] = pss.node_bytes
            record["host_pss_rank0_bytes"] = pss.own_bytes
            if self.cuda:
                record["gpu_reserved_bytes"] = torch.cuda.memory_reserved()
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.writer is not None:
            self.writer.log_step(record)
        if logged:
            self.say(self._line(record))
            self.interval = []
        if self.tty:
            self._draw_bar(record["step"])
        return record

    def _eta_s(self, step: int) -> float:
        done = step - self.start_step
        return (time.perf_counter() - self.start_s) / max(done, 1) * (self.total_steps - step)

    def _line(self, last: dict[str, Any]) -> str:
        ran = [r for r in self.interval if not r.get("skipped")]
        seconds = sum(r["step_time_s"] for r in self.interval)
        tokens = sum(r["tokens"] for r in self.interval)
        flops = sum(r["tflops"] * r["step_time_s"] for r in self.interval) * 1e12
        waits = sum(v for r in self.interval for k, v in r.items() if k.startswith("wait_"))
        parts = [f"step {last['step']}/{self.total_steps}"]
        if ran:
            parts += [
                f"loss {sum(r['loss'] for r in ran) / len(ran):.4f}",
                f"grad_norm {ran[-1]['grad_norm']:.4f}",
            ]
        parts += [
            f"lr {last['lr']:.3e}",
            f"{tokens / seconds:,.0f} tok/s",
            f"{flops / seconds / 1e12:.3g} TFLOP/s",
            "MFU n/a"
            if self.peak_flops is None
            else f"MFU {100 * flops / seconds / self.peak_flops:.1f}%",
            f"waits {1000 * waits / len(self.interval):.0f} ms/step",
        ]
        if self.cuda:
            parts.append(f"GPU {_gib(last['gpu_reserved_bytes'])} reserved")
        pss = f"host PSS {_gib(last['host_pss_node_bytes'])}"
        if len(self.pss.pids) > 1:
            pss += f" ({len(self.pss.pids)} processes of this node; rank 0 "
            pss += f"{_gib(last['host_pss_rank0_bytes'])})"
        parts.append(pss)
        if "eval_loss" in last:
            parts.append(f"eval_loss {last['eval_loss']:.4f} ppl {last['eval_perplexity']:.2f}")
        if self.skipped:
            parts.append(f"{self.skipped} skipped")
        if last.get("skipped"):
            parts.append(f"this step skipped (non-finite {last['nonfinite']})")
        parts.append(f"ETA {_duration(self._eta_s(last['step']))}")
        return " | ".join(parts)

    def _draw_bar(self, step: int) -> None:
        assert self.stream is not None
        width = 30
        filled = width * step // self.total_steps
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total_steps} "
            f"{100 * step / self.total_steps:.0f}% ETA {_duration(self._eta_s(step))}"
        )
        self.stream.flush()

    def say(self, line: str) -> None:
        """A line of its own (over the bar on a terminal)."""
        if self.stream is not None:
            self.stream.write(("\r\x1b[K" if self.tty else "") + line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.stream is not None:
            self.stream.write("\n")  # the bar's last state stays on screen
        self.metrics.close()
        self.pss.close()
        if self.writer is not None:
            self.writer.close()
