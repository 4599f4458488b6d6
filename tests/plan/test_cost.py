"""The memory of a layout measured on the meta device (``plan.cost``) equals what the same
executors keep when they really run (CPU, float32, unpadded rows as the estimate assumes)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.test_activations import _layer
from engine.tiny import tiny_config
from slidedp.models.freeze import apply_freeze
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import (
    layer_footprint,
    layout_memory,
    resident_embedding_bytes,
    resident_layer_bytes,
    resident_rank_bytes,
    resident_terms,
    resident_update_s,
)
from slidedp.plan.layout import parse_entry, parse_layout
from slidedp.runtime.activations import LayerRun, executor_for
from slidedp.store import HostStore


@pytest.mark.parametrize(
    "text", ["F", "N", "S1010100", "S1111111", "SAC.mm", "SAC.attn", "SAC.noact", "N-r0.5"]
)
def test_the_meta_footprint_is_what_the_executor_keeps_on_a_real_run(text: str) -> None:
    adapter, x, params, ctx = _layer("qwen3")
    ctx["masks"] = [None]  # unpadded: the attention kernel's own causal mask
    _, policy = parse_entry(text, 0.0)
    _, state = executor_for(policy, measure=True).forward(LayerRun(adapter, 0, params, ctx), x)
    b, s, _ = x.shape
    fp = layer_footprint(adapter, policy, b, s, torch.float32)
    # the flash kernel's meta function also returns its RNG seed and offset (24 B), the CPU
    # kernel does not: every other tensor is the same, in the same order
    assert [n for n in fp.saved if n > 64] == [n for n in state.saved_bytes() if n > 64]
    assert 0 <= fp.cache_bytes - state.retained_bytes <= 64  # the flash kernel's RNG state
    assert fp.offloaded_bytes + fp.retained_bytes == sum(fp.saved) + fp.cache_bytes
    if policy.ratio:
        assert 0 < fp.offloaded_bytes < sum(fp.saved)


def test_a_layout_sums_its_layers_and_takes_the_largest_transient() -> None:
    adapter = HFAdapter(tiny_config("qwen3", tied=False, layers=3))  # a policy per layer
    b, s, h = 2, 12, adapter.hidden_size
    layers = parse_layout("1xF-r1, 1xN, S1111111", 3, default_ratio=0.0)
    mem = layout_memory(adapter, layers, b, s, torch.float32)
    fps = [layer_footprint(adapter, p, b, s, torch.float32, i) for i, p in enumerate(layers)]
    assert mem.offloaded_bytes == mem.prefetch_bytes == b * s * h * 4  # the F input alone
    assert mem.retained_bytes == fps[1].retained_bytes + fps[2].retained_bytes
    assert mem.transient_bytes == max(f.transient_bytes for f in fps) == fps[0].transient_bytes


def test_the_replay_counts_activations_not_the_weights_it_saves() -> None:
    from torch.autograd.graph import saved_tensors_hooks

    from slidedp.runtime.activations.base import ParamAliases, leaves

    adapter, x, params, ctx = _layer("qwen3")
    ctx["masks"] = [None]
    run = LayerRun(adapter, 0, params, ctx)
    weights = leaves(params)
    aliases = ParamAliases({id(p): n for n, p in weights.items()}, run.shared_ids())
    with torch.enable_grad(), saved_tensors_hooks(aliases.pack, aliases.unpack):
        run.module_forward(weights, x.detach().requires_grad_(True))
    activations = sum(t.numel() * t.element_size() for t in aliases.tensors if t is not None)
    b, s, _ = x.shape
    fp = layer_footprint(adapter, parse_entry("F", 0.0)[1], b, s, torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    assert 0 <= fp.replay_bytes - activations <= 64  # the flash kernel's RNG state on meta
    assert fp.replay_bytes < weight_bytes + activations  # the weights are not in it


@pytest.mark.parametrize("text", ["F", "N", "S1010100", "SAC.mm", "N-r0.5"])
def test_the_meta_footprint_runs_the_modules_even_when_layers_are_compiled(text: str) -> None:
    # on a CUDA run without Liger the layers are compiled (models.fast); inductor cannot
    # partition the meta run's graph under saved-tensor hooks (the 2xH200 AutoPolicy run of
    # issue 21 died there), so the cost model must never call the compiled layer
    adapter = HFAdapter(tiny_config("qwen3", tied=False, layers=1))

    def compiled(*_: object) -> None:
        raise AssertionError("the cost model called the compiled layer")

    adapter.layer_call = compiled
    _, policy = parse_entry(text, 0.0)
    fp = layer_footprint(adapter, policy, 2, 12, torch.float32)
    assert sum(fp.saved) + fp.cache_bytes > 0


@pytest.mark.parametrize("clipping", [True, False])
def test_resident_state_counts_no_moments_nor_gradient_for_frozen_parameters(
    clipping: bool,
) -> None:
    """``train.freeze``: the store lays out no Adam moments for a frozen parameter and the
    backward gives it no gradient, so GPU residency costs 8 B/param less for each (4 B the
    FP32 master still takes), and without clipping its kept gradient (``e`` B/param) too."""
    trained = HFAdapter(tiny_config("qwen3", tied=False, layers=3))
    frozen = HFAdapter(tiny_config("qwen3", tied=False, layers=3))
    apply_freeze(frozen, ["layers.0", "self_attn", "embed_tokens"])
    dtype = torch.bfloat16
    grad_bytes = 0 if clipping else dtype.itemsize  # kept to the step's end without clipping
    saved = 8 + grad_bytes  # per frozen parameter: its two f32 moments and its gradient

    def frozen_numel(group: int) -> int:
        return sum(math.prod(s.shape) for s in frozen.group_specs()[group].params if s.frozen)

    layers = [frozen_numel(frozen.layer_group(i)) for i in range(frozen.num_layers)]
    assert layers[0] == trained.group_specs()[trained.layer_group(0)].numel  # all of layer 0
    assert 0 < layers[1] == layers[2] < layers[0]  # the attention of the others
    full = resident_layer_bytes(trained, dtype, clipping=clipping)
    less = resident_layer_bytes(frozen, dtype, clipping=clipping)
    assert [a - b for a, b in zip(full, less, strict=True)] == [saved * n for n in layers]
    embed = frozen_numel(frozen.embed_group)
    assert embed > 0
    assert (
        resident_embedding_bytes(trained, dtype, clipping=clipping)
        - resident_embedding_bytes(frozen, dtype, clipping=clipping)
        == saved * embed
    )


@pytest.mark.parametrize("clipping", [True, False])
def test_several_ranks_hold_every_resident_weight_and_their_own_groups_state(
    clipping: bool,
) -> None:
    """One rank: the resident layers' bytes plus the embeddings'. Two: each holds every
    resident layer's weights, but the FP32 state (and without clipping the gradient) only of
    the groups it owns (group g on rank g % 2); the larger of the two is counted."""
    adapter = HFAdapter(tiny_config("qwen3", tied=False, layers=3))
    f32 = torch.float32
    per_layer = resident_layer_bytes(adapter, f32, clipping=clipping)
    embeddings = resident_embedding_bytes(adapter, f32, clipping=clipping)
    one = resident_rank_bytes(adapter, f32, clipping=clipping, layers=3, embeddings=True, ranks=1)
    assert one == sum(per_layer) + embeddings
    # nothing frozen: f32 weights 4 B per slot element; master and moments 12 B per state
    # element, the gradient 4 B per parameter
    groups = HostStore.plan(adapter.group_specs(), 0).groups
    grad = [0 if clipping else 4 * g.numel for g in adapter.group_specs()]
    owned = [12 * g.state_len + n for g, n in zip(groups, grad, strict=True)]
    layers = [adapter.layer_group(i) for i in range(3)]
    held = [4 * sum(groups[g].slot_len for g in layers)] * 2  # every rank: every layer's
    for g in [*layers, adapter.embed_group, adapter.head_group]:
        held[g % 2] += owned[g]
    two = resident_rank_bytes(adapter, f32, clipping=clipping, layers=3, embeddings=True, ranks=2)
    assert two == max(held)
    assert two < one  # the state is split
    none = resident_rank_bytes(adapter, f32, clipping=clipping, layers=0, embeddings=False,
                               ranks=2)  # fmt: skip
    assert none == 0


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_solvers_resident_terms_bound_every_rank(ranks: int) -> None:
    """On ``ranks`` ranks any K resident layers take at most ``K * bytes_per_layer +
    reserve_bytes`` on the rank holding the most (``resident_rank_bytes``: the owners take
    turns), less than one rank holding them all; the embeddings' term is theirs on their
    owners; each layer's device time is its owner's share of the update plus the broadcast of
    its weights. One rank: the one-GPU terms."""
    adapter = HFAdapter(tiny_config("qwen3", tied=False, layers=5))
    bf16 = torch.bfloat16
    one = resident_terms(adapter, bf16, clipping=False, ranks=1, gather_gbps=100.0)
    assert one.bytes_per_layer == max(resident_layer_bytes(adapter, bf16, clipping=False))
    assert one.embedding_bytes == resident_embedding_bytes(adapter, bf16, clipping=False)
    assert one.reserve_bytes == 0
    terms = resident_terms(adapter, bf16, clipping=False, ranks=ranks, gather_gbps=100.0)
    for k in range(1, adapter.num_layers + 1):
        held = resident_rank_bytes(adapter, bf16, clipping=False, layers=k, embeddings=False,
                                   ranks=ranks)  # fmt: skip
        assert held <= k * terms.bytes_per_layer + terms.reserve_bytes, k
    assert terms.bytes_per_layer < one.bytes_per_layer  # the state is shared out
    ends = resident_rank_bytes(adapter, bf16, clipping=False, layers=0, embeddings=True,
                               ranks=ranks)  # fmt: skip
    assert terms.embedding_bytes == ends
    apart = adapter.embed_group % ranks != adapter.head_group % ranks  # (here: 7 groups)
    assert (ends < one.embedding_bytes) == apart
    n = adapter.group_specs()[adapter.layer_group(0)].numel
    assert terms.update_s_per_layer == pytest.approx(resident_update_s(n) / ranks + 2 * n / 100e9)
