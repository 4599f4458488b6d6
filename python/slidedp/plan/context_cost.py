"""What context parallelism (``runtime.context_parallel: R``) adds to a rank's layer memory
beyond the activations of its S/R-token shard, on the most loaded rank.

Ulysses: attention saves q, k, v of H/R heads over S tokens, as many elements as the shard's
of every head, so the saved tensors are the shard's; the all-to-alls' send and receive
buffers are not counted: they live around attention, not at the layer's backward peak (Qwen3-8B
at 131,072 tokens on 2 H200s: peak 43.4 GiB reserved, 3% under the estimate without them).
Allgather: the last rank's queries attend over every shard's keys and values, gathered and
repeated to the query heads, which autograd saves for SDPA's backward: ``gathered_keys``
routes a meta-device layer's attention through that shape, so each family's saved, offloaded
and replayed bytes are measured as the engine's (``plan.cost``); the gather's receive buffer
and its ordered copy of the keys and values add to the transient.

Example::

    context = ContextShape(4, "allgather")
    with gathered_keys(adapter, context):
        ...  # the layer's meta run: its attention over 4 x its shard's keys
    exchange_bytes(adapter, rows=1, shard_tokens=S // 4, elem=2, context=context)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from slidedp.models.hf import HFAdapter

META_GATHER = "slidedp_meta_kv_gather"  # the meta run's attention under allgather


@dataclass(frozen=True)
class ContextShape:
    """R ranks splitting every sequence, under ``scheme`` (the resolved
    ``runtime.context_attention``)."""

    size: int
    scheme: Literal["ulysses", "allgather"]


def _gathered_meta_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, S/R, D]
    key: torch.Tensor,  # [B, Hkv, S/R, D]
    value: torch.Tensor,
    attention_mask: Any,
    *,
    size: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The last rank's attention under allgather, in shapes: its queries over R shards' keys
    and values repeated to the query heads (``runtime.context_parallel.gathered_attention``)."""
    k, v = (t.repeat(1, 1, size, 1) for t in (key, value))  # [B, Hkv, S, D]: the gathered
    groups = query.shape[1] // key.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # [B, H, S, D]
    out = F.scaled_dot_product_attention(query, k, v, scale=kwargs.get("scaling"))
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def gathered_keys(adapter: HFAdapter, context: ContextShape | None) -> Iterator[None]:
    """Within: the layers of ``adapter`` attend as allgather's last rank does (nothing for
    Ulysses, one rank, or a model whose layers hold no attention of transformers')."""
    if context is None or context.scheme != "allgather":
        yield
        return
    config = adapter.config
    had = config._attn_implementation
    AttentionInterface.register(
        META_GATHER, functools.partial(_gathered_meta_attention, size=context.size)
    )
    config._attn_implementation = META_GATHER
    try:
        yield
    finally:
        config._attn_implementation = had


def exchange_bytes(
    adapter: HFAdapter, rows: int, shard_tokens: int, elem: int, context: ContextShape | None
) -> int:
    """The transient device bytes of one layer's exchanges beyond its saved tensors at the
    layer's peak: allgather's receive buffer of R shards' keys and values and their ordered
    copy (in the backward, the gradients of as many, reduced back to their owners); none for
    Ulysses (the module docstring says why)."""
    if context is None or context.size == 1 or context.scheme == "ulysses":
        return 0
    config = adapter.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or adapter.hidden_size // heads)
    per_head = rows * shard_tokens * head_dim * elem  # one head of the shard
    return 2 * 2 * kv_heads * context.size * per_head
