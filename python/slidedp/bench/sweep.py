"""The matched-batch summary of a sweep: per baseline or peer, the geometric mean over the batches
where both it and ours ran of tokens/s ours / it (the SlideDP paper's metric), and the largest
batch each system trained on this machine (the smallest it could not: OOM, timeout, ...).

Runs of one GPU only (``world`` 1); a system that never ran (a peer not installed) keeps its
one-line reason. ``slidedp bench train`` adds it to the report as ``summary``; ``slidedp bench
plot`` prints it for the merged reports of a sweep run in several sittings.

Example::

    summary = sweep_summary(report["runs"])
    print_summary(summary)
"""

from __future__ import annotations

import math
from typing import Any

from slidedp.bench.report import is_ours, ours_family


def _single(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r.get("world", 1) == 1]


def fits(runs: list[dict[str, Any]], system: str) -> dict[str, Any]:
    """``largest_batch`` that ran, ``failed_batch`` the smallest that never ran and its status.
    A batch that failed in one report and ran in another (merged sittings: a longer limit, say)
    ran. ``failed_batch`` may lie below ``largest_batch``: a failure other than the batch's size
    (a timeout, an error) is reported where it happened."""
    mine = [r for r in _single(runs) if r["system"] == system]
    ok = {r["batch"] for r in mine if r["status"] == "ok"}
    failed = sorted((r["batch"], r["status"]) for r in mine if r["batch"] not in ok)
    return {
        "largest_batch": max(ok, default=None),
        "failed_batch": failed[0][0] if failed else None,
        "failed_status": failed[0][1] if failed else None,
    }


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def sweep_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``largest_batch`` per system and, per system other than ours and its variants, the
    matched-batch ratio of ours (``ours``: ours or a variant ``ours:LABEL``, one entry each)."""
    single = _single(runs)
    systems = list(dict.fromkeys(r["system"] for r in single))
    tokens = {(r["system"], r["batch"]): r["tokens_per_s"] for r in single if r["status"] == "ok"}
    peers = []
    for mine in ours_family(single):
        for system in (s for s in systems if not is_ours(s)):
            both = sorted(b for s, b in tokens if s == system and (mine, b) in tokens)
            ratios = [tokens[mine, b] / tokens[system, b] for b in both]
            absent = [r for r in single if r["system"] == system and r["status"] == "unavailable"]
            peers.append(
                {
                    "ours": mine,
                    "system": system,
                    "matched_batches": both,
                    "ours_over_peer": ratios,
                    "geomean_ours_over_peer": geometric_mean(ratios),
                    "unavailable": absent[0].get("error", "") if absent else None,
                }
            )
    return {"fits": {s: fits(single, s) for s in systems}, "peers": peers}


def _fit_text(system: str, fit: dict[str, Any]) -> str:
    largest = "none" if fit["largest_batch"] is None else str(fit["largest_batch"])
    failed = fit["failed_batch"]
    return f"{system} {largest}" + (
        "" if failed is None else f" ({fit['failed_status'].upper()} at {failed})"
    )


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """One line per system other than ours, for ours and each variant of it, then the largest
    batches."""
    lines = []
    for peer in summary["peers"]:
        name = f"{peer['ours']}/{peer['system']}"
        if peer["unavailable"] is not None and not peer["matched_batches"]:
            lines.append(f"{name}: not run ({peer['unavailable']})")
            continue
        if not peer["matched_batches"]:
            lines.append(f"{name}: no batch where both ran")
            continue
        batches = ", ".join(map(str, peer["matched_batches"]))
        lines.append(
            f"{name}: geometric mean {peer['geomean_ours_over_peer']:.2f}x over batches "
            f"{batches} (tokens/s where both ran)"
        )
    fits_text = ", ".join(_fit_text(s, f) for s, f in summary["fits"].items())
    lines.append(f"largest batch trained: {fits_text}")
    return lines


def print_summary(summary: dict[str, Any]) -> None:
    for line in summary_lines(summary):
        print(f"summary: {line}")
