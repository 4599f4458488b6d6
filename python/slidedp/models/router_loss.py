"""A mixture of experts' load-balancing loss, on one rank or over the global batch of several:
transformers' ``load_balancing_loss_func`` (Switch Transformer), with ``m_t`` the padding mask
and ``p_t = softmax(logits_t)``: ``c_e = Σ m_t·[e ∈ top_k(p_t)]``, ``s_e = Σ m_t·p_t,e``,
``T = Σ m_t`` (over layers and tokens), ``aux = E · Σ_e (c_e / T)(s_e / T)``. These are sums,
so the global batch's are the ranks' summed (``Statistics.packed``: one all-reduce of ``2E + 1``
float64): every rank computes the same ``aux`` and the gradient for its own rows. One rank
calls transformers' function itself; ``check_split`` proves the installed function is this
formula before several ranks rely on it.

Example::

    stats = router_loss.statistics(logits, attention_mask)   # this rank's rows
    total = stats.packed(); torch.distributed.all_reduce(total)  # the global batch's sums
    aux, grads = router_loss.from_total(stats, total)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from slidedp.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from slidedp.models.hf import HFAdapter

LayerLogits = list[tuple[torch.Tensor, ...]]  # per decoder layer, its routers' [rows, E] logits


@dataclass(frozen=True)
class Statistics:
    """One rank's sums over its rows (``counts``, ``rows``: no gradient; ``probs`` keeps its
    graph back to ``leaves``, the detached logits that ``from_total`` differentiates)."""

    leaves: LayerLogits
    counts: torch.Tensor  # [E] f32: routed (token, expert) pairs, mask-weighted
    probs: torch.Tensor  # [E] f32: Σ of the router probabilities, mask-weighted
    rows: torch.Tensor  # [] f32: Σ of the mask over every router layer's rows

    def packed(self) -> torch.Tensor:
        """``[counts, probs, rows]`` as one float64 tensor [2E + 1] (what the ranks sum)."""
        return torch.cat([self.counts, self.probs.detach(), self.rows.reshape(1)]).double()


@dataclass(frozen=True)
class RouterLoss:
    """A mixture-of-experts model's load-balancing loss as its ``ForCausalLM.forward`` adds it
    with ``output_router_logits``: ``router_aux_loss_coef * load_balancing_loss_func(router
    logits of every layer, num_experts, num_experts_per_tok, attention_mask)``, with the
    function of the model's own modeling module and the router logits its ``OutputRecorder``
    names (output ``index`` of every ``router`` module)."""

    router: type[nn.Module]
    index: int
    function: Callable[..., Any]
    num_experts: int
    top_k: int
    coef: float

    @classmethod
    def of(cls, skeleton: PreTrainedModel) -> RouterLoss:
        model_type = skeleton.config.model_type
        recorder = getattr(skeleton, "_can_record_outputs", None) or {}
        function = getattr(sys.modules[type(skeleton).__module__], "load_balancing_loss_func", None)
        if "router_logits" not in recorder or function is None:
            raise ModelLoadError(
                f"model type '{model_type}': this transformers records no router logits or has "
                "no load_balancing_loss_func for it; install the transformers the model needs"
            )
        if float(getattr(skeleton.config, "router_jitter_noise", 0.0) or 0.0) > 0:
            raise ModelLoadError(
                f"model type '{model_type}': router_jitter_noise > 0 draws random numbers in "
                "each forward, which a recomputed layer cannot repeat; set it to 0"
            )
        return cls(
            router=recorder["router_logits"].target_class,
            index=int(recorder["router_logits"].index),
            function=function,
            num_experts=int(cast(Any, skeleton).num_experts),  # the ForCausalLM's own
            top_k=int(cast(Any, skeleton).num_experts_per_tok),
            coef=float(skeleton.config.router_aux_loss_coef),
        )

    def __call__(
        self, logits: LayerLogits, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, LayerLogits]:
        """``(aux_loss, d(coef * aux_loss) / d logits)`` from each layer's router logits
        (``()`` for a layer without a router) and the batch's padding mask (None: packed):
        transformers' function on this one rank's batch."""
        leaves = _leaves(logits)
        flat = tuple(t for layer in leaves for t in layer)
        with torch.enable_grad():
            aux = self.function(flat, self.num_experts, self.top_k, attention_mask)
        coef = torch.tensor(self.coef, dtype=aux.dtype, device=aux.device)
        grads = iter(torch.autograd.grad(aux, flat, coef))
        return aux.detach(), [tuple(next(grads) for _ in layer) for layer in leaves]

    def over_ranks(
        self,
        logits: LayerLogits,
        attention_mask: torch.Tensor | None,
        sum_over_ranks: Callable[[torch.Tensor], None],
    ) -> tuple[torch.Tensor, LayerLogits]:
        """``__call__`` of the global batch, from this rank's rows: ``sum_over_ranks`` sums a
        tensor over every rank in place (``dist.all_reduce_tensor``)."""
        stats = self.statistics(logits, attention_mask)
        total = stats.packed()
        sum_over_ranks(total)
        return self.from_total(stats, total)

    def statistics(self, logits: LayerLogits, attention_mask: torch.Tensor | None) -> Statistics:
        """This rank's ``c``, ``s`` and ``T`` (module docstring), with the operations of
        transformers' function (its dtypes: the softmax in the logits' dtype, sums in f32)."""
        leaves = _leaves(logits)
        flat = [t for layer in leaves for t in layer]
        device, E, k = flat[0].device, self.num_experts, self.top_k
        # histc counts in f32 on CPU, int32 on GPUs (deterministic there), as transformers does
        histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
        counts = torch.zeros(E, dtype=torch.float32, device=device)
        probs = torch.zeros(E, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        mask = None
        if attention_mask is not None:  # the same flat mask for every layer's rows
            mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        with torch.enable_grad():
            for layer_logits in flat:
                weights = torch.softmax(layer_logits, dim=-1)  # [rows, E]
                _, selected = torch.topk(weights, k, dim=-1)  # [rows, k]
                if mask is None:
                    hist = torch.histc(selected.reshape(-1).to(histc_dtype), bins=E, min=0, max=E)
                    counts = counts + hist
                    probs = probs + weights.float().sum(dim=0)
                    rows = rows + weights.shape[0]
                else:
                    routed = torch.zeros(E, dtype=torch.float32, device=device)
                    counts = counts + routed.scatter_add_(
                        0, selected.reshape(-1), mask.repeat_interleave(k)
                    )
                    probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
                    rows = rows + mask.sum()
        return Statistics(leaves, counts, probs, rows)

    def from_total(
        self, stats: Statistics, total: torch.Tensor
    ) -> tuple[torch.Tensor, LayerLogits]:
        """``(aux_loss, d(coef * aux_loss) / d logits)`` of the global batch whose summed
        statistics are ``total`` (``packed`` summed over the ranks), the gradient for the rows
        of ``stats``. Every rank computes the same ``aux_loss`` from the same ``total``."""
        E = self.num_experts
        total = total.float()
        counts, probs, rows = total[:E], total[E : 2 * E], total[2 * E]
        tokens_per_expert = counts / rows  # f_e: a constant of the gradient
        aux = torch.sum(tokens_per_expert * (probs / rows).unsqueeze(0)) * E
        # this rank's share of s with the global T and f: its gradient is the global loss's
        flat = [t for layer in stats.leaves for t in layer]
        with torch.enable_grad():
            share = torch.sum(tokens_per_expert * (stats.probs / rows).unsqueeze(0)) * E
        coef = torch.tensor(self.coef, dtype=share.dtype, device=share.device)
        grads = iter(torch.autograd.grad(share, flat, coef))
        return aux, [tuple(next(grads) for _ in layer) for layer in stats.leaves]

    def check_split(self) -> str | None:
        """Whether the installed ``load_balancing_loss_func`` is the module docstring's formula,
        so that summing the ranks' statistics gives its value and gradient: on a random batch
        split in two halves (with and without a padding mask), None, else what differs."""
        gen = torch.Generator().manual_seed(0)
        batch, seq, layers = 4, 5, 2
        logits: LayerLogits = [
            (torch.randn(batch * seq, self.num_experts, generator=gen),) for _ in range(layers)
        ]
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, 3:], mask[3, 1:] = 0, 0
        for attention_mask in (None, mask):
            want, want_grads = self(logits, attention_mask)
            halves = []
            for part in (slice(0, batch // 2), slice(batch // 2, batch)):
                rows = slice(part.start * seq, part.stop * seq)
                part_mask = None if attention_mask is None else attention_mask[part]
                halves.append(self.statistics([(t[rows],) for (t,) in logits], part_mask))
            total = halves[0].packed() + halves[1].packed()
            (aux, first), (_, second) = (self.from_total(h, total) for h in halves)
            # f32 sums of 2 x 10 rows in another order: a few ulps; another formula is >= 1e-3
            if not torch.allclose(aux, want, rtol=1e-5, atol=0):
                return f"aux_loss {float(aux):.7g} from the halves vs {float(want):.7g}"
            for layer, ((w,), (a,), (b,)) in enumerate(zip(want_grads, first, second, strict=True)):
                atol = 1e-6 * float(w.abs().max())
                if not torch.allclose(torch.cat([a, b]), w, rtol=1e-5, atol=atol):
                    return f"the gradient of layer {layer}'s logits differs from the halves'"
        return None


def _leaves(logits: LayerLogits) -> LayerLogits:
    """The logits detached, each a leaf that requires its gradient."""
    return [tuple(t.detach().requires_grad_(True) for t in layer) for layer in logits]


def check_router_loss_ranks(adapter: HFAdapter, world: int) -> None:
    """Several ranks sum the ranks' token statistics of a load-balancing loss (per-expert means
    over every token of the global batch, ``models.router_loss``): refused only where the
    installed transformers' ``load_balancing_loss_func`` is not that formula (``check_split``),
    since the ranks' sums would then not give its value."""
    if adapter.router_loss is None or world == 1:
        return
    differs = adapter.router_loss.check_split()
    if differs is not None:
        raise ConfigError(
            f"{adapter.config.model_type} with output_router_logits on {world} ranks "
            "(runtime.ranks/gpus x runtime.nodes): this transformers' load_balancing_loss_func "
            f"is not the per-expert token means slidedp sums over ranks ({differs} on a test "
            "batch); use one rank, or set model.output_router_logits=false"
        )
