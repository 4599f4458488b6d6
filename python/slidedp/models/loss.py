"""Causal-LM loss by chunks: linear + cross-entropy without the full [tokens, vocab] logits.

Same value as transformers' ``ForCausalLMLoss`` (labels shifted left by one, ignore index -100,
logits upcast to f32, mean over the label tokens of the whole batch), but only
``chunk_tokens`` rows of logits exist at a time, and the backward is done chunk by chunk right
away, so the function returns the loss sum with the gradients of the hidden states and the
head weight.

Example::

    loss_sum, grad_hidden, grad_weight = chunked_lm_loss(h, w, labels, n_labels, 1024)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels → [B, S] targets: position i predicts token i + 1 (last one ignored)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def chunked_lm_loss(
    hidden: torch.Tensor,  # [B, S, H] final-norm output, compute dtype
    weight: torch.Tensor,  # [V, H] LM head (or tied embedding), compute dtype
    targets: torch.Tensor,  # [B, S] shifted labels
    n_labels: int,  # label tokens of the global batch: the mean's denominator
    chunk_tokens: int,
    *,
    softcap: float | None = None,  # final_logit_softcapping: cap * tanh(logits / cap)
    weight_grad: bool = True,
    hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(Σ token losses as a 0-dim f32 tensor, d(mean)/d hidden [B, S, H], d(mean)/d weight).
    ``softcap``: the logits are soft-capped first, as Gemma's ``ForCausalLM.forward`` does.
    Without ``weight_grad`` (a frozen head) or ``hidden_grad`` (nothing below trains) that
    gradient is None and not computed (at least one of the two is)."""
    assert weight_grad or hidden_grad, "the loss alone: models.loss has no gradient-free path"
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*S, H]
    flat_targets = targets.reshape(-1)  # [B*S]
    rows = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)  # [N] rows with a label
    grad_flat = torch.zeros_like(flat) if hidden_grad else None
    grad_weight = torch.zeros_like(weight) if weight_grad else None
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    w = weight.detach().requires_grad_(weight_grad)
    scale = torch.tensor(1.0 / max(n_labels, 1), dtype=torch.float32, device=hidden.device)
    for start in range(0, rows.numel(), chunk_tokens):
        idx = rows[start : start + chunk_tokens]  # [n]
        h = flat.index_select(0, idx).detach().requires_grad_(hidden_grad)  # [n, H]
        with torch.enable_grad():
            logits = F.linear(h, w)  # [n, V]
            if softcap is not None:  # the three operations of Gemma3ForCausalLM.forward
                logits = torch.tanh(logits / softcap) * softcap
            logits = logits.float()
            loss = F.cross_entropy(logits, flat_targets.index_select(0, idx), reduction="sum")
            wanted = [t for t, need in ((h, hidden_grad), (w, weight_grad)) if need]
            grads = iter(torch.autograd.grad(loss, wanted, grad_outputs=scale))
        if grad_flat is not None:
            grad_flat.index_copy_(0, idx, next(grads))
        if grad_weight is not None:
            grad_weight += next(grads)
        loss_sum += loss.detach()
    return loss_sum, None if grad_flat is None else grad_flat.view_as(hidden), grad_weight
