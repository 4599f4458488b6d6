"""Per-layer shapes of a decoder-only LM: what FLOPs, the cost model and the executors share.

``LayerShape`` is read from transformers' own modules built on the meta device (no weight
allocated), so it follows the architecture, not a formula per model family: the hidden size,
the MLP width, the attention widths, the key length a query attends to at a sequence length
(``S``, or the window of a sliding-attention layer), and the parameters — all of them and the
ones a token uses (equal for dense layers; a mixture-of-experts layer uses ``top_k`` of its
``experts``), with the matmul weights among them (the ``nn.Linear`` weights that FLOPs count).

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
    ffn: int  # the MLP's intermediate size (per expert)
    q_dim: int  # attention heads x head_dim
    kv_dim: int  # key/value heads x head_dim
    attended: int  # keys a query sees before the causal half: S, or min(S, window)
    params: int  # every parameter of the layer
    active_params: int  # the parameters one token uses (= params when dense)
    matmul_params: int  # the nn.Linear weights one token uses (FLOPs count these)
    experts: int = 1
    top_k: int = 1


def _head_dim(config: PretrainedConfig) -> int:
    heads = int(config.num_attention_heads)
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


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
    head_dim = _head_dim(config)
    q_dim = int(config.num_attention_heads) * head_dim
    kv_dim = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    kv_dim *= head_dim
    shapes = []
    top_k = int(getattr(config, "num_experts_per_tok", None) or 1)
    for layer, attended in zip(model.model.layers, attended_lengths(config, seq_len), strict=True):
        params = sum(p.numel() for p in layer.parameters())
        matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        # a mixture of experts: its experts' stacked weights, of which a token uses top_k
        stacks = [m for m in layer.modules() if type(m).__name__.endswith("Experts")]
        experts = max((int(m.num_experts) for m in stacks), default=1)
        expert_params = sum(p.numel() for m in stacks for p in m.parameters())
        active = expert_params * min(top_k, experts) // experts
        shapes.append(
            LayerShape(
                hidden=int(config.hidden_size),
                ffn=int(config.intermediate_size),
                q_dim=q_dim,
                kv_dim=kv_dim,
                attended=attended,
                params=params,
                active_params=params - expert_params + active,
                matmul_params=matmul + active,
                experts=experts,
                top_k=min(top_k, experts),
            )
        )
    return shapes
