"""The batch-sweep figure of ``slidedp bench train --sweep ... --png FILE``.

Three panels against batch size, one line per system (ours, reference, fsdp2; with ``--gpus N``
also each run of N ranks, ``bench.report.run_label``): tokens/s, GPU peak reserved (GiB) and
host PSS peak (GiB). A run that ran out of memory has no point; its
batch is marked "OOM" at the bottom of each panel. Needs matplotlib (``pip install
'slidedp[bench]'``).

Example::

    plot_sweep(json.loads(Path("sweep.json").read_text()), Path("sweep.png"))
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from slidedp.bench.report import run_label
from slidedp.errors import ConfigError

PANELS = (
    ("tokens_per_s", "tokens/s"),
    ("gpu_peak_reserved_gib", "GPU peak reserved (GiB)"),
    ("host_pss_peak_gib", "host PSS peak (GiB)"),
)
STYLE = {"ours": "o-", "reference": "s--", "fsdp2": "^-."}


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` (Agg backend: files only), or one clear line if it is missing
    (the CLI checks before any run starts). Imported by name: an optional dependency."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise ConfigError(
            "--png needs matplotlib: pip install 'slidedp[bench]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    plt = require_matplotlib()

    runs = report["runs"]
    labels = list(dict.fromkeys(run_label(r) for r in runs))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for ax, (key, label) in zip(axes, PANELS, strict=True):
        for label in labels:
            mine = [r for r in runs if run_label(r) == label]
            ok = [r for r in mine if r["status"] == "ok"]
            points = [(r["batch"], r[key]) for r in ok if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, STYLE.get(mine[0]["system"], "x-"), label=label)
            for r in mine:
                if r["status"] == "oom":
                    ax.annotate(f"{label} OOM", (r["batch"], 0), rotation=90, fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["batch"] for r in runs}))
        ax.set_xticklabels([str(b) for b in sorted({r["batch"] for r in runs})])
        ax.set_xlabel(f"batch (sequences of {report['seq_len']} tokens)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['shape']} on {report['device_name']}")
    fig.savefig(path, dpi=120)
    plt.close(fig)
