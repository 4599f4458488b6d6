"""Prepares the interim ``make demo`` inputs under ``out/demo``: a config-only byte-level Qwen3
model (random init, seeded) and this repository's README as UTF-8 bytes, one 128-byte sequence per
JSONL line. Issue #6 replaces it with a real pretrained model on public-domain text.

Run: ``python examples/demo/prepare.py out/demo``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import Qwen3Config

SEQ_LEN = 128


def main(out: Path) -> None:
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    Qwen3Config(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=True,
    ).to_json_file(model_dir / "config.json")
    text = (Path(__file__).parents[2] / "README.md").read_bytes()
    with open(out / "train.jsonl", "w") as f:
        for start in range(0, len(text) - SEQ_LEN, SEQ_LEN):
            f.write(json.dumps({"input_ids": list(text[start : start + SEQ_LEN])}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
