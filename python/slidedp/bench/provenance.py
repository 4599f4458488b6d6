"""Where a bench report was measured: the command line, the UTC date, the versions and the
host, under the key ``provenance`` of every bench JSON.

Example::

    report["provenance"] = provenance()
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers

from slidedp import __version__
from slidedp.envinfo import meminfo_bytes, nvidia_smi
from slidedp.kernels import Kernels


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name (the first core's), or None where the kernel does not say."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return None
    names = (line.partition(":")[2].strip() for line in lines if line.startswith("model name"))
    return next(names, None)


def _deepspeed_version() -> str | None:
    """DeepSpeed's installed version (read from its metadata: importing it takes seconds)."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_names() -> list[str]:
    """The GPUs' names by nvidia-smi: the bench's parent never touches the GPU (a CUDA
    context here would count against every run's memory)."""
    names = nvidia_smi("--query-gpu=name", "--format=csv,noheader")
    return names.splitlines() if names else []


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The facts a reader needs to reproduce or compare a report (``argv``: the command line,
    this process's by default)."""
    return {
        "argv": list(sys.argv if argv is None else argv),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "slidedp": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "deepspeed": _deepspeed_version(),
        },
        "host": {
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)),
            "host_kernels_isa": Kernels.detect_isa(),
            "mem_total_bytes": meminfo_bytes().get("mem_total_bytes"),
            "gpus": _gpu_names(),
        },
    }


def with_provenance(result: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """A bench's JSON report: an object's keys, or a list of rows under ``rows``, and the
    ``provenance`` of this run."""
    report = dict(result) if isinstance(result, dict) else {"rows": list(result)}
    return report | {"provenance": provenance()}


def write_report(path: str | None, result: dict[str, Any] | list[Any]) -> None:
    """``with_provenance(result)`` into ``path`` (None: not asked for)."""
    if path is not None:
        Path(path).write_text(json.dumps(with_provenance(result), indent=1))
