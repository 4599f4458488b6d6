"""A ``slidedp.bench.worker`` child of ``slidedp bench train``, with its host memory: forked from
the bench's zygote (``runtime.zygote.start_child``; its imports already done, its age and PSS
counted as a fresh interpreter's), else a fresh interpreter.

A thread samples the PSS of the child's process tree every ``PSS_SAMPLE_S`` and keeps the peak
(over all ranks of a multi-rank run). A non-zero exit is a result with ``status`` ``error`` (or
``killed``), its last stderr line kept; a SIGKILL near the host's memory is host ``oom``.
``spec.host_limit_gib`` and ``spec.timeout_s`` kill the child's process group past the budget
(host ``oom``, ``timeout``). Invariant: however the run ends its process group is killed and
waited for (``lifetime.stop_group``), so the next system starts on a GPU no process still holds.

Example::

    result, peak_pss_bytes = run_child(spec, workdir)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from slidedp.bench.measure import RunSpec, process_pss_bytes, tree_pss_bytes
from slidedp.bench.report import GIB
from slidedp.envinfo import meminfo_bytes
from slidedp.runtime.lifetime import GROUP_EXIT_S, stop_group, worker_env
from slidedp.runtime.zygote import start_child

PSS_SAMPLE_S = 0.25
# A SIGKILL at this share of the host's memory is the kernel's OOM killer: the last samples
# before the kill see the tree just under MemTotal (page cache, the kernel and other processes
# hold the rest; measured 122.9 GiB of 125 GiB for ZeRO-3 on Qwen3-8B).
KERNEL_OOM_FRACTION = 0.9
WORKER = "slidedp.bench.worker"  # the module each run executes


class ChildRun:
    """One worker subprocess; a thread samples the PSS of its process tree until it exits."""

    def __init__(self, spec: RunSpec, workdir: Path) -> None:
        self.spec, stem = spec, spec.name
        self.spec_path, self.result_path = workdir / f"{stem}.spec", workdir / f"{stem}.json"
        self.stderr_path = workdir / f"{stem}.stderr"
        self.spec_path.write_text(json.dumps(spec.to_json()))
        self.peak_pss_bytes = 0
        self.count_root = spec.world == 1  # else the root is the launcher of the ranks
        self.host_limit_bytes = int(spec.host_limit_gib * GIB)
        self.killed_at_bytes = 0  # the PSS that passed the host limit (0: not killed)
        self.timeout_s = spec.timeout_s
        self.timed_out = False

    def run(self) -> tuple[int, dict[str, Any] | None, str]:
        """(exit code, result or None, stderr text)."""
        argv = [str(self.spec_path), str(self.result_path)]
        with self.stderr_path.open("w") as stderr:  # its own session: the tree killed as one
            proc = start_child(WORKER, argv, worker_env(), own_session=True,
                               stdio=(None, None, stderr))  # fmt: skip
            done = threading.Event()
            sampler = threading.Thread(target=self._sample, args=(proc.pid, done), daemon=True)
            sampler.start()
            try:
                code = proc.wait()
            finally:  # also on Ctrl-C of the bench: no rank outlives it
                done.set()
                sampler.join()
                survivors = stop_group(proc.pid)
        if survivors:
            print(
                f"slidedp bench train: warning: {self.spec.full_system}: processes {survivors} "
                f"still alive {GROUP_EXIT_S:g} s after SIGKILL; the next run may share the GPU "
                "with them",
                file=sys.stderr,
            )
        result = json.loads(self.result_path.read_text()) if code == 0 else None
        return code, result, self.stderr_path.read_text()

    def _sample(self, pid: int, done: threading.Event) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done.is_set():
            pss = tree_pss_bytes(pid) - (0 if self.count_root else process_pss_bytes(pid))
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            if self.host_limit_bytes and pss > self.host_limit_bytes:
                self.killed_at_bytes = pss
                _kill_group(pid)
                return
            if self.timeout_s and time.monotonic() > deadline:
                self.timed_out = True
                _kill_group(pid)
                return
            done.wait(PSS_SAMPLE_S)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group has exited
        os.killpg(pid, signal.SIGKILL)


def run_child(spec: RunSpec, workdir: Path) -> tuple[dict[str, Any], int]:
    """The worker's result and its sampled PSS peak; a crash becomes status error/killed."""
    child = ChildRun(spec, workdir)
    code, result, stderr = child.run()
    if child.killed_at_bytes:
        status = "oom"
        error = (
            f"host memory: PSS {child.killed_at_bytes / GIB:.1f} GiB passed --host-limit "
            f"{spec.host_limit_gib:g} GiB; killed"
        )
    elif child.timed_out:
        status, error = "timeout", f"ran past --system-timeout {spec.timeout_s:g} s; killed"
    elif result is None:
        where = f"batch {spec.batch}" + (f" on {spec.world} ranks" if spec.world > 1 else "")
        print(f"--- {spec.full_system} {where} exited {code}:\n{stderr}", file=sys.stderr)
        host_bytes = meminfo_bytes().get("mem_total_bytes", 0)
        status, error = crash_status(code, stderr, child.peak_pss_bytes, host_bytes)
    else:
        return result, child.peak_pss_bytes
    result = {"system": spec.full_system, "batch": spec.batch, "status": status, "error": error}
    return result, child.peak_pss_bytes


def crash_status(code: int, stderr: str, peak_pss_bytes: int, host_bytes: int) -> tuple[str, str]:
    """(status, error) of a worker that exited ``code`` without a result.

    A SIGKILL with the tree's PSS peak within ``KERNEL_OOM_FRACTION`` of the host's memory is
    the kernel's OOM killer: the run did not fit the host, status ``oom`` like ``--host-limit``
    (the last stderr line is then whatever the process was printing, not the cause). Another
    signal is ``killed`` and a non-zero exit ``error``, each with the last stderr line.
    """
    lines = [line for line in stderr.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no stderr"
    if code >= 0:
        return "error", last if lines else f"exit {code}, no stderr"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    if code == -signal.SIGKILL and peak_pss_bytes >= KERNEL_OOM_FRACTION * host_bytes > 0:
        return "oom", (
            f"host memory: killed by {name} at a PSS peak of {peak_pss_bytes / GIB:.1f} GiB of "
            f"the host's {host_bytes / GIB:.1f} GiB (the kernel's OOM killer); --host-limit "
            f"stops a run before it"
        )
    return "killed", f"killed by {name}; last stderr line: {last}"
