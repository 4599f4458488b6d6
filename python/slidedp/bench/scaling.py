"""The figures of ``slidedp bench train --gpus N`` and their printed form: weak scaling, ratios,
the route table of ours and the collectives' bandwidths, from the measured runs.

Weak-scaling efficiency at per-rank batch B: tokens/s on N ranks over N x tokens/s on one rank
(100%: N ranks do N times the work in the same time). The reference runs on one GPU only; its
N-GPU figure is projected, N x its FLOP/s over the FLOPs per token at S (N x its tokens/s where
it ran at S; ``bench.context``: where it did not), and labelled so. Ratios on N ranks divide
ours' tokens/s by FSDP2's, each peer's (and variant's) and the projected reference's.

Example::

    report |= scale_report(runs, scale, flops_per_token, seq)  # runs: with "world", "route"
    print_scale(report)
"""

from __future__ import annotations

from typing import Any

from slidedp.bench.context import reference_projection
from slidedp.bench.multi import Scale, route_name

Run = dict[str, Any]


def efficiency(one: float | None, many: float | None, world: int) -> float | None:
    """Weak-scaling efficiency from tokens/s on one rank and on ``world`` (None: one missing)."""
    return many / (world * one) if one and many else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _tokens_per_s(runs: list[Run], batch: int, system: str, world: int, route: str | None) -> Any:
    """tokens/s of the matching run (None when it did not run or did not finish)."""
    for r in runs:
        if (r["batch"], r["system"], r["world"], r["route"]) == (batch, system, world, route):
            return r.get("tokens_per_s")
    return None


def scaling(runs: list[Run], scale: Scale, flops_per_token: float, seq: int) -> list[Run]:
    """Per batch: tokens/s on 1 and N ranks, efficiencies, the reference's projection (its
    FLOP/s over ``flops_per_token``, at ``seq``) and the ratios."""
    n, route = scale.world, route_name(scale.main_route)
    rows = []
    for batch in sorted({r["batch"] for r in runs}):
        ours_1 = _tokens_per_s(runs, batch, "ours", 1, None)
        ours_n = _tokens_per_s(runs, batch, "ours", n, route)
        fsdp2_1 = _tokens_per_s(runs, batch, "fsdp2", 1, None)
        fsdp2_n = _tokens_per_s(runs, batch, "fsdp2", n, None)
        reference = reference_projection(runs, batch, n, flops_per_token, seq)
        projected = reference["reference_projected_tokens_per_s"]
        rows.append({
            "batch": batch, "world": n, "global_batch": n * batch // scale.context,
            "route": route, "context_parallel": scale.context,
            "ours_1_tokens_per_s": ours_1, "ours_n_tokens_per_s": ours_n,
            "fsdp2_1_tokens_per_s": fsdp2_1, "fsdp2_n_tokens_per_s": fsdp2_n,
            **reference,
            "ours_efficiency": efficiency(ours_1, ours_n, n),
            "fsdp2_efficiency": efficiency(fsdp2_1, fsdp2_n, n),
            "ours_over_fsdp2": _ratio(ours_n, fsdp2_n),
            "ours_over_reference_projected": _ratio(ours_n, projected),
            "peers": _peers(runs, batch, n, ours_n),
        })  # fmt: skip
    return rows


def _peers(runs: list[Run], batch: int, n: int, ours_n: float | None) -> dict[str, Run]:
    """Per peer (or variant) that ran on ``n`` ranks at ``batch``: tokens/s on 1 and ``n``
    ranks, its efficiency, and ours (on ``n``) over it."""
    names = [r["system"] for r in runs if r["batch"] == batch and r["world"] == n]
    out = {}
    for name in dict.fromkeys(names):
        if name in ("ours", "fsdp2"):
            continue
        one = _tokens_per_s(runs, batch, name, 1, None)
        many = _tokens_per_s(runs, batch, name, n, None)
        out[name] = {
            "tokens_per_s_1": one, "tokens_per_s_n": many,
            "efficiency": efficiency(one, many, n), "ours_over": _ratio(ours_n, many),
        }  # fmt: skip
    return out


def route_table(runs: list[Run], scale: Scale) -> list[Run]:
    """One row per run of ours on N ranks (a batch and a route)."""
    rows = []
    for r in runs:
        if r["system"] != "ours" or r["world"] != scale.world:
            continue
        one = _tokens_per_s(runs, r["batch"], "ours", 1, None)
        rows.append({
            "batch": r["batch"], "status": r["status"],
            # --routes auto: the route runtime.policy=auto chose, beside the label
            "route": f"{r['route']} ({r['chosen_route']})" if r.get("chosen_route") else r["route"],
            "tokens_per_s": r.get("tokens_per_s"), "step_time_s": r.get("step_time_s"),
            "efficiency": efficiency(one, r.get("tokens_per_s"), scale.world),
            "exposed_wait_s": r.get("exposed_wait_s"),
            "host_pss_peak_gib": r["host_pss_peak_gib"],
            "gpu_peak_reserved_gib": r["gpu_peak_reserved_gib"],
        })  # fmt: skip
    return rows


def scale_report(runs: list[Run], scale: Scale, flops_per_token: float, seq: int) -> dict[str, Any]:
    """The report's keys of a run with ``--gpus``/``--ranks`` (the collectives come apart);
    ``flops_per_token`` at ``seq``, the bench's length (the reference's projection)."""
    return {
        "world": scale.world,
        "routes": [route_name(r) for r in scale.routes],
        "scaling": scaling(runs, scale, flops_per_token, seq),
        "route_table": route_table(runs, scale),
    }


def collectives_report(result: Run) -> Run:
    """The collectives' worker result without what only a training run has."""
    keys = ("status", "error", "backend", "dtype", "warmup", "reps", "rows")
    return {k: result[k] for k in keys if k in result}


def _fmt(value: float | None, spec: str, width: int = 0) -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


def _print_scaling(report: dict[str, Any], unit: str) -> None:
    for row in report["scaling"]:
        n, batch, r = row["world"], row["batch"], row.get("context_parallel", 1)
        per = "rank" if r == 1 else f"group of {r} (each sequence split over {r} {unit})"
        print(
            f"weak scaling 1 -> {n} {unit}, batch {batch} per {per} (global "
            f"{row['global_batch']}), ours on {row['route']}, tokens/s:"
        )
        for system in ("ours", "fsdp2"):
            one, many = row[f"{system}_1_tokens_per_s"], row[f"{system}_n_tokens_per_s"]
            print(
                f"  {system:<10} 1: {_fmt(one, '.1f', 10)}  {n}: {_fmt(many, '.1f', 10)}  "
                f"efficiency {_fmt(row[f'{system}_efficiency'], '.1%')}"
            )
        peers = row.get("peers", {})
        for name, peer in peers.items():
            print(
                f"  {name:<10} 1: {_fmt(peer['tokens_per_s_1'], '.1f', 10)}  "
                f"{n}: {_fmt(peer['tokens_per_s_n'], '.1f', 10)}  "
                f"efficiency {_fmt(peer['efficiency'], '.1%')}"
            )
        projected = _fmt(row["reference_projected_tokens_per_s"], ".1f")
        print(f"  {'reference':<10} {n}: {projected} (projected, {row['reference_projection']})")
        over_peers = "".join(
            f"ours/{name} {_fmt(peer['ours_over'], '.2f')}x, " for name, peer in peers.items()
        )
        print(
            f"ratios at batch {batch} per rank on {n} {unit} (tokens/s): "
            f"ours/fsdp2 {_fmt(row['ours_over_fsdp2'], '.2f')}x, {over_peers}"
            f"ours/reference (projected) {_fmt(row['ours_over_reference_projected'], '.2f')}x"
        )


def _print_routes(report: dict[str, Any], unit: str) -> None:
    print(
        f"routes of ours on {report['world']} {unit} "
        "(exposed wait: ms per step the compute lane waited on each lane)"
    )
    print(
        f"{'batch':>5} {'param/grad':<22} {'tokens/s':>10} {'step ms':>9} {'scaling':>8} "
        f"{'h2d':>7} {'update':>7} {'d2h':>7} {'offload':>7} {'host GiB':>9} {'GPU GiB':>8}"
    )
    for row in report["route_table"]:
        head = f"{row['batch']:>5} {row['route']:<22}"
        if row["status"] != "ok":
            print(f"{head} {row['status'].upper():>10}")
            continue
        waits = row["exposed_wait_s"]
        print(
            f"{head} {row['tokens_per_s']:>10.1f} {row['step_time_s'] * 1e3:>9.1f} "
            f"{_fmt(row['efficiency'], '.1%', 8)} "
            + " ".join(f"{waits[k] * 1e3:>7.1f}" for k in ("h2d", "update", "d2h", "offload"))
            + f" {row['host_pss_peak_gib']:>9.2f} {_fmt(row['gpu_peak_reserved_gib'], '.2f', 8)}"
        )


def _print_collectives(report: dict[str, Any], unit: str) -> None:
    c, n = report.get("collectives"), report["world"]
    if c is None:  # --no-collectives
        return
    if c["status"] != "ok":
        print(f"collectives on {n} {unit}: {c['status'].upper()} {c.get('error', '')}")
        return
    print(
        f"collectives on {n} {unit} ({c['backend']}, {c['dtype']}, median of {c['reps']} after "
        f"{c['warmup']} warm-up; bandwidth in GB/s = 1e9 B/s)"
    )
    print(f"{'op':<12} {'size':<9} {'MiB':>9} {'ms':>9} {'algbw':>8} {'busbw':>8}")
    for row in c["rows"]:
        print(
            f"{row['op']:<12} {row['size']:<9} {row['bytes'] / 2**20:>9.2f} "
            f"{row['time_s'] * 1e3:>9.3f} {row['algbw_gbps']:>8.2f} {row['busbw_gbps']:>8.2f}"
        )


def print_scale(report: dict[str, Any]) -> None:
    """The scaling summary, the route table and the collectives (after the runs' table)."""
    unit = "GPUs" if report["device"] == "cuda" else "ranks"
    _print_scaling(report, unit)
    _print_routes(report, unit)
    _print_collectives(report, unit)
