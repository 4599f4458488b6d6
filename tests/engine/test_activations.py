"""Checkpoint families (``runtime.activations``) against full-layer checkpointing, CPU float32.

Every family runs transformers' own submodules with the same operations in the same order as
the module's forward, and differentiates the same graph (replayed or kept), so outputs and
gradients are equal bit for bit: the tests compare with ``torch.equal``, no tolerance. An
offload ratio only moves tensors and back (a copy is exact). A single layer is checked in
isolation (with the forward's slot overwritten before the backward, as the window does), then
whole training runs with clipping on two architectures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import MistralConfig

from engine.tiny import CONFIGS, make_model, read_metrics, write_config, write_data
from slidedp.cli import main
from slidedp.models.hf import HFAdapter
from slidedp.plan.layout import parse_entry
from slidedp.runtime.activations import LayerRun, executor_for
from slidedp.runtime.activations.offload import ActivationOffload, offload_count
from slidedp.runtime.activations.segments import SEGMENTS, run_segments
from slidedp.runtime.lanes import LaneClock

ARCHS = {**CONFIGS, "mistral": MistralConfig}
FAMILIES = ["F", "N", "S1111111", "S1010100", "S0000001", "SAC.mm", "SAC.attn", "SAC.noact"]
CPU = torch.device("cpu")


def _layer(arch: str) -> tuple[HFAdapter, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    config = ARCHS[arch](
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
    )  # fmt: skip
    adapter = HFAdapter(config)
    torch.manual_seed(0)
    group = adapter.groups[adapter.layer_group(0)]
    shapes = adapter.shapes()
    numels = [torch.Size(shapes[full]).numel() for full, _ in group.params]
    slot = torch.randn(sum(numels)) * 0.1  # one flat buffer, as a window slot
    params = {local: t.view(shapes[full]) for (full, local), t in
              zip(group.params, torch.split(slot, numels), strict=True)}  # fmt: skip
    x = torch.randn(2, 12, 64)
    position_ids = torch.arange(12).unsqueeze(0)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, 9:] = 0  # a padded row: the masks are real tensors
    ctx = {
        "position_ids": position_ids,
        "position_embeddings": adapter.position_embeddings(
            adapter.make_rotary(CPU), x, position_ids
        ),
        "masks": adapter.layer_masks(x, padding, position_ids),
    }
    return adapter, x, params, ctx


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_segments_reproduce_the_decoder_layer_bit_for_bit(arch: str) -> None:
    adapter, x, params, ctx = _layer(arch)
    module = adapter.layer_module(0)
    with torch.no_grad():
        whole, _ = adapter.run_layer(0, params, x, ctx)
        (pieces,) = run_segments(module, params, (x,), ctx, 0, 0, len(SEGMENTS) - 1)
    assert torch.equal(whole, pieces)


def _forward_backward(
    adapter: HFAdapter,
    x: torch.Tensor,
    params: dict[str, torch.Tensor],
    ctx: dict[str, Any],
    text: str,
) -> tuple[torch.Tensor, ...]:
    _, policy = parse_entry(text, 0.0)
    executor = executor_for(policy)
    y, state = executor.forward(LayerRun(adapter, 0, params, ctx), x)
    offload = ActivationOffload(CPU, LaneClock(CPU))
    offload.offload(0, state, offload_count(state.saved_bytes(), policy.ratio))
    if policy.ratio > 0:
        assert any(t is None for t in state.tensors), "nothing left the device"
    # the window reloads the layer into another slot and overwrites this one
    backward_params = {n: p.clone() for n, p in params.items()}
    for p in params.values():
        p.fill_(float("nan"))
    offload.reload(0, state)
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    g_x, grads = executor.backward(LayerRun(adapter, 0, backward_params, ctx), state, g)
    assert g_x is not None
    for n, p in params.items():
        p.copy_(backward_params[n])
    return (y, g_x, *(grads[n] for n in params))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_leaves_out_frozen_and_unneeded_gradients_and_keeps_the_others(
    family: str,
) -> None:
    """``LayerRun.frozen`` and ``input_grad`` (train.freeze): the gradients left are those of
    the whole backward, bit for bit; the frozen ones and the input's are not computed."""
    adapter, x, params, ctx = _layer("qwen3")
    frozen = frozenset(n for n in params if ".mlp." in f".{n}" or n.endswith("q_proj.weight"))
    check_frozen_gradients(adapter, (x, params, ctx), family, frozen)


def check_frozen_gradients(
    adapter: HFAdapter,
    layer: tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]],
    family: str,
    frozen: frozenset[str],
) -> None:
    """The layer's backward in ``family`` with ``frozen`` weights and no input gradient: the
    gradients left are those of the whole backward, bit for bit; the others not computed."""
    x, params, ctx = layer
    _, policy = parse_entry(family, 0.0)
    g = torch.linspace(-1, 1, x.numel()).view_as(x)
    results = []
    for run_args in ({}, {"frozen": frozen, "input_grad": False}):
        executor = executor_for(policy)
        run = LayerRun(adapter, 0, params, ctx, **run_args)  # type: ignore[arg-type]
        _, state = executor.forward(run, x)
        results.append(executor.backward(run, state, g))
    (g_x, whole), (no_x, part) = results
    assert g_x is not None
    assert no_x is None
    assert set(part) == set(whole) - frozen
    assert all(torch.equal(part[n], whole[n]) for n in part)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("ratio", ["", "-r0.5", "-r1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_and_ratio_gives_the_gradients_of_full_checkpointing(
    arch: str, family: str, ratio: str
) -> None:
    adapter, x, params, ctx = _layer(arch)
    full = _forward_backward(adapter, x, params, ctx, "F")
    other = _forward_backward(adapter, x, params, ctx, family + ratio)
    assert all(torch.isfinite(t).all() for t in other), "read the overwritten slot"
    assert all(torch.equal(a, b) for a, b in zip(full, other, strict=True))


def test_no_checkpointing_keeps_more_than_segments_and_segments_more_than_full() -> None:
    adapter, x, params, ctx = _layer("qwen3")
    saved = {}
    for text in ("F", "S1010100", "S1111111", "N"):
        _, policy = parse_entry(text, 0.0)
        _, state = executor_for(policy).forward(LayerRun(adapter, 0, params, ctx), x)
        saved[text] = sum(state.saved_bytes())
    tokens_h = x.numel() * x.element_size()
    assert saved["F"] == tokens_h  # the input alone
    assert saved["F"] < saved["S1010100"] < saved["S1111111"] < saved["N"]


STEPS = 8
TRAIN = {"max_steps": STEPS, "global_batch_size": 4, "learning_rate": 3e-3, "max_grad_norm": 2.4}


def _train(
    tmp_path: Path, model: Path, name: str, layers: str
) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    data = write_data(tmp_path / "data.jsonl", 32)
    out = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", model, data, out, train=TRAIN,
                          runtime={"layers": layers}, output={"tensorboard": False})  # fmt: skip
    assert main(["train", str(config)]) == 0
    metrics = [(m["loss"], m["grad_norm"]) for m in read_metrics(out)]
    return metrics, load_file(out / "final" / "model.safetensors")


Run = tuple[Path, list[tuple[float, float]], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Run]:
    """The model of ``(arch, tied)`` and its run with full checkpointing, trained once per
    module (every layout of that model compares with it)."""
    runs: dict[tuple[str, bool], Run] = {}

    def full(arch: str, tied: bool) -> Run:
        if (arch, tied) not in runs:
            root = tmp_path_factory.mktemp(f"full-{arch}")
            model = make_model(root, arch, tied=tied, layers=5)
            runs[arch, tied] = (model, *_train(root, model, "full", "F"))
        return runs[arch, tied]

    return full


@pytest.mark.e2e
@pytest.mark.parametrize(("arch", "tied"), [("qwen3", True), ("llama", False)])
@pytest.mark.parametrize(
    "layers",
    [
        "2xF-r1, 1xS1010100-r0.5, 1xSAC.mm, N-r0.3",  # every family in one model
        "N",
        "S0110110-r1",
        "SAC.noact-r0.5",
    ],
)
def test_training_with_any_layout_is_bit_identical_to_full_checkpointing(
    tmp_path: Path, full_runs: Callable[[str, bool], Run], arch: str, tied: bool, layers: str
) -> None:
    model, full_metrics, full_params = full_runs(arch, tied)
    metrics, params = _train(tmp_path, model, "layout", layers)
    assert len(metrics) == STEPS
    assert metrics == full_metrics  # losses and gradient norms, every step
    assert full_params.keys() == params.keys()
    assert all(torch.equal(full_params[k], params[k]) for k in params)
