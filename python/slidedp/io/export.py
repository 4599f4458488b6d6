"""Export the FP32 master weights as an HF model directory (config.json + model.safetensors).

The safetensors file is written tensor by tensor straight from the store's views (no copy of
the model in memory). Tied embeddings are saved the HF way: only ``model.embed_tokens.weight``,
``tie_word_embeddings`` in the config. Tokenizer files of the source directory are copied along.

Example::

    export_hf(adapter, store, Path("run/final"))  # then from_pretrained("run/final")
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from slidedp.models.hf import HFAdapter
from slidedp.store import HostStore

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Stream (name, contiguous CPU tensor) pairs into one safetensors file."""
    items = list(tensors)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset_bytes = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset_bytes, offset_bytes + nbytes],
        }
        offset_bytes += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format recommends an 8-byte aligned data start
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in items:
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def export_hf(adapter: HFAdapter, store: HostStore, out_dir: Path) -> Path:
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors`` (f32 master weights)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter.config.save_pretrained(out_dir)
    names = [full for _, full in adapter.iter_params()]
    write_safetensors(out_dir / "model.safetensors", ((n, store.param(n)) for n in names))
    if adapter.path is not None:
        for file in _TOKENIZER_FILES:
            if (adapter.path / file).is_file():
                shutil.copy(adapter.path / file, out_dir / file)
    return out_dir
