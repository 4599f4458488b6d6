"""The step-time model against every measurement committed under ``benchmarks/`` (CPU only).

A change to the model (``crates/slidedp-core/src/model``, ``plan.timing``) is judged by all of
them at once: the eleven one-GPU H100 configurations predicted from probes
(benchmarks/2026-11-24-step-time-model-probes-h100.md), the 2xH200 runs of each route on three
machines (benchmarks/2026-11-27-two-gpus-routes-h200.md) and the eleven traced steps
(``bench model``, benchmarks/2026-11-23-step-time-model-traces.md).

    .venv/bin/python benches/model_errors.py [--json OUT]

Prints one line per measurement and, per set, how many are within 10% (the 2xH200 runs
split by gradient route, whose errors the 2xH200 record reads apart).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from slidedp.bench.model import compare
from slidedp.bench.predict import _from_files, _layer_of, predict_report
from slidedp.models.shapes import cut_layers, resolve_shape
from slidedp.profile.host import model_gbps

ROOT = Path(__file__).resolve().parent.parent / "benchmarks"
T15, T21 = ROOT / "step-model-t15", ROOT / "two-gpu-t21"
L2, L3 = T21 / "lease2", T21 / "lease3"  # later 2xH200 machines: each its own host probe
# (report, probes folder, the host probe when another machine's): the records' tables
PROBED: list[tuple[Path, Path, Path | float | None]] = [
    (T15 / "qwen3-1.7b-h100-sweep-reconstructed.json", T15 / "probes-call1", None),
    (T15 / "qwen3-1.7b-h100-b16-cast-lease4.json", T15 / "probes-call4", None),
    (T15 / "qwen3-4b-h100-b4.json", T15 / "probes-call2", T15 / "probes-call3/host.json"),
    (T15 / "qwen3-4b-h100-b8-noclip.json", T15 / "probes-call3", None),
    (T15 / "qwen3-4b-h100-b16-noclip.json", T15 / "probes-call1", None),
    (
        T15 / "qwen3-4b-h100-b16-offload1-noclip.json",
        T15 / "probes-call2",
        T15 / "probes-call3/host.json",
    ),
    (T15 / "qwen3-4b-h100-b16-mixed.json", T15 / "probes-call4", None),
    (T15 / "qwen3-8b-h100-b16.json", T15 / "probes-call5", None),
    (T21 / "qwen3-1.7b-2xh200-routes-b4.json", T21, 185.0),
    (T21 / "qwen3-1.7b-2xh200-routes-b32.json", T21, 185.0),
    (L2 / "qwen3-1.7b-2xh200-cpu-routes-b4.json", T21, L2 / "host.json"),
    (L2 / "qwen3-4b-2xh200-routes-b16.json", T21, L2 / "host.json"),
    (L3 / "qwen3-1.7b-2xh200-cpu-trace-b4.json", T21, L3 / "host.json"),
    (L3 / "qwen3-1.7b-2xh200-cpu-share-b4.json", T21, L3 / "host.json"),
    (L3 / "qwen3-1.7b-2xh200-sharded-gpu-b4.json", T21, L3 / "host.json"),
    (L3 / "qwen3-1.7b-2xh200-sharded-cpu-b32.json", T21, L3 / "host.json"),
    (L3 / "qwen3-4b-2xh200-routes-b4.json", T21, L3 / "host.json"),
    (L3 / "qwen3-4b-2xh200-sharded-b16.json", T21, L3 / "host.json"),
]
_TRACED = json.loads((ROOT / "step-model-vs-traces.json").read_text())
# `bench model --json`: {"rows": [...], "provenance": ...}; a list before it recorded provenance
TRACES = [
    Path(r["trace"]).name for r in (_TRACED["rows"] if isinstance(_TRACED, dict) else _TRACED)
]


def probed_rows() -> list[dict[str, Any]]:
    rows = []
    for report_path, probes, host in PROBED:
        host_gbps = model_gbps(json.loads(host.read_text())) if isinstance(host, Path) else host
        report = json.loads(report_path.read_text())
        config = resolve_shape(report["shape"])
        if int(config.num_hidden_layers) != report["model"]["layers"]:
            config = cut_layers(config, report["model"]["layers"])
        probe = _from_files(probes, _layer_of(config.to_dict()), host_gbps)
        with tempfile.TemporaryDirectory(prefix="slidedp-model-errors-") as tmp:
            config.to_json_file(Path(tmp) / "config.json")
            for row in predict_report(report, Path(tmp), probe):
                clip = float(report["ours_config"]["train"]["max_grad_norm"]) > 0
                rows.append({"report": report_path.name, "clipping": clip, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write every row here")
    args = parser.parse_args()
    probed = probed_rows()
    traced = [compare(ROOT / "traces" / name, 2, 4) for name in TRACES]
    print(f"{'report (probes)':<44} {'B':>3} {'ranks':>5} {'route':<15} {'clip':>5} "
          f"{'measured':>9} {'model':>7} {'error':>7}")  # fmt: skip
    for r in probed:
        print(f"{r['report']:<44} {r['batch']:3d} {r['world']:5d} {r['route'] or '-':<15} "
              f"{r['clipping']!s:>5} {r['measured_step_s']:8.3f}s {r['predicted_step_s']:6.3f}s "
              f"{r['error']:+7.1%}")  # fmt: skip
    print(f"\n{'trace':<48} {'clip':>5} {'traced':>8} {'model':>7} {'error':>7}")
    for r in traced:
        print(f"{Path(r['trace']).name:<48} {r['clipping']!s:>5} {r['traced_step_s']:7.3f}s "
              f"{r['predicted_step_s']:6.3f}s {r['error']:+7.1%}")  # fmt: skip
    one = [r for r in probed if r["world"] == 1 and "2xh200" not in r["report"]]
    x2 = [r for r in probed if r not in one]
    cpu = [r for r in x2 if (r["route"] or "").endswith("/cpu")]
    sets = {"one H100, probes": one, "2xH200, 1 GPU and gpu routes, probes":
            [r for r in x2 if r not in cpu], "2xH200, cpu routes, probes": cpu,
            "traces": traced}  # fmt: skip
    print()
    for name, rows in sets.items():
        within = sum(abs(r["error"]) <= 0.10 for r in rows)
        worst = max(rows, key=lambda r: abs(r["error"]))["error"]
        print(f"{name}: {within} of {len(rows)} within 10%, worst {worst:+.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"probed": probed, "traced": traced}, indent=1))


if __name__ == "__main__":
    main()
