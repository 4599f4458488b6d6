"""GPU and host memory of a training run on a named Qwen3 shape (random init, seeded).

Run on the GPU machine: ``python benches/engine_memory.py --shape qwen3-4b --batch 4 --steps 3``.
Prints one JSON object: parameters, step times, GPU peak reserved/allocated, host PSS (the store
is shared memory: PSS counts it once across processes) and PSS per billion parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from transformers import Qwen3Config

SHAPES = {  # hidden, intermediate, layers, heads, kv heads (head_dim 128, vocab 151936)
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
}


def pss_gib() -> dict[str, float]:
    """Pss and its split (anonymous, file-backed, shared memory) from smaps_rollup, in GiB."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"):
            out[key.lower()] = int(rest.split()[0]) / 2**20
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--offload-ratio", type=float, default=1.0)
    p.add_argument("--grad-slots", type=int, default=2)
    args = p.parse_args()
    hidden, inter, layers, heads, kv, tied = SHAPES[args.shape]
    from slidedp.config import load_config
    from slidedp.runtime.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        Qwen3Config(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=max(4096, args.seq),
            tie_word_embeddings=tied,
        ).to_json_file(root / "config.json")
        gen = torch.Generator().manual_seed(0)
        with open(root / "data.jsonl", "w") as f:
            for _ in range(args.batch * args.steps):
                ids = torch.randint(0, 151936, (args.seq,), generator=gen).tolist()
                f.write(json.dumps({"input_ids": ids}) + "\n")
        raw = {
            "model": {"path": str(root)},
            "data": {"path": str(root / "data.jsonl"), "seq_len": args.seq},
            "train": {
                "max_steps": args.steps,
                "global_batch_size": args.batch,
                "learning_rate": 1e-5,
                "max_grad_norm": args.max_grad_norm,
            },
            "output": {"dir": str(root / "out")},
            "runtime": {
                "device": "cuda",
                "offload_ratio": args.offload_ratio,
                "grad_slots": args.grad_slots,
            },
        }
        (root / "c.yaml").write_text(yaml.safe_dump(raw))
        start = time.perf_counter()
        trainer = Trainer(load_config(str(root / "c.yaml")), log=True)
        setup_s = time.perf_counter() - start
        records = []  # the engine alone: no checkpoint or export of a multi-GB model
        for t in range(args.steps):
            step_start = time.perf_counter()
            result = trainer.engine.step(t, trainer.data.batch(t), 1e-5)
            records.append(
                {"step_time_s": time.perf_counter() - step_start, "loss": result.loss}
                | trainer.engine.lane_times()
            )
        trainer.engine.drain()
        numel = sum(q.numel for q in trainer.store.layout.params)
        result = {
            "shape": args.shape,
            "batch": args.batch,
            "seq": args.seq,
            "params": numel,
            "setup_s": setup_s,
            "step_time_s": [r["step_time_s"] for r in records],
            "losses": [r["loss"] for r in records],
            "lanes_last_step": records[-1],
            "max_grad_norm": args.max_grad_norm,
            "offload_ratio": args.offload_ratio,
            "gpu_max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "gpu_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "window_param_gib": trainer.engine.window.param_bytes() / 2**30,
            "host_pss_split_gib": pss_gib(),
            "activation_arena_gib": trainer.engine.activations.pinned_bytes() / 2**30,
            "store_gib": trainer.store.total_bytes / 2**30,
        }
        result["host_pss_gib"] = result["host_pss_split_gib"]["pss"]
        result["host_pss_gib_per_billion"] = result["host_pss_gib"] / (numel / 1e9)
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
