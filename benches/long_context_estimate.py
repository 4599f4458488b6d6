"""`slidedp estimate` of a long-sequence run on one node of four H200s (141 GB each, 512 GiB of
host memory of which 500 available, /dev/shm 512 GiB), computed on any machine (no GPU: the
node is described, not probed).

Run: python benches/long_context_estimate.py SHAPE SEQ [--gpus 4] [--context-parallel R]
     [--tile N] [--offload RATIO] [--layers LAYOUT] [--clip 1.0]
e.g. ``qwen3-14b 262144 --context-parallel 1 --tile 8192``: one 262,144-token sequence per GPU,
global batch 4, every dense MLP by 8,192-token tiles. The model is SHAPE's config (seeded init:
no weights), YaRN factor SEQ/32768; a fixed layout, eager kernels, not compiled.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml
from transformers import Qwen3Config

from slidedp.config import load_config
from slidedp.estimate_report import estimate_run, format_estimate
from slidedp.models.hf import HFAdapter
from slidedp.models.shapes import SHAPES
from slidedp.plan.machine import GIB, Machine

H200_NODE = Machine(
    device="cuda",
    dtype="bfloat16",
    cores=64,
    shm_free_bytes=512 * GIB,
    mem_available_bytes=500 * GIB,
    gpu_name="NVIDIA H200",
    gpu_total_bytes=143771 * 2**20,
)


def run_config(root: Path, args: argparse.Namespace) -> Path:
    """The run's YAML under ``root`` (SHAPE's config, one placeholder sample)."""
    (root / "model").mkdir(parents=True)
    Qwen3Config(**SHAPES[args.shape]).save_pretrained(root / "model")
    (root / "data.jsonl").write_text(json.dumps({"input_ids": [1] * 8}) + "\n")
    rope = {"rope_type": "yarn", "factor": max(1.0, args.seq / 32768),
            "original_max_position_embeddings": 32768}  # fmt: skip
    config = {
        "model": {
            "path": str(root / "model"),
            "rope_scaling": rope,
            "max_position_embeddings": args.seq,
        },
        "data": {"path": str(root / "data.jsonl"), "seq_len": args.seq, "pad_id": 0},
        "train": {
            "max_steps": 2,
            "global_batch_size": args.gpus // args.context_parallel,
            "max_grad_norm": args.clip,
            "dtype": "bfloat16",
        },
        "output": {"dir": str(root / "out"), "tensorboard": False, "save_steps": 0},
        "runtime": {
            "device": "cuda",
            "gpus": args.gpus,
            "context_parallel": args.context_parallel,
            "kernels": "eager",
            "layers": args.layers,
            "compile": False,
            "policy": "fixed",
            "offload_ratio": args.offload,
            "mlp_tile_tokens": args.tile,
        },
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("seq", type=int)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--context-parallel", type=int, default=1)
    parser.add_argument("--tile", type=int, default=0, help="runtime.mlp_tile_tokens")
    parser.add_argument("--offload", type=float, default=0.0, help="runtime.offload_ratio")
    parser.add_argument("--clip", type=float, default=1.0, help="train.max_grad_norm")
    parser.add_argument("--layers", default="F", help="runtime.layers, e.g. '16xF-r1, F'")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(str(run_config(Path(tmp), args)), ["runtime.device=auto"])
        est = estimate_run(cfg, HFAdapter.from_dir(cfg.model.path), H200_NODE)
        print(format_estimate(est))


if __name__ == "__main__":
    main()
