"""Write store state as safetensors, HF-style: the tensor files of checkpoints (whose weight
part is an HF model directory, ``io.checkpoint``).

Invariants: tensors stream from the store's views straight to the file (no copy in memory);
files over ``max_shard_bytes`` are split HF-style with ``model.safetensors.index.json``; tied
embeddings are saved the HF way (only ``model.embed_tokens.weight``). Tokenizer files of the
source directory are copied along.

Example::

    write_region(adapter, store, "master", Path("ckpt"), "model")  # model.safetensors (+ index)
    write_region(adapter, store, "exp_avg", Path("ckpt/optimizer"), "exp_avg")  # Adam m
    copy_tokenizer(adapter.path, Path("ckpt"))
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from slidedp.models.hf import HFAdapter
from slidedp.store import HostStore, StateRegion

DEFAULT_MAX_SHARD_BYTES = 4 << 30
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Stream (name, contiguous CPU tensor) pairs into one safetensors file, without copies."""
    items = list(tensors)  # views only: the header needs every shape before the data
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset_bytes = 0
    for name, t in items:
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset_bytes, offset_bytes + _nbytes(t)],
        }
        offset_bytes += _nbytes(t)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format recommends an 8-byte aligned data start
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in items:
            assert t.is_contiguous(), "store views are contiguous"
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def write_sharded(
    out_dir: Path,
    prefix: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """``prefix.safetensors``, or shards of at most ``max_shard_bytes`` (a larger tensor gets
    a shard of its own) plus ``prefix.safetensors.index.json``; returns the files written."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    shard_bytes = 0
    for name, t in tensors:
        if shards[-1] and shard_bytes + _nbytes(t) > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, t))
        shard_bytes += _nbytes(t)
    if len(shards) == 1:
        write_safetensors(out_dir / f"{prefix}.safetensors", shards[0])
        return [out_dir / f"{prefix}.safetensors"]
    files, weight_map, total_bytes = [], {}, 0
    for i, shard in enumerate(shards, start=1):
        file = out_dir / f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(file, shard)
        files.append(file)
        weight_map.update({name: file.name for name, _ in shard})
        total_bytes += sum(_nbytes(t) for _, t in shard)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    index_file = out_dir / f"{prefix}.safetensors.index.json"
    index_file.write_text(json.dumps(index, indent=2) + "\n")
    return [*files, index_file]


def write_region(
    adapter: HFAdapter,
    store: HostStore,
    region: StateRegion,
    out_dir: Path,
    prefix: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """One f32 state region (``master``, ``exp_avg``, ``exp_avg_sq``) under the HF names; the
    master weights with the decoder layers' persistent buffers (``models.buffers``); the
    moments of the trained parameters only (a frozen one has none)."""
    names = [full for _, full in adapter.iter_params()]
    if region != "master":
        names = [n for n in names if n not in adapter.frozen]
    tensors = [(n, store.param(n, region)) for n in names]
    if region == "master":
        values = adapter.buffers.values
        tensors += [(n, values[n].contiguous()) for n in adapter.buffers.persistent]
    return write_sharded(out_dir, prefix, tensors, max_shard_bytes)


def copy_tokenizer(source: Path | None, out_dir: Path) -> None:
    if source is not None:
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                shutil.copy(source / file, out_dir / file)
