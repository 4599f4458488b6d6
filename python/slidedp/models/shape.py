"""Per-layer shapes of a decoder-only LM: what FLOPs, the cost model and the executors share.

``LayerShape`` is read from transformers' own modules built on the meta device, each layer
from its own module (layers may differ): hidden size, attention widths, the key length a query
attends to (``S`` or a sliding window), all parameters and those a token uses (``top_k`` of a
mixture's ``experts``), with the matmul weights among them (what FLOPs count). Invariant: no
weight allocated; it follows the architecture, not a formula per family.

Example::

    shapes = layer_shapes(AutoConfig.from_pretrained(path), seq_len=4096)
    shapes[0].q_dim, shapes[0].attended, shapes[0].matmul_params
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    q_dim: int  # attention heads x head_dim (0: no softmax attention, a linear-attention layer)
    kv_dim: int  # key/value heads x head_dim
    attended: int  # keys a query sees before the causal half: S, or min(S, window)
    params: int  # every parameter of the layer
    active_params: int  # the parameters one token uses (= params when dense)
    matmul_params: int  # the nn.Linear weights one token uses (FLOPs count these)
    experts: int = 1
    top_k: int = 1
    mlp_params: int = 0  # the dense MLP's nn.Linear weights (0: none, or a mixture of experts)


def _attention_dims(layer: nn.Module, config: PretrainedConfig) -> tuple[int, int]:
    """``(q_dim, kv_dim)`` of the layer's softmax attention (``self_attn``; its own head
    dimension and key/value groups), ``(0, 0)`` for a layer without one. A linear-attention
    layer's cost grows with ``S`` only through its matmuls, which ``matmul_params`` counts."""
    attention = getattr(layer, "self_attn", None)
    if attention is None:
        return 0, 0
    q_dim = int(config.num_attention_heads) * int(attention.head_dim)
    return q_dim, q_dim // int(getattr(attention, "num_key_value_groups", 1))


def attended_lengths(config: PretrainedConfig, seq_len: int) -> list[int]:
    """Per decoder layer, the key length a query sees before the causal half: ``S``, or
    ``min(S, sliding_window)`` on sliding layers (same rule as ``HFAdapter.layer_masks``)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        kinds = ["sliding_attention" if window is not None else "full_attention"] * layers
    return [
        min(seq_len, int(window)) if kind == "sliding_attention" and window else seq_len
        for kind in kinds[:layers]
    ]


def layer_shapes(config: PretrainedConfig, seq_len: int) -> list[LayerShape]:
    """One ``LayerShape`` per decoder layer of ``config`` at ``seq_len`` tokens."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    shapes = []
    top_k = int(
        getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None) or 1
    )
    for layer, attended in zip(model.model.layers, attended_lengths(config, seq_len), strict=True):
        params = sum(p.numel() for p in layer.parameters())
        matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        # a mixture of experts: its experts' stacked weights, of which a token uses top_k
        stacks = [m for m in layer.modules() if type(m).__name__.endswith("Experts")]
        experts = max((int(m.num_experts) for m in stacks), default=1)
        expert_params = sum(p.numel() for m in stacks for p in m.parameters())
        active = expert_params * min(top_k, experts) // experts
        q_dim, kv_dim = _attention_dims(layer, config)
        mlp = getattr(layer, "mlp", None) if not stacks else None
        dense = (
            sum(m.weight.numel() for m in mlp.modules() if isinstance(m, nn.Linear)) if mlp else 0
        )
        shapes.append(
            LayerShape(
                hidden=int(config.hidden_size),
                q_dim=q_dim,
                kv_dim=kv_dim,
                attended=attended,
                params=params,
                active_params=params - expert_params + active,
                matmul_params=matmul + active,
                experts=experts,
                top_k=min(top_k, experts),
                mlp_params=dense,
            )
        )
    return shapes
