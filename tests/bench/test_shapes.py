"""The named shapes against transformers' Qwen3Config and the published parameter counts."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config

from bench.tiny import write_tiny_config
from slidedp.bench.shapes import SHAPES, resolve_shape
from slidedp.errors import ConfigError

# Published by Qwen (model cards): total and non-embedding parameters, in billions, rounded.
PUBLISHED = {
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2),
}


def _rope_theta(config: PretrainedConfig) -> float:
    rope = getattr(config, "rope_parameters", None)  # transformers >= 5 moved it there
    return float(rope["rope_theta"] if rope else config.rope_theta)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_key_is_a_qwen3_config_field(name: str) -> None:
    # PretrainedConfig keeps unknown kwargs as attributes: a typo would be silently ignored.
    fields = set(inspect.signature(Qwen3Config.__init__).parameters) | {"rope_theta"}
    assert set(SHAPES[name]) <= fields
    config = resolve_shape(name)
    assert _rope_theta(config) == SHAPES[name]["rope_theta"]
    for key, value in SHAPES[name].items():
        if key != "rope_theta":
            assert getattr(config, key) == value, key


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_counts_match_the_published_ones(name: str) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(resolve_shape(name))  # type: ignore[no-untyped-call]
    total = sum(p.numel() for p in model.parameters())
    vocab_h = model.model.embed_tokens.weight.numel()
    heads = 1 if model.config.tie_word_embeddings else 2  # embedding (+ untied LM head)
    published_total, published_body = PUBLISHED[name]
    assert total / 1e9 == pytest.approx(published_total, abs=0.05)
    assert (total - heads * vocab_h) / 1e9 == pytest.approx(published_body, abs=0.05)


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
