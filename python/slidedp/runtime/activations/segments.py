"""The decoder layer of Llama, Mistral, Qwen2 and Qwen3 as eight segments, each a call of one of
transformers' own submodules or the residual add, in the order of the layer's ``forward``.

Boundaries (the state after each; ``x`` the layer input, ``x1`` the residual after attention)::

    b0 input norm (x, h)         b1 attention (x, a)       b2 residual (x1 = x + a,)
    b3 post-attn norm (x1, h2)   b4 gate/up (x1, g, u)     b5 activation (x1, m = act(g) * u)
    b6 down (x1, d)              end (x1 + d,)

A segment mask ``S1010100`` saves the states at b0, b2 and b4 (first bit = b0). An MLP tiled
along the sequence (``models.tiled_mlp``) over more than one tile runs whole in the down
segment: b4 and b5 are then ``(x1, h2)``, its input. Invariant: the segments reproduce the
module bit for bit on each architecture (``tests/engine/test_activations.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slidedp.models.bind import bind_params
from slidedp.models.hf import no_cache
from slidedp.models.tiled_mlp import tiles

BOUNDARIES = (
    "input norm",
    "attention",
    "residual",
    "post-attention norm",
    "gate/up",
    "activation",
    "down",
)
State = tuple[torch.Tensor, ...]
Segment = Callable[[Any, State, dict[str, Any], int], State]  # (layer module, ..., layer)


def _norm1(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    return s[0], m.input_layernorm(s[0])


def _attention(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    out, _ = m.self_attn(
        hidden_states=s[1],
        attention_mask=ctx["masks"][layer],
        position_ids=ctx["position_ids"],
        **no_cache(type(m.self_attn).forward),
        use_cache=False,
        position_embeddings=ctx["position_embeddings"][layer],
    )
    return s[0], out


def _residual1(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    return (s[0] + s[1],)


def _norm2(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    return s[0], m.post_attention_layernorm(s[0])


def _tiled(m: Any, s: State) -> bool:
    """Whether the MLP runs tiled on the MLP input ``s[1]``: then ``_down`` takes it whole (told
    apart from the product ``_activation`` gives it by its width: an MLP as wide as its
    hidden size runs untiled in segments)."""
    return tiles(m.mlp, s[1]) and s[1].shape[-1] != m.mlp.down_proj.in_features


def _gate_up(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    if _tiled(m, s):
        return s
    return s[0], m.mlp.gate_proj(s[1]), m.mlp.up_proj(s[1])


def _activation(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    if len(s) == 2:  # the tiled MLP's input (``_gate_up``)
        return s
    return s[0], m.mlp.act_fn(s[1]) * s[2]


def _down(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    if _tiled(m, s):
        return s[0], m.mlp(s[1])
    return s[0], m.mlp.down_proj(s[1])


def _residual2(m: Any, s: State, ctx: dict[str, Any], layer: int) -> State:
    return (s[0] + s[1],)


SEGMENTS: tuple[Segment, ...] = (
    _norm1,
    _attention,
    _residual1,
    _norm2,
    _gate_up,
    _activation,
    _down,
    _residual2,
)
_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def check_segmentable(module: nn.Module) -> None:
    """The submodules the segments call exist (the four supported architectures have them)."""
    missing = [p for p in _PARTS if not hasattr(module, p)]
    missing += [f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj", "act_fn")
                if hasattr(module, "mlp") and not hasattr(module.mlp, p)]  # fmt: skip
    if missing:
        raise ValueError(f"{type(module).__name__} has no {', '.join(missing)}: not segmentable")


def run_segments(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    state: State,
    ctx: dict[str, Any],
    layer: int,
    first: int,
    last: int,
) -> State:
    """Segments ``first..last`` (inclusive) of ``module`` (decoder layer ``layer``: its mask
    and rotary in ``ctx``) with its parameters bound to ``params``, from ``state`` (the state
    before segment ``first``)."""
    bind_params(module, params)
    for seg in SEGMENTS[first : last + 1]:
        state = seg(module, state, ctx, layer)
    return state
