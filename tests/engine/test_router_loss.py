"""The load-balancing loss from token statistics summed over ranks (``models.router_loss``)
against transformers' ``load_balancing_loss_func`` on the whole batch (CPU, float32).

A random batch of router logits is split in two halves (two ranks' rows); each half's
statistics are summed as the all-reduce sums them; each half gets the loss and the gradient of
its own logits. Together they must give the function's value and its autograd gradient on the
whole batch. Tolerance: the loss's probability sums are f32 sums of the same numbers in
another order (two partial sums, then their sum in f64): measured <= 1.1e-7 relative, 1e-6
leaves ~10x. The gradient needs only the routed counts and the rows, integers summed exactly,
and per-row operations: measured equal, bounded like the loss at 1e-6 of its largest entry. A
wrong denominator (a rank's rows instead of the global batch's), a rank-local f or another
formula (the mean of per-layer losses: 5e-3) moves them by >= 1e-3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.tiny import tiny_config
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.models.router_loss import LayerLogits, RouterLoss, check_router_loss_ranks

LOSS_RTOL = 1e-6
GRAD_ATOL = 1e-6  # of the largest gradient entry

BATCH, SEQ, LAYERS = 6, 7, 3


def _router_loss(arch: str) -> RouterLoss:
    loss = HFAdapter(tiny_config(arch, tied=False, layers=2)).router_loss
    assert loss is not None
    return loss


def _batch(loss: RouterLoss, masked: bool) -> tuple[LayerLogits, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(3)
    logits: LayerLogits = [
        (torch.randn(BATCH * SEQ, loss.num_experts, generator=gen) * 2,) for _ in range(LAYERS)
    ]
    logits.insert(1, ())  # a dense layer between MoE ones (Qwen3-MoE's mlp_only_layers)
    if not masked:
        return logits, None
    lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=gen)
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [B, S] right padding
    return logits, mask


def _reference(
    loss: RouterLoss, logits: LayerLogits, mask: torch.Tensor | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' function on the whole batch and its autograd gradient, for ``coef`` as
    the loss's own gradient (as the one-rank engine asks for it: scaling the gradient after
    the backward instead rounds differently, up to 3.5e-6 of the largest entry)."""
    leaves = [t.detach().requires_grad_(True) for layer in logits for t in layer]
    aux = loss.function(tuple(leaves), loss.num_experts, loss.top_k, mask)
    aux.backward(torch.tensor(loss.coef))
    return aux.detach(), [t.grad for t in leaves if t.grad is not None]


def _rows(logits: LayerLogits, part: slice) -> LayerLogits:
    rows = slice(part.start * SEQ, part.stop * SEQ)
    return [tuple(t[rows] for t in layer) for layer in logits]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("split", [3, 1])
def test_the_halves_statistics_give_the_whole_batch_loss_and_gradient(
    arch: str, masked: bool, split: int
) -> None:
    loss = _router_loss(arch)
    logits, mask = _batch(loss, masked)
    want, want_grads = _reference(loss, logits, mask)
    parts = [slice(0, split), slice(split, BATCH)]
    stats = [loss.statistics(_rows(logits, p), None if mask is None else mask[p]) for p in parts]
    total = stats[0].packed() + stats[1].packed()  # what the all-reduce of two ranks sums
    results = [loss.from_total(s, total) for s in stats]
    for aux, _ in results:  # every rank logs the same global value
        assert torch.equal(aux, results[0][0])
    rel = abs(float(results[0][0]) - float(want)) / float(want)
    got_grads = [
        torch.cat([results[0][1][layer][0], results[1][1][layer][0]])
        for layer in range(len(logits))
        if logits[layer]
    ]
    worst = max(
        float((g - w).abs().max() / w.abs().max())
        for g, w in zip(got_grads, want_grads, strict=True)
    )
    print(f"{arch} masked={masked} split={split}: rel |daux| {rel:.1e}, |dgrad| {worst:.1e}")
    assert rel <= LOSS_RTOL
    assert worst <= GRAD_ATOL
    assert all(r[1][1] == () for r in results)  # the dense layer has no router logits


@pytest.mark.parametrize("masked", [False, True])
def test_one_rank_statistics_are_the_function_bit_for_bit(masked: bool) -> None:
    """With all rows on one rank the statistics run transformers' operations in its order."""
    loss = _router_loss("qwen3_moe")
    logits, mask = _batch(loss, masked)
    want, want_grads = loss(logits, mask)
    stats = loss.statistics(logits, mask)
    aux, grads = loss.from_total(stats, stats.packed())
    assert torch.equal(aux, want)
    for g, w in zip(grads, want_grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_each_rank_gets_its_own_rows_gradient_only() -> None:
    """A rank's gradient is the global loss's gradient w.r.t. its rows: 1/T of the global
    batch, not of its own (with one rank's rows the result would double)."""
    loss = _router_loss("mixtral")
    logits, _ = _batch(loss, False)
    half = _rows(logits, slice(0, BATCH // 2))
    alone = loss.statistics(half, None)
    _, own = loss.from_total(alone, alone.packed())
    other = loss.statistics(_rows(logits, slice(BATCH // 2, BATCH)), None)
    total = alone.packed() + other.packed()
    _, shared = loss.from_total(loss.statistics(half, None), total)
    ratio = float(own[0][0].abs().sum() / shared[0][0].abs().sum())
    assert 1.5 < ratio < 2.5


def _per_layer_mean(gate_logits: tuple[torch.Tensor, ...], *args: Any) -> Any:
    """Not the pooled formula: the mean of each layer's own loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return sum(load_balancing_loss_func((g,), *args) for g in gate_logits) / len(gate_logits)


def test_the_installed_function_passes_the_split_check_and_another_is_refused() -> None:
    adapter = HFAdapter(tiny_config("mixtral", tied=False, layers=2))
    assert adapter.router_loss is not None
    assert adapter.router_loss.check_split() is None
    check_router_loss_ranks(adapter, 4)  # the installed transformers: accepted
    original = adapter.router_loss
    adapter.router_loss = RouterLoss(**{**original.__dict__, "function": _per_layer_mean})
    check_router_loss_ranks(adapter, 1)  # one rank calls the function itself
    with pytest.raises(ConfigError, match="is not the per-expert token means") as e:
        check_router_loss_ranks(adapter, 2)
    assert "output_router_logits=false" in str(e.value)
