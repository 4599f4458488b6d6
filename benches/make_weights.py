"""A model directory with weights, to time a run's start from safetensors where nothing can be
downloaded: ``python benches/make_weights.py --shape qwen3-14b --out DIR``.

Writes ``DIR/config.json`` (the bench shape's) and BF16 safetensors shards of at most
``--shard-gb`` GB with their ``model.safetensors.index.json``, laid out and named as
``save_pretrained`` writes them (a tied head not stored), one shard in memory at a time. The
values repeat one seeded block of N(0, 0.02) draws (norm weights 1): what is timed is reading
and casting them, not what they teach. Prints the seconds it took and the bytes written.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from slidedp.models.shapes import SHAPES, resolve_shape

BLOCK = 1 << 22  # values in the repeated block


def shapes(config: object) -> dict[str, tuple[int, ...]]:
    """The stored tensors' names and shapes, in the model's order."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (tied and name == "lm_head.weight")}  # fmt: skip


def tensor(shape: tuple[int, ...], name: str, block: torch.Tensor) -> torch.Tensor:
    numel = math.prod(shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    reps = -(-numel // BLOCK)
    return block.repeat(reps)[:numel].view(shape).clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-4b", help=f"{', '.join(SHAPES)} or a config.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shard-gb", type=float, default=5.0)
    args = parser.parse_args()
    start = time.perf_counter()
    config = resolve_shape(args.shape)
    args.out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(args.out / "config.json")
    block = (torch.randn(BLOCK, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    names = shapes(config)
    # shards by name first (the files' count is in their names), each written once it is full
    shards: list[list[str]] = [[]]
    sizes = [0]
    for name, shape in names.items():
        nbytes = 2 * math.prod(shape)
        if sizes[-1] and sizes[-1] + nbytes > args.shard_gb * 1e9:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: tensor(names[name], name, block) for name in shard}
        save_file(tensors, str(args.out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    print(json.dumps({"seconds": round(time.perf_counter() - start, 1), "bytes": sum(sizes),
                      "files": len(shards)}))  # fmt: skip


if __name__ == "__main__":
    main()
