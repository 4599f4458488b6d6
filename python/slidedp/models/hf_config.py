"""What slidedp reads of and sets on a transformers model config: fields kept per layer, the
run's overrides (``model.rope_scaling`` and the like), a ``model_type`` transformers lacks.

Example::

    apply_overrides(config.get_text_config(), {"max_position_embeddings": 131072})
    values = config_values(config, "head_dim")  # one per layer where the config keeps them so
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import CONFIG_MAPPING, PretrainedConfig


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
    transformers' own ``standardize_rope_params`` / ``validate_rope`` where they exist."""
    rope = overrides.get("rope_scaling")
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


def unknown_model_type(config_file: Path) -> str | None:
    """The ``model_type`` of ``config_file`` where transformers knows no such model, else None
    (unreadable JSON included: its error is reported as it is)."""
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) and model_type not in CONFIG_MAPPING else None
