"""Host memory of 1 rank against 2 ranks on one shared store (CPU, gloo): PSS over the tree.

Run: ``python benches/ranks_memory.py`` (about a minute on 2 cores). Trains a ~190 M-parameter
Qwen3-shaped model (random init, f32) for 3 steps with ``runtime.ranks`` 1 and 2 and samples
the PSS summed over the ``slidedp train`` process tree (the store is shared memory: PSS counts
it once however many ranks map it) and its shared-memory part. Prints one JSON object.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from transformers import Qwen3Config

from slidedp.bench.measure import process_tree

VOCAB = 32000


def tree_pss(pid: int) -> dict[str, int]:
    """``Pss`` and ``Pss_Shmem`` (kB) summed over ``pid``'s process tree."""
    total = {"Pss": 0, "Pss_Shmem": 0}
    for p in process_tree(pid):
        try:
            lines = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in lines:
            key, _, rest = line.partition(":")
            if key in total:
                total[key] += int(rest.split()[0])
    return total


def peak_pss(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``; the peak PSS (and its shared-memory part) of its tree in GiB, every 0.2 s."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = {"Pss": 0, "Pss_Shmem": 0}
    while proc.poll() is None:
        now = tree_pss(proc.pid)
        if now["Pss"] > peak["Pss"]:
            peak = now
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read() if proc.stderr else ''}")
    return {
        "pss_gib": round(peak["Pss"] / 2**20, 3),
        "shmem_gib": round(peak["Pss_Shmem"] / 2**20, 3),
    }


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                             vocab_size=VOCAB, tie_word_embeddings=True)  # fmt: skip
        config.to_json_file(root / "config.json")
        gen = torch.Generator().manual_seed(0)
        with (root / "data.jsonl").open("w") as f:
            for _ in range(12):
                ids = torch.randint(0, VOCAB, (64,), generator=gen).tolist()
                f.write(json.dumps({"input_ids": ids}) + "\n")
        result: dict[str, object] = {}
        for ranks in (1, 2):
            raw = {
                "model": {"path": str(root)},
                "data": {"path": str(root / "data.jsonl"), "seq_len": 64},
                "train": {"max_steps": 3, "global_batch_size": 4},
                "output": {
                    "dir": str(root / f"out{ranks}"),
                    "export": False,
                    "tensorboard": False,
                },
                "runtime": {"device": "cpu", "ranks": ranks},
            }
            (root / f"c{ranks}.yaml").write_text(yaml.safe_dump(raw))
            cmd = [sys.executable, "-m", "slidedp", "train", str(root / f"c{ranks}.yaml")]
            result[f"ranks_{ranks}"] = peak_pss(cmd)
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
