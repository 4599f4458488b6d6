"""The named shapes against transformers' Qwen3Config and the published parameter counts."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from bench.tiny import write_tiny_config
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.models.hf_config import config_values
from slidedp.models.shape import layer_shapes
from slidedp.models.shapes import SHAPES, cut_layers, resolve_shape

# Published by Qwen (model cards): total and non-embedding parameters, in billions, rounded.
PUBLISHED = {
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2),
    "qwen3-32b": (32.8, 31.2),
    "qwen3-30b-a3b": (30.5, 29.9),  # 3.3 B active
    "mixtral-8x7b": (46.7, 46.4),  # 12.9 B active
}
ACTIVE = {"qwen3-30b-a3b": 3.3, "mixtral-8x7b": 12.9}  # published active parameters (B)


def _rope_theta(config: PretrainedConfig) -> float:
    rope = getattr(config, "rope_parameters", None)  # transformers >= 5 moved it there
    return float(rope["rope_theta"] if rope else config.rope_theta)


# Gemma 4's keys for its full-attention layers, which its config keeps per layer
FULL_LAYER_KEYS = {
    "global_head_dim": "head_dim",
    "num_global_key_value_heads": "num_key_value_heads",
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_key_is_a_field_of_its_config_class(name: str) -> None:
    # PretrainedConfig keeps unknown kwargs as attributes: a typo would be silently ignored.
    config = resolve_shape(name)
    # rope_theta moved into rope_parameters; Qwen3-MoE's attention reads head_dim by getattr
    fields = set(inspect.signature(type(config).__init__).parameters) | {"rope_theta", "head_dim"}
    assert set(SHAPES[name]) - {"model_type"} <= fields | set(FULL_LAYER_KEYS)
    assert config.model_type == SHAPES[name].get("model_type", "qwen3")
    if "rope_theta" in SHAPES[name]:
        assert _rope_theta(config) == SHAPES[name]["rope_theta"]
    for key, value in SHAPES[name].items():
        if key in ("rope_theta", "model_type"):
            continue
        values = config_values(config, FULL_LAYER_KEYS.get(key, key))
        if len(values) > 1:  # per layer: the full-attention layers' or the others'
            full = key in FULL_LAYER_KEYS
            kinds = config.layer_types
            values = [v for v, kind in zip(values, kinds, strict=True)
                      if (kind == "full_attention") == full]  # fmt: skip
        assert set(values) == {value}, key


@pytest.mark.parametrize(("name", "kinds"), [("gemma4-31b", 2), ("qwen3.5-35b-a3b", 2)])
def test_the_heterogeneous_shapes_have_layers_of_two_kinds(name: str, kinds: int) -> None:
    adapter = HFAdapter(resolve_shape(name))
    assert len(set(adapter.layer_kinds)) == kinds
    if name == "gemma4-31b":  # the model card's 30.7 B
        total = sum(math.prod(s) for s in adapter.shapes().values())
        assert total / 1e9 == pytest.approx(30.7, abs=0.05)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name: str) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(resolve_shape(name))  # type: ignore[no-untyped-call]
    total = sum(p.numel() for p in model.parameters())
    vocab_h = model.model.embed_tokens.weight.numel()
    heads = 1 if model.config.tie_word_embeddings else 2  # embedding (+ untied LM head)
    published_total, published_body = PUBLISHED[name]
    assert total / 1e9 == pytest.approx(published_total, abs=0.05)
    assert (total - heads * vocab_h) / 1e9 == pytest.approx(published_body, abs=0.05)


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_moe_active_parameters_match_the_published_ones(name: str) -> None:
    config = resolve_shape(name)
    shapes = layer_shapes(config, seq_len=1)
    embeddings = 2 * int(config.vocab_size) * int(config.hidden_size)  # embedding + LM head
    active = sum(s.active_params for s in shapes) + embeddings
    assert active / 1e9 == pytest.approx(ACTIVE[name], abs=0.1)
    assert {(s.experts, s.top_k) for s in shapes} == {
        (config.num_experts if name.startswith("qwen") else config.num_local_experts,
         config.num_experts_per_tok)
    }  # fmt: skip


def test_layers_cuts_a_shape_and_its_layer_types() -> None:
    config = cut_layers(resolve_shape("gemma3-12b"), 7)
    assert config.num_hidden_layers == 7
    assert len(config.layer_types) == 7
    with pytest.raises(ConfigError, match="has 48 layers"):
        cut_layers(resolve_shape("gemma3-12b"), 49)
    assert AutoConfig.for_model("qwen3").model_type == "qwen3"


def test_a_config_json_path_or_its_directory(tmp_path: Path) -> None:
    path = write_tiny_config(tmp_path / "m")
    assert resolve_shape(str(path)).hidden_size == 64
    assert resolve_shape(str(path.parent)).num_hidden_layers == 2


def test_unknown_shape_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown shape 'qwen3-5b': use one of qwen3-1\.7b"):
        resolve_shape("qwen3-5b")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the HF config"):
        resolve_shape(str(tmp_path))
