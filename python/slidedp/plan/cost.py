"""What an activation layout costs in device and host memory, measured by running the very
executors the engine runs (``runtime.activations``) on the ``meta`` device: shapes and dtypes
only, nothing computed or allocated, a few milliseconds per family.

Per layer (``LayerFootprint``): the tensors its forward saves (offloadable, in save order), the
outputs selective checkpointing keeps, and the backward's transient (what the replay saves plus
their gradients). Invariant: attention is routed through the flash operator on meta
(``_FlashOnMeta``), so the saved tensors are the GPU's, not the math path's S x S matrix.

Example::

    fp = layer_footprint(adapter, LayerPolicy("N"), batch=16, seq_len=1024, dtype=torch.bfloat16)
    fp.retained_bytes, fp.offloaded_bytes, fp.transient_bytes
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from slidedp.models.bind import bind_params
from slidedp.models.fast import Compute, liger_saved_tensors
from slidedp.models.hf import HFAdapter
from slidedp.models.tiled_mlp import tiled_mlp, untiled_forward
from slidedp.plan.context_cost import ContextShape, gathered_keys
from slidedp.plan.layout import LayerPolicy
from slidedp.runtime.activations import LayerRun, executor_for
from slidedp.runtime.activations.base import ParamAliases, leaves
from slidedp.runtime.activations.offload import offload_count
from slidedp.runtime.activations.segment import SegmentExecutor
from slidedp.runtime.activations.segments import SEGMENTS, run_segments
from slidedp.store import HostStore
from slidedp.store_layout import GroupLayout, StoreLayout

# The backward's peak over a replay's saved tensors: the gradients alive at the same time, as a
# share of those saved bytes. Fitted so that full checkpointing reproduces the GPU peaks measured
# for Qwen3-4B (benchmarks/2026-11-23-activation-layouts-h100.md, within 0.5% with
# ``estimate.ALLOCATOR_BYTES``); the other families use the same share (validated against the
# measured peaks of that record).
REPLAY_PEAK_FACTOR = 1.64
# The same share with Liger's kernels (``models.liger_twins`` count what they save): fitted to the
# H100's peaks with Liger, Qwen3-4B at 64K and 128K and Qwen3-8B at 64K tokens (1.85-1.90;
# benchmarks/2026-11-24-moe-long-context-h100.md); its backward kernels allocate more beside fewer
# saved tensors.
LIGER_REPLAY_PEAK_FACTOR = 1.90
META = torch.device("meta")


@dataclass(frozen=True)
class LayerFootprint:
    policy: LayerPolicy
    saved: tuple[int, ...]  # bytes of each offloadable saved tensor, in save order
    cache_bytes: int  # kept on the device outside ``saved`` (SAC's operator outputs)
    replay_bytes: int  # saved by the backward's replay (0: no replay)
    peak_factor: float = REPLAY_PEAK_FACTOR  # the backward's peak over those saved bytes
    tile_bytes: int = 0  # a tiled MLP's backward beside them (``_tile_bytes``)

    @property
    def offloaded_bytes(self) -> int:

        return sum(self.saved[: offload_count(list(self.saved), self.policy.ratio)])

    @property
    def retained_bytes(self) -> int:
        """On the device from the layer's forward to its backward."""
        return sum(self.saved) - self.offloaded_bytes + self.cache_bytes

    @property
    def transient_bytes(self) -> int:
        """Added during the layer's backward: the replay's saved tensors and gradients (``N``:
        the gradients of what it kept)."""
        if self.policy.family == "N":
            return round((self.peak_factor - 1) * sum(self.saved)) + self.tile_bytes
        return round(self.peak_factor * self.replay_bytes) + self.tile_bytes


class _FlashOnMeta(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]  # grouped k/v as they are: the kernels take GQA natively
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, bool(kwargs.get("is_causal")), scale=kwargs.get("scale")
        )
        return out[0]


def _meta_run(adapter: HFAdapter, layer: int, batch: int, seq_len: int, dtype: torch.dtype) -> Any:

    x = torch.empty(batch, seq_len, adapter.hidden_size, device=META, dtype=dtype)
    position_ids = torch.arange(seq_len, device=META).unsqueeze(0)
    rotary = adapter.position_embeddings(adapter.make_rotary(META), x, position_ids)
    ctx = {
        "position_ids": position_ids,
        "position_embeddings": [(cos.to(dtype), sin.to(dtype)) for cos, sin in rotary],
        "masks": [None] * adapter.num_layers,  # causal, unpadded: the kernels' own mask
    }
    group = adapter.groups[adapter.layer_group(layer)]
    shapes = adapter.shapes()
    params = {
        local: torch.empty(shapes[full], device=META, dtype=dtype) for full, local in group.params
    }
    return LayerRun(adapter, layer, params, ctx, eager=True), x


def _saved_by_grad_run(run: Any, params: dict[str, torch.Tensor], fn: Any) -> int:
    """Bytes autograd saves while ``fn()`` runs with grad on ``params`` (the weights it saves
    sit in the window: they are aside, as the shared tensors)."""

    aliases = ParamAliases({id(p): n for n, p in params.items()}, run.shared_ids())
    with torch.enable_grad(), saved_tensors_hooks(aliases.pack, aliases.unpack):
        fn()
    return sum(t.numel() * t.element_size() for t in aliases.tensors if t is not None)


def _replay_bytes(policy: LayerPolicy, run: Any, x: torch.Tensor) -> int:

    if policy.family == "N":
        return 0
    params = leaves(run.params)
    if policy.family != "S":  # F and SAC replay the whole layer (SAC reuses its cached outputs)
        x_in = x.detach().requires_grad_(True)
        return _saved_by_grad_run(run, params, lambda: run.module_forward(params, x_in))
    starts = SegmentExecutor(policy).starts
    ends = [*starts[1:], len(SEGMENTS)]
    module = run.adapter.layer_module(run.layer)
    # each span replays from its saved start state; measure it from a forward of the segments
    worst = 0
    with torch.no_grad():
        state: tuple[torch.Tensor, ...] = (x,)
        for first, end in zip(starts, ends, strict=True):
            start = tuple(t.detach().requires_grad_(True) for t in state)
            span = functools.partial(
                run_segments, module, params, start, run.ctx, run.layer, first, end - 1
            )
            worst = max(worst, _saved_by_grad_run(run, params, span))
            state = run_segments(module, run.params, state, run.ctx, run.layer, first, end - 1)
    return worst


def layer_footprint(
    adapter: HFAdapter,
    policy: LayerPolicy,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    layer: int = 0,
    kernels: str | Compute = "eager",
    context: ContextShape | None = None,
) -> LayerFootprint:
    """Decoder layer ``layer``'s memory under ``policy`` for ``batch`` rows of ``seq_len``
    tokens (measured once per kind of layer: ``HFAdapter.layer_kinds``) with the layer
    compute the run uses (``Compute``: Liger's kernels save less for the backward, a tiled
    MLP saves its input alone; a kernels name: untiled); ``context``: ``seq_len`` is a
    context shard's, its attention as the scheme's worst rank's (``plan.context_cost``)."""
    kind = adapter.layer_kinds[layer]
    if isinstance(kernels, str):
        kernels = Compute("liger" if kernels == "liger" else "eager", "")
    compute = Compute(kernels.kernels, "", mlp_tile_tokens=kernels.mlp_tile_tokens)  # cache key
    return _kind_footprint(adapter, policy, batch, seq_len, dtype, kind, compute, context)


@functools.cache
def _kind_footprint(
    adapter: HFAdapter,
    policy: LayerPolicy,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    layer: int,
    compute: Compute,
    context: ContextShape | None,
) -> LayerFootprint:

    liger = compute.kernels == "liger"
    saves = liger_saved_tensors(adapter, layer) if liger else contextlib.nullcontext()
    tile = compute.mlp_tile_tokens
    with _FlashOnMeta(), saves, tiled_mlp(adapter, layer, tile), gathered_keys(adapter, context):
        run, x = _meta_run(adapter, layer, batch, seq_len, dtype)
        _, state = executor_for(policy, measure=True).forward(run, x)
        replay = _replay_bytes(policy, run, x)
        factor = LIGER_REPLAY_PEAK_FACTOR if liger else REPLAY_PEAK_FACTOR
        tiles = _tile_bytes(run, tile if batch * seq_len > tile else 0, dtype, factor)
    saved = tuple(state.saved_bytes())
    return LayerFootprint(policy, saved, state.retained_bytes, replay, factor, tiles)


def _tile_bytes(run: Any, tile: int, dtype: torch.dtype, factor: float) -> int:
    """What a tiled MLP's backward holds beside the layer's saved tensors (0: untiled): one
    tile's replay (its saved tensors at the replay's ``factor``, their gradients with them),
    the weight gradients' float32 sums and one tile's weight gradients (``TiledMLP``)."""
    if not tile:
        return 0
    module = run.adapter.layer_module(run.layer)
    params = leaves(run.params)
    bind_params(module, params)
    x = torch.empty(tile, run.adapter.hidden_size, device=META, dtype=dtype)
    one_tile = untiled_forward(module.mlp)
    saved = _saved_by_grad_run(run, params, lambda: one_tile(x.requires_grad_(True)))
    weights = list(module.mlp.parameters())
    sums = sum(p.numel() * (max(4, p.element_size()) + p.element_size()) for p in weights)
    return round(factor * saved) + int(sums)


@dataclass(frozen=True)
class LayoutMemory:
    """A whole layout's activation memory (bytes)."""

    retained_bytes: int  # on the device after the forward: every layer's retained share
    offloaded_bytes: int  # the host arenas (pinned)
    # back on the device during a backward: a layer's offloaded share in use and the next one's
    # already prefetched (the largest such pair)
    prefetch_bytes: int
    transient_bytes: int  # the largest backward transient of one layer


def layout_memory(
    adapter: HFAdapter,
    layers: Sequence[LayerPolicy],
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    kernels: str | Compute = "eager",
    context: ContextShape | None = None,
) -> LayoutMemory:
    fps = [layer_footprint(adapter, p, batch, seq_len, dtype, i, kernels, context)
           for i, p in enumerate(layers)]  # fmt: skip
    return LayoutMemory(
        retained_bytes=sum(f.retained_bytes for f in fps),
        offloaded_bytes=sum(f.offloaded_bytes for f in fps),
        prefetch_bytes=max(
            (a.offloaded_bytes + b.offloaded_bytes for a, b in itertools.pairwise(fps)),
            default=fps[0].offloaded_bytes if fps else 0,
        ),
        transient_bytes=max((f.transient_bytes for f in fps), default=0),
    )


def resident_layer_bytes(adapter: HFAdapter, dtype: torch.dtype, *, clipping: bool) -> list[int]:
    """Device bytes each decoder layer holds while GPU-resident (``runtime.resident``), in layer
    order: its weights in the compute dtype (``e`` B per element of its slot layout, as the
    window's buffers), the FP32 master (4 B per element of its state layout), both Adam moments
    of its trained parameters (8 B per element of their layout: a frozen parameter has none)
    and, without clipping, its trained parameters' gradient (``e`` B/param), kept from its
    backward to the update at the step's end (with clipping every gradient is parked anyway:
    the estimate's parked term). The GPU update reads the gradient as it is, in one pass with
    no f32 copy (``resident.adamw_single_pass``)."""

    specs = adapter.group_specs()
    layout = HostStore.plan([specs[adapter.layer_group(i)] for i in range(adapter.num_layers)], 0)
    elem = dtype.itemsize
    return [
        int(g.slot_len) * elem + _state_bytes(g)
        + (0 if clipping else elem * _trained_numel(layout, g))
        for g in layout.groups
    ]  # fmt: skip


def _state_bytes(group: GroupLayout) -> int:
    """A group's FP32 state as the store lays it out: the master of every parameter, the two
    moments of its trained ones only (``trained_len``)."""
    return 4 * int(group.state_len) + 2 * 4 * int(group.trained_len)


def _trained_numel(layout: StoreLayout, group: GroupLayout) -> int:
    """The parameters of ``group`` that train (the others get no gradient)."""
    return sum(p.numel for p in layout.group_params(group) if not p.frozen)


def resident_embedding_bytes(adapter: HFAdapter, dtype: torch.dtype, *, clipping: bool) -> int:
    """Device bytes the embedding and head groups add when GPU-resident: the FP32 master,
    both Adam moments of their trained parameters (as ``resident_layer_bytes``) and, without
    clipping, the trained parameters' gradient kept to the step's end (``e`` B/param; the
    update reads it in one pass, with no f32 copy). Their weights are the window's own buffers
    either way (``estimate``'s window term)."""

    specs = adapter.group_specs()
    layout = HostStore.plan([specs[adapter.embed_group], specs[adapter.head_group]], 0)
    groups = layout.groups
    trained = sum(_trained_numel(layout, g) for g in groups)
    return sum(_state_bytes(g) for g in groups) + (0 if clipping else dtype.itemsize * trained)


def resident_rank_bytes(
    adapter: HFAdapter, dtype: torch.dtype, *, clipping: bool, layers: int, embeddings: bool,
    ranks: int,
) -> int:  # fmt: skip
    """The most GPU-resident bytes any of ``ranks`` ranks of a node holds with the first
    ``layers`` decoder layers (and with ``embeddings`` the embedding and head) resident: every
    rank keeps every resident layer's weights, a group's FP32 state (and, without clipping, its
    reduced gradient) only its owner (``Dist.owner``: group ``g`` on local rank ``g % ranks``;
    ``runtime.resident``). One rank: ``resident_layer_bytes`` of the first ``layers`` plus
    ``resident_embedding_bytes``."""
    specs = adapter.group_specs()
    resident = [adapter.layer_group(i) for i in range(layers)]
    if embeddings:
        resident += [adapter.embed_group, adapter.head_group]
    if not resident:
        return 0
    layout = HostStore.plan([specs[g] for g in resident], 0)
    elem = dtype.itemsize
    held = [0] * ranks
    for group, g in zip(resident, layout.groups, strict=True):
        if group not in (adapter.embed_group, adapter.head_group):  # theirs: the window's
            held = [b + int(g.slot_len) * elem for b in held]
        grad = 0 if clipping else elem * _trained_numel(layout, g)
        held[group % ranks] += _state_bytes(g) + grad
    return max(held)


# the resident update's pass (``runtime.resident.adamw_tensor``, compiled): bytes it moves per
# parameter (BF16 gradient read; FP32 master and moments read and written; BF16 weight written) and
# the rate it moved them at on the H100 (benches/resident_update.py: 4.02 B parameters of Qwen3-4B
# in 53.9 ms, benchmarks/2026-11-25-autopolicy-h100.md, section "Qwen3-8B, B=16: the OOM kill found
# and fixed"); used for every GPU, so on one with more memory bandwidth (the H200) the update is
# overstated, not yet measured there
RESIDENT_UPDATE_BYTES_PER_PARAM = 28
RESIDENT_UPDATE_GBPS = 2090.0


def resident_update_s(params: int) -> float:
    """The device update of ``params`` resident parameters, seconds."""
    return RESIDENT_UPDATE_BYTES_PER_PARAM * params / (RESIDENT_UPDATE_GBPS * 1e9)


def resident_update_s_per_layer(adapter: HFAdapter) -> float:
    """The solver's ``Resident.update_s_per_layer``: the largest decoder layer's device update
    (as ``resident_bytes_per_layer``, any K layers take at most K times it)."""
    specs = adapter.group_specs()
    return resident_update_s(
        max(specs[adapter.layer_group(i)].numel for i in range(adapter.num_layers))
    )


def resident_embedding_update_s(adapter: HFAdapter) -> float:
    """The device update of the embedding and head when they are resident."""
    specs = adapter.group_specs()
    return resident_update_s(specs[adapter.embed_group].numel + specs[adapter.head_group].numel)


def resident_bytes_per_layer(adapter: HFAdapter, dtype: torch.dtype, *, clipping: bool) -> int:
    """The solver's ``Resident.bytes_per_layer`` (``crates/slidedp-core/src/solve``): the
    largest decoder layer's resident bytes, so any K layers fit in K times it."""
    return max(resident_layer_bytes(adapter, dtype, clipping=clipping))


@dataclass(frozen=True)
class ResidentTerms:
    """What the layout solver takes of GPU-resident groups, for one rank of a node's ``ranks``
    (``resident_terms``): any K resident layers hold at most ``K * bytes_per_layer +
    reserve_bytes`` on any rank and add ``K * update_s_per_layer`` to its step; the embedding
    and head, ``embedding_bytes`` and ``embedding_update_s``."""

    bytes_per_layer: int
    reserve_bytes: int  # off the budget: the owner of one layer more than K / ranks
    update_s_per_layer: float
    embedding_bytes: int
    embedding_update_s: float


def resident_terms(
    adapter: HFAdapter, dtype: torch.dtype, *, clipping: bool, ranks: int, gather_gbps: float
) -> ResidentTerms:
    """The solver's resident terms on ``ranks`` ranks of a node (``runtime.resident``: every
    rank keeps each resident layer's weights; a group's FP32 state, gradient and update are
    its owner's, group ``g`` on rank ``g % ranks``; the owner broadcasts the weights at
    ``gather_gbps``). Upper bounds: the owners take turns, so a rank owns at most
    ``ceil(K / ranks)`` of K layers, ``K / ranks`` plus the reserve's one. One rank: the
    one-GPU bounds (``resident_bytes_per_layer``, ``resident_embedding_bytes``)."""
    if ranks == 1:
        return ResidentTerms(resident_bytes_per_layer(adapter, dtype, clipping=clipping), 0,
                             resident_update_s_per_layer(adapter),
                             resident_embedding_bytes(adapter, dtype, clipping=clipping),
                             resident_embedding_update_s(adapter))  # fmt: skip
    specs = adapter.group_specs()
    groups = [adapter.layer_group(i) for i in range(adapter.num_layers)]
    slots = [int(g.slot_len) * dtype.itemsize
             for g in HostStore.plan([specs[g] for g in groups], 0).groups]  # fmt: skip
    per_layer = resident_layer_bytes(adapter, dtype, clipping=clipping)
    owned = max(b - w for b, w in zip(per_layer, slots, strict=True))  # state (+ gradient)
    numel = max(specs[g].numel for g in groups)
    ends = [specs[adapter.embed_group].numel, specs[adapter.head_group].numel]
    one_owner = adapter.embed_group % ranks == adapter.head_group % ranks
    embedding_bytes = resident_rank_bytes(
        adapter, dtype, clipping=clipping, layers=0, embeddings=True, ranks=ranks
    )
    return ResidentTerms(
        bytes_per_layer=max(slots) + -(-owned // ranks),
        reserve_bytes=owned * (ranks - 1) // ranks + 1,
        update_s_per_layer=resident_update_s(numel) / ranks + 2 * numel / (gather_gbps * 1e9),
        embedding_bytes=embedding_bytes,
        embedding_update_s=resident_update_s(sum(ends) if one_owner else max(ends))
        + 2 * sum(ends) / (gather_gbps * 1e9),
    )
