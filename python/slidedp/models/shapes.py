"""Named model shapes for the benchmarks: the Qwen3 dense family, MoE and Gemma 3 models,
models whose layers differ (Gemma 4, Qwen3.5-MoE), or any HF config.json.

Values are those of the published config.json files (``Qwen/Qwen3-*``, ``Qwen/Qwen3-30B-A3B``,
``allenai/OLMoE-1B-7B-0924``, ``mistralai/Mixtral-8x7B-v0.1``, the text parts of
``google/gemma-3-12b-pt``, ``google/gemma-4-31B`` as its model card describes it and
``Qwen/Qwen3.5-35B-A3B`` as transformers' ``Qwen3_5MoeTextConfig`` defaults). Invariant: weights
are never downloaded; the benchmarks initialise randomly, which does not change a step's time.
``model_type`` picks the config class (default qwen3).

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
    "qwen3-32b": {
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        **_QWEN3_COMMON,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        **_QWEN3_COMMON,
    },
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "router_aux_loss_coef": 0.01,
        "vocab_size": 50304,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "gemma4-31b": {
        "model_type": "gemma4_text",
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,
        "sliding_window": 1024,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 30.0,
        "vocab_size": 262144,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
    },
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "router_aux_loss_coef": 0.001,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    "gemma3-12b": {
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}


def resolve_shape(shape: str) -> PretrainedConfig:
    """A name of ``SHAPES``, or the path of an HF ``config.json`` (or of its directory)."""
    from transformers import AutoConfig  # noqa: PLC0415  the CLI imports SHAPES for --help

    if shape in SHAPES:
        values = dict(SHAPES[shape])
        named: PretrainedConfig = AutoConfig.for_model(values.pop("model_type", "qwen3"), **values)
        return named
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


def cut_layers(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """``config`` cut to its first ``layers`` decoder layers (``--layers``: a big model's
    per-layer throughput on a host that cannot hold all of it)."""
    total = int(config.num_hidden_layers)
    if not 1 <= layers <= total:
        raise ConfigError(f"--layers {layers}: the shape has {total} layers, give 1..{total}")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return config
