"""The memory-time Pareto frontier of the layer profile (the paper's Figure 6).

Example::

    mark_pareto(candidates)          # sets .pareto
    plot_pareto(report, Path("pareto.png"))
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from slidedp.errors import ConfigError


class _Point(Protocol):
    retained_bytes: int | None
    estimated_retained_bytes: int
    forward_s: float
    backward_s: float
    reload_s: float
    pareto: bool


def layer_time(p: Any) -> float:
    """A layer's time in the engine's steady state: its offload copy runs under the next
    layer's forward and its reload under the previous layer's backward, so a copy longer than
    that compute shows (``max(forward, copy) + max(backward, copy)``; the D2H is taken as long
    as the measured H2D)."""
    d = p if isinstance(p, dict) else vars(p)
    copy = float(d["reload_s"])
    return max(float(d["forward_s"]), copy) + max(float(d["backward_s"]), copy)


def memory(p: Any) -> int:
    """The retained bytes measured (CUDA), else the cost model's."""
    if isinstance(p, dict):
        m = p["retained_bytes"]
        return int(p["estimated_retained_bytes"] if m is None else m)
    return int(p.estimated_retained_bytes if p.retained_bytes is None else p.retained_bytes)


def mark_pareto(points: Sequence[_Point]) -> None:
    """``pareto = True`` on every point no other point beats in both retained device memory
    and layer time (``layer_time``; one strictly)."""
    for p in points:
        t, m = layer_time(p), memory(p)
        p.pareto = not any(
            q is not p
            and memory(q) <= m
            and layer_time(q) <= t
            and (memory(q) < m or layer_time(q) < t)
            for q in points
        )


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


def plot_pareto(report: dict[str, Any], path: Path) -> None:
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
    kinds = sorted({int(c.get("kind", 0)) for c in report["candidates"]})
    for color, kind in enumerate(kinds):  # one frontier per kind of layer
        cands = [c for c in report["candidates"] if int(c.get("kind", 0)) == kind]
        for c in cands:
            x, y = memory(c) / 2**30, layer_time(c) * 1e3
            ax.scatter(x, y, marker="o" if c["pareto"] else "x",
                       color=f"C{color}" if c["pareto"] else "C7")  # fmt: skip
            ax.annotate(c["policy"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = sorted((c for c in cands if c["pareto"]), key=memory)
        ax.plot([memory(c) / 2**30 for c in front], [layer_time(c) * 1e3 for c in front],
                f"C{color}-", label=f"layer {kind}'s kind")  # fmt: skip
    if len(kinds) > 1:
        ax.legend()
    ax.set_xlabel("device memory kept from forward to backward (GiB per layer)")
    ax.set_ylabel("layer time in the engine (ms): forward + backward, copies overlapped")
    shape = report["shape"] if isinstance(report["shape"], str) else "custom shape"
    ax.set_title(f"{shape}, B={report['batch']} x S={report['seq_len']}, {report['gpu']}")
    fig.savefig(path, dpi=120)
    plt.close(fig)
