"""The layout program on a recorded layer profile, for a GPU not at hand: what ``slidedp plan``
and ``runtime.policy: auto`` would choose, and the choice with the embedding and head left on
the host (``autopolicy.select.solve_residency``'s other branch). Predictions, not measurements.

Run: ``.venv/bin/python benches/replay_select.py`` (defaults: the H100 profile of one Qwen3-4B
layer at B=16, ``benchmarks/qwen3-4b-h100-profile-layer-b16.json``, eager kernels; an 80 GB
H100; the host AdamW rate the H100 host probed under DMA, 131 GB/s; clipping on and off).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from slidedp.autopolicy import select
from slidedp.config import load_config
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import resolve_shape
from slidedp.plan.machine import GIB, Machine

H100 = Machine(device="cuda", dtype="bfloat16", cores=16, shm_free_bytes=100 * GIB,
               mem_available_bytes=120 * GIB, gpu_name="NVIDIA H100 80GB HBM3",
               gpu_total_bytes=80 * 10**9)  # fmt: skip


def replay(shape: str, profile: Path, gbps: float, clip: float) -> str:
    report = json.loads(profile.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(resolve_shape(shape).to_dict()))
        data = Path(tmp) / "data.jsonl"
        data.write_text('{"input_ids": [1, 2, 3]}\n')
        config = {"model": {"path": str(model)}, "data": {"path": str(data),
                  "seq_len": int(report["seq_len"])},
                  "train": {"global_batch_size": int(report["batch"]), "max_grad_norm": clip,
                            "max_steps": 1},
                  "output": {"dir": str(Path(tmp) / "out")}}  # fmt: skip
        (Path(tmp) / "run.yaml").write_text(yaml.safe_dump(config))
        cfg = load_config(str(Path(tmp) / "run.yaml"), [])
        adapter = HFAdapter.from_dir(model)
        total = int(H100.gpu_total_bytes or 0)
        choice = select.select_layout(cfg, adapter, H100, report, update_gbps=gbps,
                                      total_bytes=total)  # fmt: skip
        other = select.select_layout(cfg, adapter, H100, report, update_gbps=gbps,
                                     total_bytes=total, embeddings=False).solution  # fmt: skip
    sol = choice.solution
    return (
        f"clipping {clip}: {choice.program_layout}, step {sol['step_s']:.3f} s (layers "
        f"{sol['compute_s']:.3f}, host {sol['host_s']:.3f}); embeddings on the host: "
        f"{other['resident_layers']} GPU-resident, step {other['step_s']:.3f} s (layers "
        f"{other['compute_s']:.3f}, host {other['host_s']:.3f}); all F: "
        f"{choice.default['step_s']:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-4b")
    parser.add_argument(
        "--profile", type=Path, default=Path("benchmarks/qwen3-4b-h100-profile-layer-b16.json")
    )
    parser.add_argument("--gbps", type=float, default=131.0)
    args = parser.parse_args()
    for clip in (1.0, 0.0):
        print(replay(args.shape, args.profile, args.gbps, clip))


if __name__ == "__main__":
    main()
