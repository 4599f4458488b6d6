"""Named model shapes for the benchmarks: the Qwen3 dense family, or any HF config.json.

Values are those of the published ``Qwen/Qwen3-*`` config.json files (head_dim 128, vocab
151936, rope_theta 1e6, rms_norm_eps 1e-6, embeddings tied up to 4B). Weights are never
downloaded: the benchmarks initialise randomly, which does not change the time of a step.

Example::

    config = resolve_shape("qwen3-4b")  # or resolve_shape("/models/llama/config.json")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidedp.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_QWEN3_COMMON: dict[str, Any] = {
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        **_QWEN3_COMMON,
    },
    "qwen3-4b": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        **_QWEN3_COMMON,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        **_QWEN3_COMMON,
    },
    "qwen3-14b": {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        **_QWEN3_COMMON,
    },
}


def resolve_shape(shape: str) -> PretrainedConfig:
    """A name of ``SHAPES``, or the path of an HF ``config.json`` (or of its directory)."""
    from transformers import AutoConfig, Qwen3Config  # here: the CLI imports SHAPES for --help

    if shape in SHAPES:
        return Qwen3Config(**SHAPES[shape])
    path = Path(shape)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = ", ".join(SHAPES)
        raise ConfigError(
            f"unknown shape '{shape}': use one of {known}, or the path of an HF config.json"
        )
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the HF config {path}: {e}") from None
    return config
