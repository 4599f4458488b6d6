"""Context parallelism: the R ranks of a context group split every sequence of their rows.

Each rank holds a contiguous shard of S/R tokens of every row; norms, MLP, RoPE (at the
shard's global positions, or per sample in packed rows) and the chunked loss run on the
shard. Attention spans the whole rows by one of two schemes (``attention_scheme``): Ulysses,
an all-to-all over heads (H/R query and Hkv/R key/value heads per rank, the whole sequence,
the model's own attention function and mask), or allgather, each rank's queries over the gathered
key/value shards before them (any heads; ``gathered_attention``). Bound without touching the
decoder layers: transformers' attention and mask interfaces under ``ULYSSES`` or ``GATHER``.
Invariant: each rank's loss is its shard's token loss over the global batch's label count,
so the gradients summed over every rank are the one-rank gradient.

Example::

    group = ContextGroup(index=rank % 2, size=2, group=pg)
    bind_attention(adapter.config, group)   # then every layer's attention spans the whole sequence
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    _ignore_causal_mask_sdpa,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from slidedp.config import TrainConfig
from slidedp.data.batch import IGNORE_INDEX, Batch
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.device import pick_device

ULYSSES = "slidedp_ulysses"  # the attention implementations' names in transformers' interfaces
GATHER = "slidedp_kv_gather"
ROW_POSITIONS = "row_position_ids"  # the layers' shared inputs: the whole rows' positions
# the model types whose context-parallel runs are checked against one rank (CPU parity tests;
# Qwen3-MoE's routers and experts run on the shard, its load-balancing loss sums the token
# statistics of every rank's shard as over data ranks: models.router_loss)
CONTEXT_MODEL_TYPES = ("qwen3", "llama", "qwen3_moe")
# the differentiable all-gather under its newer torch name (torch 2.11 lacks it),
# else the older name (deprecated where the newer exists)
_ALL_GATHER_AUTOGRAD = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its context group: shard ``index`` of ``size`` of every row."""

    index: int
    size: int
    group: dist.ProcessGroup | None = field(default=None, repr=False)
    attention: Literal["auto", "ulysses", "allgather"] = "auto"  # runtime.context_attention

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``t`` [B, S, ...]: ``[B, S/R, ...]`` (S divides by R)."""
        per = t.shape[1] // self.size
        return t[:, self.index * per : (self.index + 1) * per]

    def layer_inputs(
        self, batch: Batch, device: torch.device
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """This shard's padding mask [B, S/R] (None: packed rows) and what the layers read:
        the shard's ``position_ids`` for RoPE ([1, S/R] global, or [B, S/R] per packed sample)
        and the whole rows' positions (``ROW_POSITIONS``: [1, S] or [B, S]) for the masks."""
        width = batch.input_ids.shape[1]
        rows = torch.arange(width)[None] if batch.position_ids is None else batch.position_ids
        attn = None if batch.position_ids is not None else self.shard(batch.attention_mask)
        shared = {"position_ids": self.shard(rows).to(device), ROW_POSITIONS: rows.to(device)}
        return None if attn is None else attn.to(device), shared


def pad_width(batch: Batch, multiple: int) -> Batch:
    """``batch`` right-padded to a width that divides by ``multiple`` (padding: masked tokens
    without labels; causal attention never lets a token see the padding after it). Packed
    rows' padding continues their tail segment, counted from 0 after the row's tokens."""
    width = batch.input_ids.shape[1]
    extra = -width % multiple
    if extra == 0:
        return batch
    positions = None
    if batch.position_ids is not None:  # the tail's positions, as slidedp.data.batches counts
        tail = torch.arange(width, width + extra) - batch.attention_mask.sum(1, keepdim=True)
        positions = torch.cat([batch.position_ids, tail], dim=1)  # [B, S + extra]
    return Batch(F.pad(batch.input_ids, (0, extra)), F.pad(batch.attention_mask, (0, extra)),
                 F.pad(batch.labels, (0, extra), value=IGNORE_INDEX), positions)  # fmt: skip


def _all_to_all(send: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """Block j of dim 0 of ``send`` to rank j of the group; the result's block j came from
    rank j. Differentiable (its backward is the reverse all-to-all)."""
    assert group.group is not None, "a context group joined by Dist.init"
    # an AsyncCollectiveTensor: its first use waits for the exchange
    return funcol.all_to_all_single(send, None, None, group.group)


def heads_to_sequence(x: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """[B, H, S/R, D] (every head, this shard's tokens) -> [B, H/R, S, D] (this rank's heads,
    every token); shard j of the result's sequence came from rank j."""
    b, h, s, d = x.shape
    r = group.size
    send = x.reshape(b, r, h // r, s, d).transpose(0, 1).contiguous()  # [R, B, H/R, S/R, D]
    got = _all_to_all(send, group)  # [R (whose tokens), B, H/R, S/R, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // r, r * s, d)


def sequence_to_heads(x: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """[B, S, H/R, D] (attention's output layout, this rank's heads) -> [B, S/R, H, D] (this
    shard's tokens, every head in order)."""
    b, s_full, h, d = x.shape
    r = group.size
    send = x.reshape(b, r, s_full // r, h, d).transpose(0, 1).contiguous()  # [R, B, S/R, H/R, D]
    got = _all_to_all(send, group)  # [R (whose heads), B, S/R, H/R, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s_full // r, r * h, d)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, S/R, D]
    key: torch.Tensor,  # [B, Hkv, S/R, D]
    value: torch.Tensor,  # [B, Hkv, S/R, D]
    attention_mask: torch.Tensor | None,  # the whole sequence's mask (ContextGroup callers)
    *,
    context: ContextGroup,
    inner: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the whole sequence for this rank's heads; returns [B, S/R, H, D] as
    transformers' attention functions do. ``inner``: the implementation the model had."""
    q, k, v = (heads_to_sequence(t, context) for t in (query, key, value))
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(inner, sdpa_attention_forward)
    out, _ = attend(module, q, k, v, attention_mask, **kwargs)  # [B, S, H/R, D]
    return sequence_to_heads(out, context), None


def gather_sequence(x: torch.Tensor, group: ContextGroup, shards: int) -> torch.Tensor:
    """[B, Hkv, S/R, D] (this shard's tokens) -> [B, Hkv, shards * S/R, D] (the first
    ``shards`` shards' tokens, in order). Differentiable: the backward sums each shard's
    gradient over the ranks back to its own."""
    assert group.group is not None, "a context group joined by Dist.init"
    b, h, s, d = x.shape
    got: torch.Tensor = _ALL_GATHER_AUTOGRAD(x.contiguous(), 0, group.group)
    # [R * B, Hkv, S/R, D], shard j's block j; the later shards are dropped before the copy
    first = got.view(group.size, b, h, s, d)[:shards]
    return first.permute(1, 2, 0, 3, 4).reshape(b, h, shards * s, d)


def gathered_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, S/R, D]
    key: torch.Tensor,  # [B, Hkv, S/R, D]
    value: torch.Tensor,  # [B, Hkv, S/R, D]
    attention_mask: torch.Tensor,  # gathered_block_mask's block
    *,
    context: ContextGroup,
    **kwargs: Any,  # transformers' ``dropout`` (0 by default) and ``scaling`` (None: 1/sqrt(D))
) -> tuple[torch.Tensor, None]:
    """This shard's queries over the keys of every shard up to its own (a causal model's
    later keys are never visible), by torch's SDPA whatever the model's implementation;
    returns [B, S/R, H, D] as transformers' functions do. The key/value shards reach every
    rank in one all-gather (as in Llama 3's all-gather-based context
    parallelism: one SDPA call, no per-block merge). Memory: the gathered keys and values,
    [B, H, (index + 1) S/R, D] each once the key/value heads are repeated for SDPA (as
    transformers' SDPA does under a mask)."""
    k, v = (gather_sequence(t, context, context.index + 1) for t in (key, value))
    groups = query.shape[1] // key.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    out: torch.Tensor = F.scaled_dot_product_attention(
        query,
        k,
        v,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
    )  # [B, H, S/R, D]
    return out.transpose(1, 2).contiguous(), None


def gathered_block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    *,
    context: ContextGroup,
    mask_function: Any,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """The mask block [B, 1, S/R, (index + 1) S/R] of this shard's queries over the keys up
    to its end, evaluated from the model's ``mask_function`` of the whole rows (causal,
    packed samples, sliding window; transformers' ``sdpa_mask`` at the block's offsets), or
    where the whole rows' mask is plain causal (as sdpa skips) torch's lower-right causal
    bias of the block (no memory: the diagonal ends at the last key). Built here, before the
    layers: a tensor subclass made inside a selective-checkpoint region fails to construct."""
    whole = kwargs.get("attention_mask")  # [B, S] padding mask, or None
    s = q_length // context.size
    # transformers' own test of whether sdpa may skip the mask (private: no public twin)
    if allow_is_causal_skip and _ignore_causal_mask_sdpa(whole, q_length, kv_length, 0, 0,
                                                         local_size):  # fmt: skip
        return causal_lower_right(s, (context.index + 1) * s)
    block = sdpa_mask(
        batch_size, s, (context.index + 1) * s, q_offset=context.index * s,
        mask_function=mask_function, attention_mask=whole, allow_is_causal_skip=False,
        use_vmap=kwargs.get("use_vmap", False), device=kwargs.get("device", "cpu"),
    )  # fmt: skip
    assert block is not None, "sdpa_mask skips nothing when told not to"
    return block


def attention_scheme(config: Any, context: ContextGroup) -> Literal["ulysses", "allgather"]:
    """The scheme ``context.attention`` asks for; ``auto``: Ulysses where the model's query
    and key/value heads divide by the group's size (balanced work, no gathered keys), else
    allgather."""
    if context.attention != "auto":
        return context.attention
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return "ulysses" if heads % context.size == 0 == kv_heads % context.size else "allgather"


def bind_attention(config: Any, context: ContextGroup) -> None:
    """Every attention layer of the model of ``config`` (shared by its modules) runs the
    group's scheme over ``context`` from now on (Ulysses around the attention implementation
    it had, allgather with SDPA)."""
    inner = config._attn_implementation
    if inner in (ULYSSES, GATHER):
        return
    if attention_scheme(config, context) == "allgather":
        AttentionInterface.register(GATHER, functools.partial(gathered_attention, context=context))
        ALL_MASK_ATTENTION_FUNCTIONS.register(GATHER, functools.partial(gathered_block_mask,
                                                                      context=context))  # fmt: skip
        config._attn_implementation = GATHER
        return
    attend = functools.partial(ulysses_attention, context=context, inner=inner)
    AttentionInterface.register(ULYSSES, attend)
    # the masks of the whole rows as the inner implementation builds them (transformers
    # builds none for an implementation it has no mask function for)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ULYSSES, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    config._attn_implementation = ULYSSES


def full_sequence_masks(layer_masks: Any, x: torch.Tensor, shared: dict[str, Any]) -> list[Any]:
    """Each layer's attention mask over the whole rows (``HFAdapter.layer_masks``) from their
    positions (``shared[ROW_POSITIONS]``, ``ContextGroup.layer_inputs``) and this rank's shard
    ``x`` [B, S/R, H] (only its shape, dtype and device are read). No padding mask: padded
    rows are right-padded, and causal attention keeps every token off the padding after it
    (so SDPA runs causal without an S x S mask); packed rows keep each sample apart by their
    per-sample positions, as on one rank. Under allgather, each is this shard's block of it."""
    positions = shared[ROW_POSITIONS]
    whole = x[:, :1].expand(-1, positions.shape[1], -1)  # [B, S, H], a view: no memory
    masks: list[Any] = layer_masks(whole, None, positions)
    return masks


def check_context(cfg: TrainConfig, adapter: HFAdapter) -> None:
    """``runtime.context_parallel`` against the run (before anything is written): raises one
    ``ConfigError`` line naming the key at fault; nothing with ``context_parallel: 1``."""
    r = cfg.runtime.launch.context_parallel
    if r == 1:
        return
    problem = _shape_problem(cfg, adapter, r) or _unproven_problem(cfg, adapter)
    if problem is not None:
        raise ConfigError(f"runtime.context_parallel={r}: {problem}")


def _shape_problem(cfg: TrainConfig, adapter: HFAdapter, r: int) -> str | None:
    """Whether the ranks, the sequence and the heads split into ``r`` equal parts."""
    # the launch's ranks: the config's, or a torchrun's (which the config may leave at 1)
    world = max(cfg.runtime.launch.world, int(os.environ.get("WORLD_SIZE", "1")))
    if world % r:
        return (f"does not divide the {world} ranks (runtime.ranks/runtime.gpus): set "
                f"runtime.context_parallel to a divisor of {world}")  # fmt: skip
    if cfg.data.seq_len % r:
        return f"data.seq_len={cfg.data.seq_len} must divide by it: set a multiple of {r}"
    heads = adapter.config.num_attention_heads
    kv_heads = getattr(adapter.config, "num_key_value_heads", None) or heads
    if cfg.runtime.launch.context_attention == "ulysses" and (heads % r or kv_heads % r):
        return (
            f"the model's {heads} query and {kv_heads} key/value heads must each divide by "
            "it under runtime.context_attention=ulysses (the all-to-all gives each rank H/R "
            "heads): set runtime.context_attention=allgather (or auto), or lower it"
        )
    return None


def _unproven_problem(cfg: TrainConfig, adapter: HFAdapter) -> str | None:
    """The first combination not yet checked against one rank, with its fix."""
    rt, cuda = cfg.runtime, pick_device(cfg.runtime.launch.device).type == "cuda"
    layout = rt.layout
    refusals = [
        (adapter.config.model_type not in CONTEXT_MODEL_TYPES,
         f"model type {adapter.config.model_type} is not supported yet "
         f"(supported: {', '.join(CONTEXT_MODEL_TYPES)}); set runtime.context_parallel=1"),
        (rt.launch.nodes > 1, f"runtime.nodes={rt.launch.nodes}: the context group must be one "
         "node's ranks; set runtime.nodes=1"),
        (layout.compile or (cuda and layout.compile is None), "the compiled decoder layer "
         "(runtime.compile) cannot trace the all-to-all; set runtime.compile=false"),
        (layout.kernels == "liger" or (cuda and layout.kernels == "auto"), "runtime.kernels="
         f"{layout.kernels} is not checked yet; set runtime.kernels=eager"),
    ]  # fmt: skip
    return next((why for refused, why in refusals if refused), None)
