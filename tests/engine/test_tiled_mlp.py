"""The sequence-tiled MLP (``runtime.mlp_tile_tokens``, ``models.tiled_mlp``) in every activation
family and offload ratio: the layer's gradients those of the untiled layer, and training a few
steps equal to the untiled run."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from engine.test_activations import FAMILIES, _forward_backward, _layer, check_frozen_gradients
from engine.tiny import make_model, read_metrics, write_config, write_data
from slidedp.cli import main
from slidedp.models.tiled_mlp import mlp_tile, use_tiled_mlps
from slidedp.plan.layout import parse_entry
from slidedp.runtime.activations import LayerRun, executor_for

# Tiling sums each weight's gradient over the tiles instead of inside one matmul: float32
# additions in another order, each rounding at most 2^-24 relative to partial sums of the
# gradient's size; over the 24 tokens of the layer below that stays under 1e-6 of the
# largest gradient (the layer's output and the input's gradient are computed per token, so
# the input's gradient is exact up to the matmul's own blocking).
LAYER_RTOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=LAYER_RTOL, atol=LAYER_RTOL * float(b.abs().max()))


@pytest.mark.parametrize("ratio", ["", "-r1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_with_tiles_gives_the_untiled_gradients(family: str, ratio: str) -> None:
    """Tiles of 5 tokens over 2 x 12 (the last one short); the forward's slot is overwritten
    with NaN before the backward, so a weight read from it would show."""
    adapter, x, params, ctx = _layer("qwen3")
    untiled = _forward_backward(adapter, x, params, ctx, "F")
    use_tiled_mlps(adapter, 5)
    assert mlp_tile(cast(nn.Module, adapter.layer_module(0).mlp)) == 5
    tiled = _forward_backward(adapter, x, params, ctx, family + ratio)
    assert all(torch.isfinite(t).all() for t in tiled), "read the overwritten slot"
    assert all(_close(a, b) for a, b in zip(tiled, untiled, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(tiled, untiled, strict=True)), "not tiled"


@pytest.mark.parametrize("family", ["F", "N", "S1010100", "SAC.mm"])
def test_a_tile_of_every_token_is_the_untiled_layer_bit_for_bit(family: str) -> None:
    adapter, x, params, ctx = _layer("qwen3")
    untiled = _forward_backward(adapter, x, params, ctx, family)
    use_tiled_mlps(adapter, x.shape[0] * x.shape[1])
    tiled = _forward_backward(adapter, x, params, ctx, family)
    assert all(torch.equal(a, b) for a, b in zip(tiled, untiled, strict=True))


@pytest.mark.parametrize("family", ["F", "N", "S0000001", "SAC.attn"])
def test_tiles_leave_out_frozen_and_unneeded_gradients(family: str) -> None:
    """A frozen MLP weight and the input get no gradient; the others are those of the
    backward that computes them all, bit for bit (the same tiles, the same sums)."""
    adapter, x, params, ctx = _layer("qwen3")
    use_tiled_mlps(adapter, 7)
    frozen = frozenset({"mlp.up_proj.weight", "self_attn.q_proj.weight"})
    check_frozen_gradients(adapter, (x, params, ctx), family, frozen)


def test_the_tiles_save_the_mlp_input_instead_of_its_intermediates() -> None:
    """``N`` keeps every saved tensor: the tiled layer keeps the MLP's input (2 x 12 x 64)
    where the untiled one keeps gate, up, act(gate) and their product (2 x 12 x 128 each)
    and no more."""
    adapter, x, params, ctx = _layer("qwen3")
    _, policy = parse_entry("N", 0.0)
    saved = []
    for tile in (0, 5):
        use_tiled_mlps(adapter, tile)
        _, state = executor_for(policy).forward(LayerRun(adapter, 0, params, ctx), x)
        saved.append(sum(state.saved_bytes()))
    tokens = x.shape[0] * x.shape[1]
    assert saved[0] - saved[1] >= 4 * tokens * 128 * 4 - tokens * 64 * 4


STEPS = 6
TRAIN = {"max_steps": STEPS, "global_batch_size": 4, "learning_rate": 3e-3, "max_grad_norm": 1.0}
# Training: the same per-step float32 reordering, compounded over 6 AdamW steps. The losses
# move by as little (measured < 1e-6 relative). A parameter does not: Adam's step is
# lr * m / sqrt(v), so an element whose gradient sits within that noise of zero moves by up to
# lr either way. Hence the parameters are compared by how far they moved: the difference of
# the two runs' final weights against the untiled run's movement from the initial weights
# (measured at most 1.2e-4 of it; bound 1e-3).
LOSS_RTOL = 1e-5
MOVEMENT_RTOL = 1e-3


def _train(root: Path, model: Path, name: str, runtime: dict[str, object]) -> tuple[
    list[float], dict[str, torch.Tensor]
]:  # fmt: skip
    data = write_data(root / "data.jsonl", 24)
    out = root / name
    config = write_config(root / f"{name}.yaml", model, data, out, train=TRAIN,
                          runtime=runtime, output={"tensorboard": False})  # fmt: skip
    assert main(["train", str(config)]) == 0
    return [m["loss"] for m in read_metrics(out)], load_file(out / "final" / "model.safetensors")


@pytest.mark.e2e
@pytest.mark.parametrize("layers", ["F", "2xN-r1, 1xS1010100, SAC.mm"])
def test_training_with_tiles_matches_the_untiled_run(tmp_path: Path, layers: str) -> None:
    model = make_model(tmp_path, "qwen3", tied=True, layers=4)
    losses, params = _train(tmp_path, model, "untiled", {"layers": layers})
    same_losses, same = _train(tmp_path, model, "whole", {"layers": layers,
                                                         "mlp_tile_tokens": 4096})  # fmt: skip
    assert same_losses == losses  # a tile longer than the rows: the untiled layer
    assert all(torch.equal(same[k], params[k]) for k in params)
    tiled_losses, tiled = _train(tmp_path, model, "tiled", {"layers": layers,
                                                           "mlp_tile_tokens": 7})  # fmt: skip
    assert tiled_losses == pytest.approx(losses, rel=LOSS_RTOL)
    assert any(not torch.equal(tiled[k], params[k]) for k in params), "not tiled"
    initial = load_file(model / "model.safetensors")
    for k in params:
        moved = (params[k] - initial[k]).norm()
        assert (tiled[k] - params[k]).norm() <= MOVEMENT_RTOL * moved, k


def test_a_mixture_of_experts_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model(tmp_path, "qwen3_moe", tied=False, layers=2)
    data = write_data(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", model, data, out,
                          runtime={"mlp_tile_tokens": 8})  # fmt: skip
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert "runtime.mlp_tile_tokens=8 tiles dense MLPs" in err
    assert "set runtime.mlp_tile_tokens=0" in err
    assert not out.exists()
