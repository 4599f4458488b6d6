"""A bench system on several ranks: the worker launches them, each rank measures, rank 0 reports.

``python -m slidedp.bench.worker SPEC RESULT`` with ``spec.world > 1`` and no ``RANK`` is the
launcher: it starts ``spec.world`` copies of itself (``runtime.launch``), waits, and writes
RESULT from the ranks' files. Invariants: a failing rank poisons the shared store and exits at
once, the launcher kills survivors, so no rank waits forever. Outcome: rank 0's result when
every rank succeeded; a rank's ``oom`` result when one ran out of memory; otherwise the first
failing rank's exit code.

Example::

    sys.exit(launch_ranks(spec, spec_path, result_path))   # in the launcher
    sys.exit(run_rank(worker.run, spec, ctx, result_path))  # in each rank
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from slidedp.bench.measure import RunSpec
from slidedp.bench.ours import plan_for_ranks
from slidedp.errors import SlidedpError
from slidedp.runtime.dist import EXIT_PEER_FAILED, Dist, fail, finish
from slidedp.runtime.launch import LaunchSpec, launch
from slidedp.runtime.zygote import Zygote

EXIT_FAILED = 1
EXIT_OOM = 4  # this rank ran out of memory (its result file says so)


def rank_result_path(result_path: Path, rank: int) -> Path:
    return result_path.with_name(f"{result_path.stem}.rank{rank}.json")


def launch_ranks(
    spec: RunSpec, spec_path: Path, result_path: Path, zygote: Zygote | None = None
) -> int:
    """Run ``spec`` on ``spec.world`` ranks, forked from ``zygote`` (None: fresh interpreters);
    writes ``result_path`` unless a rank failed. Our engine's plan is decided here, once
    (``runtime.policy=auto`` chosen), and every rank runs it."""
    chosen: dict[str, Any] = {}
    if spec.system == "ours":
        try:
            spec_path, chosen = plan_for_ranks(spec, spec_path)
        except SlidedpError as e:
            print(f"slidedp bench train: ours on {spec.world} ranks: {e}", file=sys.stderr)
            return EXIT_FAILED
    ranks = LaunchSpec(
        module="slidedp.bench.worker",
        name=f"slidedp bench train: {spec.system} on {spec.world} ranks",
        own_session=False,  # the bench kills the process group of its child as one
        training_run=False,
    )
    code = launch(spec.world, [str(spec_path), str(result_path)], spec=ranks, zygote=zygote)
    results = {
        rank: json.loads(path.read_text())
        for rank in range(spec.world)
        if (path := rank_result_path(result_path, rank)).exists()
    }
    oom = [rank for rank, result in results.items() if result["status"] == "oom"]
    if oom:
        result = results[oom[0]]
        result["error"] = f"rank {oom[0]}: {result['error']}"
    elif code == 0 and 0 in results:
        result = results[0]
    else:
        return code or EXIT_FAILED
    result_path.write_text(json.dumps(result | chosen))
    return 0


def run_rank(
    measure: Callable[[RunSpec], dict[str, Any]], spec: RunSpec, ctx: Dist, result_path: Path
) -> int:
    """One rank: ``measure(spec)``; on failure wake the peers and exit at once (a rank that only
    reacts to a peer's failure prints nothing: the failing rank's traceback is shown once)."""
    try:
        result = measure(spec)
    except BaseException as e:
        by_peer = fail(e)
        if not by_peer:
            traceback.print_exc()
        _exit(EXIT_PEER_FAILED if by_peer else EXIT_FAILED)
    if result["status"] == "oom":
        rank_result_path(result_path, ctx.rank).write_text(json.dumps(result))
        fail(MemoryError(result["error"]))  # poisons the shared store: the peers wake
        _exit(EXIT_OOM)
    if ctx.main:
        rank_result_path(result_path, ctx.rank).write_text(json.dumps(result))
    finish()
    return 0


def _exit(code: int) -> NoReturn:
    """Exit without tearing down a broken process group or the update threads (as a failed
    rank of ``slidedp train`` does)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
