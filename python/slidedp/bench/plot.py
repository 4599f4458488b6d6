"""The batch-sweep figure of ``slidedp bench train --sweep ... --png FILE``.

Three panels against batch size, one line per system and variant (and per run of N ranks):
tokens/s, GPU peak reserved and host PSS peak; each legend entry carries the geometric mean of
ours / it (``bench.sweep``); an OOM batch is marked at the bottom. Needs matplotlib
(``pip install 'slidedp[bench]'``). A sweep run a few batches at a time is drawn from its
reports: ``slidedp bench plot --png sweep.png b4-8.json b16-32.json``. Invariant: the reports
must share shape, sequence length and device, and (``ours_config``) our runtime and train
sections, so no curve or ratio mixes two configurations.

Example::

    plot_sweep(json.loads(Path("sweep.json").read_text()), Path("sweep.png"))
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from slidedp.bench.peers import split_variant
from slidedp.bench.report import run_label
from slidedp.bench.sweep import print_summary, sweep_summary
from slidedp.cli_args import writable
from slidedp.errors import ConfigError
from slidedp.profile.pareto import require_matplotlib

PANELS = (
    ("tokens_per_s", "tokens/s"),
    ("gpu_peak_reserved_gib", "GPU peak reserved (GiB)"),
    ("host_pss_peak_gib", "host PSS peak (GiB)"),
)
STYLE = {
    "ours": "o-", "reference": "s--", "fsdp2": "^-.", "fsdp2-resident": "v:",
    "zero3-offload": "D-.", "zero3-optim-offload": "X-", "zero-offload": "d:", "roundpipe": "P--",
}  # fmt: skip
SAME = ("shape", "seq_len", "device_name")  # what reports must share to be drawn together
OURS_CONFIG_SYSTEMS = ("ours", "reference")  # their rows run our whole config (ours_config)


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    plt = require_matplotlib()

    runs = report["runs"]
    labels = list(dict.fromkeys(run_label(r) for r in runs))
    geomeans: dict[str, list[str]] = {}  # per system: "OURS RATIOx" for ours and its variants
    for p in sweep_summary(runs)["peers"]:
        if p["geomean_ours_over_peer"] is not None:
            text = f"{p['ours']} {p['geomean_ours_over_peer']:.2f}x"
            geomeans.setdefault(p["system"], []).append(text)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for ax, (key, axis_label) in zip(axes, PANELS, strict=True):
        for label in labels:
            mine = [r for r in runs if run_label(r) == label]
            ok = [r for r in mine if r["status"] == "ok"]
            points = sorted((r["batch"], r[key]) for r in ok if r.get(key) is not None)
            if points:
                xs, ys = zip(*points, strict=True)
                ratio = geomeans.get(label)
                legend = label if ratio is None else f"{label} ({', '.join(ratio)})"
                style = STYLE.get(split_variant(mine[0]["system"])[0], "x-")
                ax.plot(xs, ys, style, label=legend)
            for r in mine:
                if r["status"] == "oom":
                    ax.annotate(f"{label} OOM", (r["batch"], 0), rotation=90, fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["batch"] for r in runs}))
        ax.set_xticklabels([str(b) for b in sorted({r["batch"] for r in runs})])
        ax.set_xlabel(f"batch (sequences of {report['seq_len']} tokens)")
        ax.set_ylabel(axis_label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['shape']} on {report['device_name']}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report holding the runs of all ``reports`` by batch; they must agree on ``SAME``."""
    first = reports[0]
    for other in reports[1:]:
        differ = [k for k in SAME if other.get(k) != first.get(k)]
        if differ:
            raise ConfigError(
                f"reports differ in {', '.join(differ)} "
                f"({first.get(differ[0])!r} vs {other.get(differ[0])!r}): plot one sweep at a time"
            )
    _check_ours_configs(reports)
    runs = [r for report in reports for r in report["runs"]]
    return {**first, "runs": sorted(runs, key=lambda r: r["batch"])}  # stable: systems keep order


def _check_ours_configs(reports: list[dict[str, Any]]) -> None:
    """One ``ConfigError`` line naming the first key where two reports' ``ours_config`` differ:
    the whole config among the reports with ours or reference rows, its train section among
    all; and a variant's of ours (``ours_variants``) among the reports with its rows."""
    ours = [r for r in reports if any(run["system"] in OURS_CONFIG_SYSTEMS for run in r["runs"])]
    scopes = {
        "ours_config": [r.get("ours_config") for r in ours],
        "ours_config.train": [(r.get("ours_config") or {}).get("train") for r in reports],
    }
    variants = {run["system"] for r in reports for run in r["runs"]}
    for name in sorted(v for v in variants if v.startswith("ours:")):
        scopes[f"ours_variants.{name}"] = [
            r.get("ours_variants", {}).get(name)
            for r in reports
            if any(run["system"] == name for run in r["runs"])
        ]
    for path, configs in scopes.items():
        for config in configs[1:]:
            differ = _first_difference(configs[0], config, path)
            if differ is not None:
                key, a, b = differ
                raise ConfigError(
                    f"reports differ in {key} ({a!r} vs {b!r}): rows of two configurations "
                    "would be drawn and summarised as one; plot the reports of one configuration"
                )


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """(dotted key, value in ``a``, value in ``b``) of the first difference, or None. A key
    only one of them has is none: a report written before the key existed ran without the
    feature it configures, as its default does."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() & b.keys()):
            differ = _first_difference(a.get(key), b.get(key), f"{path}.{key}")
            if differ is not None:
                return differ
        return None
    return None if a == b else (path, a, b)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", nargs="+", help="JSON reports of slidedp bench train --json")
    parser.add_argument("--png", required=True, help="the figure to write")


def main(args: argparse.Namespace) -> int:
    try:
        require_matplotlib()
        writable("--png", args.png)
        reports = []
        for path in args.reports:
            try:
                reports.append(json.loads(Path(path).read_text()))
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path}: not a readable JSON report ({e})") from None
        merged = merge_reports(reports)
        plot_sweep(merged, Path(args.png))
        print_summary(sweep_summary(merged["runs"]))
    except ConfigError as e:
        print(f"slidedp bench plot: error: {e}", file=sys.stderr)
        return 2
    return 0
