"""What slidedp reads of and sets on a transformers model config: fields kept per layer, the
run's overrides (``model.rope_scaling`` and the like), a ``model_type`` transformers lacks, the
sizes a model can be built with.

Example::

    apply_overrides(config.get_text_config(), {"max_position_embeddings": 131072})
    values = config_values(config, "head_dim")  # one per layer where the config keeps them so
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeGuard

from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from slidedp.errors import ModelLoadError

# sizes a config.json may get wrong without a type error (a negative size fails deep in torch)
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# the deepest released decoders have ~130 layers; the build makes every layer, one by one (a
# typo of 10**12 layers would run for ever)
MAX_LAYERS = 4096


def config_values(config: PretrainedConfig, field: str) -> list[Any]:
    """``config``'s ``field``: ``[value]``, or each layer's where the config keeps it per layer
    (transformers' heterogeneous configs, e.g. Gemma 4's ``head_dim``, refuse a global read)."""
    spec = config.__dict__.get("_heterogeneity_spec")
    if spec is not None and field in spec.per_layer_attributes:
        layers = range(int(config.num_hidden_layers))
        return [getattr(config.per_layer_config[i], field, None) for i in layers]
    return [getattr(config, field, None)]


def apply_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    """``overrides`` set on ``config`` in place. ``rope_scaling`` is merged into the model's
    rope parameters (transformers >= 5 keeps ``rope_theta`` there; a model with parameters per
    layer type scales its full-attention layers, as Gemma 3's checkpoints do), then checked by
    transformers' own ``standardize_rope_params`` / ``validate_rope`` where they exist, and
    here where those only warn (``_checked_rope``)."""
    rope = overrides.get("rope_scaling")
    if rope is not None:
        rope = _checked_rope(rope, config)
    for key, value in overrides.items():
        if key != "rope_scaling":
            setattr(config, key, value)
    if rope is None:
        return
    current = getattr(config, "rope_parameters", None)
    if current is None and not hasattr(config, "standardize_rope_params"):
        config.rope_scaling = dict(rope)  # transformers 4: the field itself
        return
    current = dict(current or {})
    if "full_attention" in current:  # per layer type
        current["full_attention"] = {**current["full_attention"], **rope}
    else:
        current.update(rope)
    config.rope_parameters = current
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    if hasattr(config, "validate_rope"):
        config.validate_rope()


def _checked_rope(rope: dict[str, Any], config: PretrainedConfig) -> dict[str, Any]:
    """``model.rope_scaling`` with a rope type transformers knows and a factor >= 1 (it warns
    and trains on: a factor 0 gave NaN losses). A type scaling from a pretraining length
    (YaRN, Llama 3's, LongRoPE) without ``original_max_position_embeddings`` gets the model's
    own ``max_position_embeddings``, read before ``model.max_position_embeddings`` overrides it
    (transformers would take the overridden one, and scale from the new length)."""
    current = getattr(config, "rope_parameters", None) or {}
    current = current.get("full_attention", current) or {}
    known = ("default", *ROPE_INIT_FUNCTIONS)
    kind = rope.get("rope_type", rope.get("type", current.get("rope_type", "default")))
    if kind not in known:
        raise ValueError(
            f"model.rope_scaling's rope_type {kind!r} is not one transformers knows "
            f"({', '.join(known)})"
        )
    factor = rope.get("factor")
    if "factor" in rope and (isinstance(factor, bool) or not isinstance(factor, int | float)
                             or not factor >= 1):  # fmt: skip
        raise ValueError(
            f"model.rope_scaling's factor must be a number >= 1 (how many times the context "
            f"grows), got {factor!r}"
        )
    pretrained = getattr(config, "max_position_embeddings", None)
    original = "original_max_position_embeddings"
    unknown = original not in rope and original not in current and not hasattr(config, original)
    if kind in ("yarn", "llama3", "longrope") and unknown and pretrained is not None:
        return {**rope, original: pretrained}
    return rope


def unknown_model_type(config_file: Path) -> str | None:
    """The ``model_type`` of ``config_file`` where transformers knows no such model, else None
    (unreadable JSON included: its error is reported as it is)."""
    parts = _raw_parts(config_file)
    model_type = parts[0].get("model_type") if parts else None
    return model_type if isinstance(model_type, str) and model_type not in CONFIG_MAPPING else None


def check_layer_count(config_file: Path) -> None:
    """More than ``MAX_LAYERS`` layers in ``config_file`` (or its ``text_config``) is a
    ``ModelLoadError``, read from the JSON itself: transformers' config makes a list of one
    entry per layer. A file that is not a JSON object is left to transformers to report."""
    for part in _raw_parts(config_file):
        layers = part.get("num_hidden_layers")
        if _is_int(layers) and layers > MAX_LAYERS:
            raise ModelLoadError(
                f"{config_file}: 'num_hidden_layers' is {layers:,}, more than slidedp builds "
                f"({MAX_LAYERS:,}); fix the field or re-download the model"
            )


def check_sizes(config_file: Path, config: PretrainedConfig) -> None:
    """A ``ModelLoadError`` naming ``config_file``'s field where ``config``'s sizes cannot build
    a model: a size below 1, attention heads that do not split into whole key/value groups
    (checked before any layer is built)."""

    def refuse(what: str) -> None:
        raise ModelLoadError(f"{config_file}: {what}; fix the field or re-download the model")

    for field in SIZE_FIELDS:
        for value in config_values(config, field):
            if _is_int(value) and value < 1:
                refuse(f"'{field}' is {value}, it must be >= 1")
    heads = config_values(config, "num_attention_heads")
    groups = config_values(config, "num_key_value_heads")
    n = max(len(heads), len(groups))  # one value, or one per layer
    for h, g in zip(heads * (n // len(heads)), groups * (n // len(groups)), strict=True):
        if _is_int(h) and _is_int(g) and h % g:
            given = any("num_key_value_heads" in part for part in _raw_parts(config_file))
            default = "" if given else " (transformers' default: the file does not set it)"
            refuse(
                f"'num_attention_heads' {h} is not a multiple of 'num_key_value_heads' {g}{default}"
            )


def _raw_parts(config_file: Path) -> list[dict[str, Any]]:
    """``config_file``'s JSON object and its ``text_config``, as written ([] when unreadable:
    transformers reports that)."""
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(raw, dict):
        return []
    text = raw.get("text_config")
    return [raw, text] if isinstance(text, dict) else [raw]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
