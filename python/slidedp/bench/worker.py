"""One system of ``slidedp bench train`` in its own process; writes one JSON result file.

Run by the parent (``slidedp.bench.train``), not by hand::

    python -m slidedp.bench.worker SPEC.json RESULT.json

A spec of several ranks makes this process their launcher (``bench.ranks``); each dies with the
process that started it (``runtime.lifetime``). The result holds ``status`` (``ok``, ``oom``: a
result, not a crash; ``unavailable`` for a peer that cannot run here, with one line), the step
times, GPU peaks, PSS and a peer's ``peer_set``. Any other exception propagates (non-zero exit).
``system="peak"`` measures the device's bf16 GEMM peak, ``system="collectives"`` the ranks'
collectives (``bench.collectives``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slidedp.autopolicy.validate import is_out_of_memory
from slidedp.bench.collectives import run_collectives
from slidedp.bench.deepspeed_zero import run_zero
from slidedp.bench.fsdp2 import run_fsdp2
from slidedp.bench.measure import RunSpec, gpu_memory, process_pss_bytes
from slidedp.bench.ours import run_ours
from slidedp.bench.peers import PeerUnavailable
from slidedp.bench.ranks import launch_ranks, run_rank
from slidedp.bench.reference import run_reference
from slidedp.bench.roundpipe_sync import run_roundpipe
from slidedp.plan.device import allocator_settings, prefer_expandable_segments
from slidedp.runtime.dist import Dist
from slidedp.runtime.flops import device_peak_flops
from slidedp.runtime.lifetime import die_with_parent
from slidedp.runtime.zygote import Zygote

RANK_IMPORTS = ("slidedp.bench.worker",)  # what a spawned zygote imports for the ranks


def _ours(spec: RunSpec) -> dict[str, Any]:

    return run_ours(spec)


def _reference(spec: RunSpec) -> dict[str, Any]:

    return run_reference(spec)


def _fsdp2(spec: RunSpec) -> dict[str, Any]:

    return run_fsdp2(spec)


def _zero(spec: RunSpec) -> dict[str, Any]:

    return run_zero(spec)


def _roundpipe(spec: RunSpec) -> dict[str, Any]:

    return run_roundpipe(spec)


def _collectives(spec: RunSpec) -> dict[str, Any]:

    return run_collectives(spec)


SYSTEMS: dict[str, Callable[[RunSpec], dict[str, Any]]] = {
    "ours": _ours,
    "reference": _reference,
    "fsdp2": _fsdp2,
    "fsdp2-resident": _fsdp2,  # the same code without CPUOffloadPolicy
    "zero3-offload": _zero,
    "zero3-optim-offload": _zero,
    "zero-offload": _zero,
    "roundpipe": _roundpipe,
    "collectives": _collectives,
}


def _peak(spec: RunSpec) -> dict[str, Any]:
    device = torch.device(spec.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device_name": name, "peak_flops": device_peak_flops(device)}


def limit_gpu(spec: RunSpec) -> None:
    """Cap this rank's CUDA caching allocator at ``spec.gpu_limit_gib`` (a smaller GPU than this
    one: an allocation beyond it raises torch's OOM, reported as ``oom``)."""
    if spec.gpu_limit_gib <= 0 or spec.device != "cuda":
        return
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, spec.gpu_limit_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)


def run(spec: RunSpec) -> dict[str, Any]:
    if spec.system == "peak":
        return _peak(spec)
    limit_gpu(spec)
    result: dict[str, Any] = {"system": spec.full_system, "batch": spec.batch}
    if spec.peer:  # what this run was told (--peer-set; a variant's merged on its peer's)
        result["peer_set"] = spec.peer
    try:
        result.update(SYSTEMS[spec.system](spec), status="ok")
    except PeerUnavailable as e:
        result.update(status="unavailable", error=str(e))
    except Exception as e:  # only out-of-memory is a result; anything else re-raises
        if not is_out_of_memory(e):
            raise
        result.update(status="oom", error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    result.update(gpu_memory(torch.device(spec.device)))
    if spec.device == "cuda":
        result["allocator_settings"] = allocator_settings() or "torch's defaults"
    result["host_pss_end_bytes"] = process_pss_bytes(os.getpid())
    return result


def main(argv: list[str]) -> int:
    die_with_parent()  # a bench killed by SIGKILL leaves no worker on the GPU
    spec_path, result_path = argv
    spec = RunSpec.from_json(json.loads(Path(spec_path).read_text()))
    if spec.system == "ours":  # the peers and the reference run on the user's settings
        prefer_expandable_segments()
    if spec.world > 1:
        ctx = Dist.from_env()
        if ctx is None:  # the launcher: its ranks fork from a copy of it taken before it plans
            with Zygote.started(RANK_IMPORTS, own_process=True) as zygote:
                return launch_ranks(spec, Path(spec_path), Path(result_path), zygote)
        return run_rank(run, spec, ctx, Path(result_path))
    Path(result_path).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
