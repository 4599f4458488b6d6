"""The estimate of a tiled MLP (``runtime.mlp_tile_tokens``): the layer's footprint measured on the
meta device with the tiles (``plan.cost``) against what can be derived by hand, and the step-time
model's recompute."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3Config

from slidedp.models.fast import Compute
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import REPLAY_PEAK_FACTOR, LayerFootprint, layer_footprint
from slidedp.plan.layout import parse_entry
from slidedp.plan.policy import Policy
from slidedp.plan.timing import LAYER_EFFICIENCY, Ranks, Rates, compute_times

H, W, S, TILE = 256, 1024, 32768, 1024  # hidden, intermediate (MLP width), tokens, tile
BF16 = 2  # bytes


def _adapter() -> HFAdapter:
    config = Qwen3Config(
        hidden_size=H, intermediate_size=W, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=S,
    )  # fmt: skip
    return HFAdapter(config)


def _footprints(family: str, tile: int) -> tuple[LayerFootprint, LayerFootprint]:
    adapter = _adapter()
    _, policy = parse_entry(family, 0.0)
    tiled = Compute("eager", "", mlp_tile_tokens=tile)
    return (
        layer_footprint(adapter, policy, 1, S, torch.bfloat16, 0, "eager"),
        layer_footprint(adapter, policy, 1, S, torch.bfloat16, 0, tiled),
    )


def test_the_layer_backward_drops_by_the_mlp_intermediates_less_one_tile() -> None:
    """Full checkpointing: the replay no longer saves the MLP's four [S, W] tensors (gate,
    SiLU(gate), up, their product); the MLP's input is saved either way. One tile's backward
    adds its own replay (its input [T, H] and the four [T, W]) at the replay's peak factor,
    the weight gradients' float32 sums and one tile's BF16 weight gradients (3 H W each)."""
    untiled, tiled = _footprints("F", TILE)
    assert untiled.replay_bytes - tiled.replay_bytes == 4 * S * W * BF16
    one_tile = round(REPLAY_PEAK_FACTOR * (TILE * H + 4 * TILE * W) * BF16)
    assert tiled.tile_bytes == one_tile + 3 * H * W * (4 + BF16)
    drop = round(REPLAY_PEAK_FACTOR * untiled.replay_bytes) - round(
        REPLAY_PEAK_FACTOR * tiled.replay_bytes
    )
    assert untiled.transient_bytes - tiled.transient_bytes == drop - tiled.tile_bytes
    assert tiled.transient_bytes < 0.6 * untiled.transient_bytes  # at S = 32 tiles


def test_no_checkpointing_keeps_the_mlp_input_instead_of_its_intermediates() -> None:
    untiled, tiled = _footprints("N", TILE)
    assert sum(untiled.saved) - sum(tiled.saved) == 4 * S * W * BF16
    assert tiled.transient_bytes == round((REPLAY_PEAK_FACTOR - 1) * sum(tiled.saved)) + (
        tiled.tile_bytes
    )


@pytest.mark.parametrize("family", ["F", "N", "S1010100", "SAC.mm"])
def test_a_tile_of_every_token_costs_what_the_untiled_layer_costs(family: str) -> None:
    untiled, tiled = _footprints(family, S)
    assert dataclasses.replace(tiled, tile_bytes=0) == untiled
    assert tiled.tile_bytes == 0


def test_the_step_time_model_prices_one_more_mlp_forward() -> None:
    adapter = _adapter()
    layers = (parse_entry("F", 0.0)[1],)
    policy = Policy("replicated", "gpu", 1, 2, 2, 4, False, layers, Compute("eager", ""))
    tiled = dataclasses.replace(policy, compute=Compute("eager", "", mlp_tile_tokens=TILE))
    rates = Rates(peak_flops=1e15, adamw_gbps=100.0)
    (f0,), (b0,), _ = compute_times(adapter, policy, batch=1, seq_len=S, rates=rates, ranks=Ranks())
    (f1,), (b1,), _ = compute_times(adapter, tiled, batch=1, seq_len=S, rates=rates, ranks=Ranks())
    assert f1 == f0
    assert b1 - b0 == pytest.approx(2 * 3 * H * W * S / (LAYER_EFFICIENCY * 1e15))
