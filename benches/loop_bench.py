"""Around the training loop on a big layer shape: evaluation throughput against training, and
a frozen-embeddings run's host memory and step time against an unfrozen one's.

Run on the GPU machine (``benches/gpu_loop.sh`` does): ``python benches/loop_bench.py eval
--layers 4 --json out/eval.json`` or ``... freeze --freeze embed_tokens --json out/f.json``.
The model is ``qwen3-14b`` (``bench.shapes``) cut to ``--layers`` decoder layers, config only
(seeded random init), on random tokens; no checkpoint is written (the bench drains instead).
Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from slidedp.config import config_from_dict
from slidedp.errors import ConfigError
from slidedp.models.shapes import cut_layers, resolve_shape
from slidedp.runtime.node_pss import pss_bytes
from slidedp.runtime.trainer import Trainer


class _NoSave(Trainer):
    """No checkpoint: 12 bytes per parameter would only fill the disk (the updates drain)."""

    def save(self) -> Path:
        self.engine.drain()
        return self.out_dir


def _tokens(path: Path, rows: int, seq_len: int, vocab: int, seed: int) -> None:
    ids = np.random.default_rng(seed).integers(0, vocab, size=(rows, seq_len))
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ids.tolist()))


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    config = cut_layers(resolve_shape(args.shape), args.layers)
    config.save_pretrained(tmp / "model")
    _tokens(tmp / "train.jsonl", args.steps * args.batch, args.seq_len, config.vocab_size, 1)
    _tokens(tmp / "eval.jsonl", args.eval_rows, args.seq_len, config.vocab_size, 2)
    train: dict[str, Any] = {"max_steps": args.steps, "global_batch_size": args.batch}
    if args.freeze:
        train["freeze"] = args.freeze.split(",")
    raw = {
        "model": {"path": str(tmp / "model")},
        "data": {"path": str(tmp / "train.jsonl"), "seq_len": args.seq_len,
                 **({"eval_path": str(tmp / "eval.jsonl")} if args.part == "eval" else {})},
        "train": train,
        "output": {"dir": str(tmp / "out"), "export": False, "tensorboard": False},
        "runtime": {"device": args.device},
    }  # fmt: skip
    try:
        cfg = config_from_dict(raw)
    except ConfigError as e:  # an engine without the key this part measures
        return {"skipped": str(e)}
    trainer = _NoSave(cfg, log=False)
    store_bytes = trainer.store.total_bytes
    records = trainer.run()
    timed = records[1:]  # the first step warms up (allocations, compilation)
    result: dict[str, Any] = {
        "shape": f"{args.shape} cut to {args.layers} layers",
        "params": sum(trainer.store.param(n).numel() for _, n in trainer.adapter.iter_params()),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "freeze": args.freeze,
        "store_bytes": store_bytes,
        "host_pss_bytes": pss_bytes(os.getpid()),
        "step_time_s_median": statistics.median(r["step_time_s"] for r in timed),
        "train_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "update_s_median": statistics.median(r["update_s"] for r in timed),
    }
    if args.part == "eval":
        last = records[-1]
        result |= {k: last[k] for k in last if k.startswith("eval_")}
        result["eval_over_train"] = last["eval_tokens_per_s"] / result["train_tokens_per_s_median"]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["eval", "freeze"])
    p.add_argument("--shape", default="qwen3-14b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-rows", type=int, default=32)
    p.add_argument("--freeze", default="", help="train.freeze patterns, comma-separated")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="slidedp-loop-") as tmp:
        result = run(args, Path(tmp))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
