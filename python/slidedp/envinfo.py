"""What ``slidedp env`` reports: versions, the host-kernel ISA path, CPU, memory, shm, GPUs, links.

Run: ``slidedp env`` (text) or ``slidedp env --json`` (the same facts as one JSON object).

Everything a bug report or a capacity question needs from the machine: the host store lives in
``/dev/shm`` and must fit ``MemAvailable``; pinning it is bounded by ``ulimit -l``; the host
kernels run the ISA path printed here. GPU facts come from torch (no CUDA: an empty list) and the
link matrix from ``nvidia-smi topo -m`` when there are several GPUs and the tool is installed.

Example::

    info = collect()
    print(format_text(info))
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch
import transformers

from slidedp import __version__
from slidedp.kernels import Kernels, default_threads

_GIB = 2**30
_NVIDIA_SMI_TIMEOUT_S = 10.0  # a wedged driver must not hang `slidedp env`


def meminfo_bytes() -> dict[str, int]:
    """MemTotal and MemAvailable of /proc/meminfo, in bytes (absent keys left out)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    wanted = {"MemTotal:": "mem_total_bytes", "MemAvailable:": "mem_available_bytes"}
    return {wanted[f[0]]: int(f[1]) * 1024 for f in map(str.split, lines) if f and f[0] in wanted}


def _shm(path: str = "/dev/shm") -> dict[str, Any] | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return {
        "path": path,
        "size_bytes": stat.f_blocks * stat.f_frsize,
        "free_bytes": stat.f_bavail * stat.f_frsize,
    }


def address_space_left_bytes() -> int | None:
    """What ``ulimit -v`` (RLIMIT_AS) leaves this process to map beyond what it maps now, in
    bytes; None: unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text().split()
        mapped = int(status[status.index("VmSize:") + 1]) * 1024
    except (OSError, ValueError, IndexError):
        mapped = 0
    return max(soft - mapped, 0)


def file_size_limit_bytes() -> int | None:
    """``ulimit -f`` (RLIMIT_FSIZE) in bytes: the largest file this process may write (the
    host store's file in /dev/shm, a checkpoint's); None: unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _memlock_limit_bytes() -> int | None:
    """``ulimit -l`` in bytes; None means unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def nvidia_smi(*args: str) -> str | None:
    """``nvidia-smi ARGS`` output, or None where the tool is absent, fails or hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 and done.stdout.strip() else None


def _gpus() -> tuple[list[dict[str, Any]], dict[str, str | None]]:
    cuda = {"cuda": torch.version.cuda, "driver": None, "nccl": None}
    if not torch.cuda.is_available():
        return [], cuda
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": props.name,
                "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}",
            }
        )
    driver = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    cuda["driver"] = driver.splitlines()[0] if driver else None
    cuda["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    return gpus, cuda


def collect() -> dict[str, Any]:
    """Every fact as plain JSON-able values (bytes as integers)."""
    gpus, cuda = _gpus()
    return {
        "versions": {
            "slidedp": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **cuda,
        },
        "host_kernels": {
            "isa": Kernels.detect_isa(),
            "supported_isas": Kernels.supported_isas(),
            "threads": default_threads(),
        },
        "cpu": {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))},
        "kernel": platform.release(),
        "memory": meminfo_bytes(),
        "shm": _shm(),
        "memlock_limit_bytes": _memlock_limit_bytes(),
        "gpus": gpus,
        "gpu_links": nvidia_smi("topo", "-m") if len(gpus) > 1 else None,
    }


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / _GIB:.1f} GiB"


def format_text(info: dict[str, Any]) -> str:
    """The human report: one line per topic, then the GPU link matrix if there is one."""
    v, k, mem, shm = info["versions"], info["host_kernels"], info["memory"], info["shm"]
    cuda = f", CUDA {v['cuda']}" if v["cuda"] else ", torch without CUDA"
    driver = f", driver {v['driver']}" if v["driver"] else ""
    nccl = f", NCCL {v['nccl']}" if v["nccl"] else ""
    memlock = info["memlock_limit_bytes"]
    lines = [
        f"slidedp {v['slidedp']}, Python {v['python']}, torch {v['torch']}, "
        f"transformers {v['transformers']}{cuda}{driver}{nccl}",
        f"host kernels: ISA {k['isa']} (supported: {', '.join(k['supported_isas'])}), "
        f"{k['threads']} threads",
        f"CPU: {info['cpu']['cores']} cores ({info['cpu']['usable_cores']} usable), "
        f"Linux {info['kernel']}",
        f"memory: MemTotal {_gib(mem.get('mem_total_bytes'))}, "
        f"MemAvailable {_gib(mem.get('mem_available_bytes'))}",
        f"/dev/shm: {_gib(shm['size_bytes'])} size, {_gib(shm['free_bytes'])} free"
        if shm
        else "/dev/shm: missing (the host store needs it)",
        f"ulimit -l: {'unlimited' if memlock is None else f'{memlock} bytes'}",
        f"GPUs: {len(info['gpus'])}",
    ]
    lines += [
        f"  [{g['index']}] {g['name']}, {_gib(g['memory_bytes'])}, sm {g['capability']}"
        for g in info["gpus"]
    ]
    if info["gpu_links"]:
        lines += ["GPU links (nvidia-smi topo -m):", info["gpu_links"]]
    return "\n".join(lines)
