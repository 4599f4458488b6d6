"""The step-time model's inputs (``plan.step_spec.StepSpec``; the Rust model,
``slidedp_core::model``, predicts from them through ``predict_step``): a step's service times
from the model's shapes and the rates (``spec_from_shapes``), or a traced step's
(``spec_from_trace``), so the model can be checked against what the engine did:
``slidedp bench model TRACE.json ...`` schedules the traced operations' own durations through
the model's dependencies (window slots, the gradient ring, version gates, the clipping
schedule) and compares the predicted step with the traced one.

Example::

    spec = spec_from_trace(json.loads(Path("trace.json").read_text()), slots=2, grad_slots=4)
    predict_step(spec).step_s                     # plan.step_spec
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from slidedp.errors import ConfigError
from slidedp.models.shape import layer_shapes
from slidedp.plan.attention_rate import attention_efficiency
from slidedp.plan.cost import resident_update_s
from slidedp.plan.step_spec import StepSpec
from slidedp.plan.update_lanes import owner_lane_gbps, update_owners

if TYPE_CHECKING:
    from slidedp.models.hf import HFAdapter
    from slidedp.models.shape import LayerShape
    from slidedp.plan.layout import LayerPolicy
    from slidedp.plan.policy import Policy

PREP, H2D, COMPUTE, OFFLOAD, D2H, UPDATE = 1, 2, 3, 4, 5, 6  # the trace's lanes (trace.py)
ContextScheme = Literal["ulysses", "allgather"]


def _spans(trace: dict[str, Any], tid: int) -> list[dict[str, Any]]:
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("tid") == tid]
    return sorted(spans, key=lambda e: float(e["ts"]))


def traced_step_s(trace: dict[str, Any]) -> float:
    """The traced step's wall time: from its start to the last GPU-side span's end."""
    ends = [
        float(e["ts"]) + float(e["dur"])
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("tid") in (COMPUTE, H2D, D2H, 7)
    ]
    return max(ends) / 1e6


def spec_from_trace(
    trace: dict[str, Any], *, slots: int, grad_slots: int, clipping: bool | None = None
) -> StepSpec:
    """A ``StepSpec`` whose service times are the traced step's spans: compute per operation
    (embedding forward, layers, head, layers backward, embedding backward), the forward's load
    of each group (a backward reload takes as long), each group's AdamW; the gradient copies'
    total split in proportion to the groups' AdamW time (both scale with the group's size).
    ``clipping``: read from the trace when None (the first update of a clipped step is of
    the previous step, in forward order)."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ConfigError(
            "not a trace (no traceEvents list): give the Chrome trace of `slidedp bench train "
            "--trace` or runtime.trace_path"
        )
    compute = [float(e["dur"]) / 1e6 for e in _spans(trace, COMPUTE)]
    layers = (len(compute) - 3) // 2
    if layers < 1 or len(compute) != 2 * layers + 3:
        raise ConfigError(f"the trace has {len(compute)} compute spans: not one whole step")
    loads = [float(e["dur"]) / 1e6 for e in _spans(trace, H2D)][: layers + 2]
    update_by_group: dict[str, float] = defaultdict(float)
    updates = _spans(trace, UPDATE)
    for e in updates:
        update_by_group[e["name"]] += float(e["dur"]) / 1e6
    names = ["embed", *[f"layers.{i}" for i in range(layers)], "head"]
    update_s = [update_by_group.get(n, 0.0) for n in names]
    total_update = sum(update_s) or 1.0
    d2h = sum(float(e["dur"]) / 1e6 for e in _spans(trace, D2H))
    offload = [float(e["dur"]) / 1e6 for e in _spans(trace, OFFLOAD)]
    # without the mirror the host casts before every load: its total, split by load size over
    # the forward's loads and the backward's reloads (all layers but the resident ones)
    prep = sum(float(e["dur"]) / 1e6 for e in _spans(trace, PREP))
    loaded = sum(loads) + sum(loads[1 : layers + 1 - slots])
    if clipping is None:
        clipping = bool(updates) and updates[0]["name"] != "head"
    acts = len(offload) >= 2 * layers
    return StepSpec(
        forward_s=tuple(compute[1 : layers + 1]),
        backward_s=tuple(compute[layers + 2 : 2 * layers + 2][::-1]),  # traced last layer first
        embed_forward_s=compute[0],
        head_s=compute[layers + 1],
        embed_backward_s=compute[-1],
        load_s=tuple(loads),
        grad_copy_s=tuple(d2h * u / total_update for u in update_s),
        update_s=tuple(update_s),
        cast_s=tuple(prep * x / loaded for x in loads) if prep > 0 else (),
        offload_s=tuple(offload[:layers]) if acts else (),
        reload_s=tuple(offload[layers : 2 * layers][::-1]) if acts else (),
        slots=slots,
        grad_slots=grad_slots,
        clipping=clipping,
    )


# Service rates for a prediction before anything runs (labelled as assumptions where they are):
# the share of the dense bf16 peak a decoder layer's matmuls reach, measured on the H100 with
# `slidedp profile layer` (Qwen3-4B, B=16: forward 9.53 ms for 3.44 TFLOP = 36.5% of 989);
# the head's chunked loss lands at the same share (traced 108 ms vs 106 predicted).
LAYER_EFFICIENCY = 0.365
# PCIe copies and the host cast, DEVICE.md's H100-host ceilings (Gen5 x16, pinned)
H2D_GBPS, D2H_GBPS, CAST_GBPS = 51.0, 54.0, 78.0
ADAMW_BYTES_PER_PARAM = 28  # f32 master, m, v read and written, the gradient read
CAST_BYTES_PER_PARAM = 6  # the f32 master read, its bf16 copy written
# the backward's replay as a share of the layer's forward: full and selective checkpointing
# replay up to a whole forward (an upper bound: selective keeps some outputs), N none
REPLAY_SHARE = {"F": 1.0, "S": 1.0, "SAC": 1.0, "N": 0.0}


def layer_times(report: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Forward and backward seconds per candidate of a ``slidedp profile layer`` report; with
    layers of several kinds, the mean over the kinds that have it, by their layers."""
    weight = {int(k): n for k, n in (report.get("kinds") or {"0": 1}).items()}
    sums: dict[str, tuple[float, float, float]] = {}
    for c in report["candidates"]:
        w = weight.get(int(c.get("kind", 0)), 1)
        n, f, b = sums.get(c["policy"], (0.0, 0.0, 0.0))
        sums[c["policy"]] = (n + w, f + w * float(c["forward_s"]), b + w * float(c["backward_s"]))
    return {p: (f / n, b / n) for p, (n, f, b) in sums.items()}


# Several nodes: assumptions of the prediction, not measurements: NCCL's reduce of
# a layer's bf16 gradient over a node's NVLink at 360 GB/s (bus bandwidth of an 8x H100 node),
# the owners' ring all-reduce across nodes at 90% of the inter-node link, 10 us per ring hop.
NVLINK_GBPS = 360.0
LINK_EFFICIENCY = 0.9
HOP_LATENCY_S = 10e-6


@dataclass(frozen=True)
class Links:
    """The copy and collective rates of a prediction, GB/s (1e9 B/s): the PCIe ceilings and
    the node's NVLink assumption unless measured (``source`` says which). ``reduce_gbps`` and
    ``gather_gbps`` are algorithm bandwidths of a layer-sized bf16 ``reduce`` and
    ``all_gather`` (``bench.collectives``' ``algbw``)."""

    h2d_gbps: float = H2D_GBPS
    d2h_gbps: float = D2H_GBPS
    reduce_gbps: float = NVLINK_GBPS
    gather_gbps: float = NVLINK_GBPS
    source: str = "assumed"


@dataclass(frozen=True)
class Ranks:
    """The GPUs of one host that train together, and their routes (``runtime.grad_route``,
    ``runtime.param_route``); ``context`` of them split each sequence
    (``runtime.context_parallel``) by ``scheme``."""

    count: int = 1
    grad_route: Literal["gpu", "cpu"] = "gpu"
    param_route: Literal["replicated", "sharded"] = "replicated"
    context: int = 1
    scheme: ContextScheme = "ulysses"  # runtime.context_attention, resolved


def replays_exchange(policy: LayerPolicy) -> bool:
    """Whether a layer's backward runs its attention's all-to-alls again: every family that
    replays the attention (``F`` the whole layer; ``S`` its attention span, whose backward
    needs q, k, v over the whole sequence and the output projection's input; ``SAC.mm`` and
    ``SAC.attn`` keep no exchange's output), not ``N`` nor ``SAC.noact`` (it keeps every
    operator's output but the activations', the exchanges' among them)."""
    return policy.family != "N" and str(policy) != "SAC.noact"


def rank_attended(shape: LayerShape, *, seq_len: int, context: int, scheme: ContextScheme) -> int:
    """``shape.attended`` for the most loaded rank of ``context`` splitting every row, so that
    ``2 q_dim x attended x tokens`` is its attention's forward FLOPs over its S/R tokens:
    Ulysses' H/R heads over the whole sequence are 1/R of the work (``attended`` as it is);
    allgather's last rank has the last shard's queries over every key before them, on average
    ``S - S/2R`` keys where the causal half counts ``S/2``: ``2S - S/R`` (a sliding window's
    layers are left at theirs)."""
    if context == 1 or scheme == "ulysses" or shape.attended < seq_len:
        return shape.attended
    return 2 * seq_len - seq_len // context


def context_exchange_s(
    shapes: list[LayerShape],
    layers: tuple[LayerPolicy, ...],
    *,
    tokens: int,
    gbps: float,
    context: int,
    scheme: ContextScheme = "ulysses",
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per decoder layer, one rank's exchanges of context parallelism over ``context`` ranks
    (``runtime.context_parallel``): (forward, backward) seconds. ``tokens``: the rank's, rows
    x S/R. Ulysses: the forward sends q, k and v to the ranks of their heads and takes the
    attention's output back, ``tokens x (2 q_dim + 2 kv_dim)`` elements of the rank's buffers;
    allgather: the forward gathers every rank's keys and values, ``R x tokens x 2 kv_dim``
    elements received. The backward moves their gradients the other way (as many: the
    all-to-alls reversed, the gather's reduce-scatter), and again the forward's where the
    layer replays them (``replays_exchange``). Time: the bytes over ``gbps``, an
    ``all_gather``'s algorithm bandwidth (its output over its time; nccl-tests count the bus
    bandwidth of all three as algbw x (R-1)/R: each rank sends (R-1)/R of its buffer)."""
    elem_bytes = 2  # the bf16 activations (a GPU run's compute dtype)
    if scheme == "ulysses":
        elems = [tokens * (2 * s.q_dim + 2 * s.kv_dim) for s in shapes]
    else:
        elems = [context * tokens * 2 * s.kv_dim for s in shapes]
    forward = [n * elem_bytes / (gbps * 1e9) for n in elems]
    backward = [f * (2 if replays_exchange(p) else 1) for f, p in zip(forward, layers, strict=True)]
    return tuple(forward), tuple(backward)


@dataclass(frozen=True)
class Rates:
    """The rates a prediction takes: the GPU's peak, host AdamW (and the cast on delivery
    under DMA; None: ``CAST_GBPS``), the links between GPUs, the layer profile's times by
    layer policy."""

    peak_flops: float
    adamw_gbps: float
    cast_gbps: float | None = None
    links: Links = field(default_factory=Links)
    measured: dict[str, tuple[float, float]] = field(default_factory=dict)
    calibration: tuple[str, ...] = ()  # what of these was measured, for the report's line
    # host AdamW with no copies beside it; None: ``adamw_gbps`` (the rate under them) throughout
    adamw_alone_gbps: float | None = None
    # one of R ranks' pools while all update (``plan.update_lanes``); None: the node's shared
    pool_gbps: float | None = None


def host_update_gbps(rates: Rates, copy_share: float) -> float:
    """The host AdamW rate of a step whose copies load the host's DRAM ``copy_share`` as much
    as the host probe's GPU copying both ways without a pause (capped at 1): that share of the
    update at the rate under the copies (``adamw_gbps``), the rest at ``adamw_alone_gbps``;
    harmonic, as the seconds add up."""
    alone = rates.adamw_alone_gbps
    if alone is None:
        return rates.adamw_gbps
    share = min(1.0, max(0.0, copy_share))
    return 1.0 / (share / rates.adamw_gbps + (1.0 - share) / alone)


def _copy_share(
    params: list[int],
    policy: Policy,
    ranks: Ranks,
    links: Links,
    offloaded_bytes: list[int],
    compute_s: float,
    alone_gbps: float,
) -> float:
    """The ranks' host copies per step (each rank: its load of the host-updated groups, its
    share on the sharded route; the gradients it copies back, the owner's on the gpu route;
    the activations offloaded and reloaded), the busier direction's seconds times the ranks,
    over a floor of the step: the compute, the update alone, the copies."""
    r, layers = ranks.count, len(policy.layers)
    resident = {1 + i for i in range(layers) if policy.resident(i)}
    resident |= {0, layers + 1} if policy.resident_embeddings else set()
    streamed = sum(n for g, n in enumerate(params) if g not in resident)
    load_share = r if r > 1 and ranks.param_route == "sharded" else 1
    grad_share = 1 if r > 1 and ranks.grad_route == "cpu" else r  # bf16 copies either way
    offloaded = sum(offloaded_bytes)
    h2d_s = (2 * streamed / load_share + offloaded) / (links.h2d_gbps * 1e9)
    d2h_s = (2 * streamed / grad_share + offloaded) / (links.d2h_gbps * 1e9)
    update_s = ADAMW_BYTES_PER_PARAM * streamed / (alone_gbps * 1e9)
    copies_s = max(h2d_s, d2h_s)
    return r * copies_s / max(compute_s, update_s, copies_s, 1e-12)


def step_update_gbps(adapter: HFAdapter, policy: Policy, rates: Rates, ranks: Ranks,
                     offloaded_bytes: list[int], compute_s: float) -> float:  # fmt: skip
    """The host AdamW rate of a step of ``policy`` whose compute takes ``compute_s``
    (``compute_times``): ``host_update_gbps`` at its copy share (``_copy_share``),
    ``adamw_gbps`` without a rate alone."""
    alone = rates.adamw_alone_gbps
    if alone is None:
        return rates.adamw_gbps
    params = [g.numel for g in adapter.group_specs()]
    share = _copy_share(params, policy, ranks, rates.links, offloaded_bytes, compute_s, alone)
    return host_update_gbps(rates, share)


@dataclass(frozen=True)
class _RouteTimes:
    load_s: tuple[float, ...]
    reduce_s: tuple[float, ...] = ()
    host_sum_s: tuple[float, ...] = ()


def _route_times(params: list[int], ranks: Ranks, links: Links, host_gbps: float) -> _RouteTimes:
    """One rank's view of the routes, per group: the load (sharded: its share, then the
    all-gather on the same copy stream), the gradient's reduction onto its owner (gpu route,
    a synchronous collective), and on the cpu route the host sum of the ranks' copies (each
    rank copies its bf16 gradient to its landing slots, as the gpu route's owner copies its
    own): it reads ``count`` bf16 copies and writes the f32 sum, 2 * count + 4 bytes per
    parameter at the host's DRAM rate (as AdamW's); its Σ g² is taken in the same pass
    (``Kernels.sum_into_squares``), reading nothing more. The owner's update worker sums once
    every peer's copy has landed, then runs AdamW: the model puts each group's sum on its
    owner's update lane, at the lane's rate ``host_gbps`` (``StepSpec.host_sum_s``)."""
    r = ranks.count
    sharded = r > 1 and ranks.param_route == "sharded"
    load = tuple(
        2 * n / r / (links.h2d_gbps * 1e9) + 2 * n / (links.gather_gbps * 1e9)
        if sharded
        else 2 * n / (links.h2d_gbps * 1e9)
        for n in params
    )
    if r == 1:
        return _RouteTimes(load)
    if ranks.grad_route == "gpu":
        return _RouteTimes(load, reduce_s=tuple(2 * n / (links.reduce_gbps * 1e9) for n in params))
    return _RouteTimes(load, host_sum_s=tuple((2 * r + 4) * n / (host_gbps * 1e9) for n in params))


def context_extra_s(
    shape: LayerShape,
    policy: LayerPolicy,
    *,
    rows: int,
    seq_len: int,
    ranks: Ranks,
    peak_flops: float,
    gbps: float,
) -> tuple[float, float]:
    """What a context-parallel rank's layer of ``shape`` under ``policy`` takes beyond one
    GPU's layer at its shard's shape (``rows`` x S/R tokens, as ``profile_spec`` profiles it):
    (forward, forward + backward) seconds. Its heads attend over the whole ``seq_len`` rather
    than the shard (``rank_attended``'s term less the shard's, at ``attention_efficiency``,
    the backward's replay as ``REPLAY_SHARE`` counts it), and its exchanges
    (``context_exchange_s``, at ``gbps``)."""
    r = ranks.context
    tokens = rows * (seq_len // r)
    whole = rank_attended(shape, seq_len=seq_len, context=r, scheme=ranks.scheme)
    shard = min(shape.attended, seq_len // r)  # a sliding window caps both
    rate = attention_efficiency(shape.attended) * peak_flops
    forward = 2 * shape.q_dim * (whole - shard) * tokens / rate
    (x_forward,), (x_backward,) = context_exchange_s(
        [shape], (policy,), tokens=tokens, gbps=gbps, context=r, scheme=ranks.scheme
    )
    total = (3 + REPLAY_SHARE[policy.family]) * forward + x_forward + x_backward
    return forward + x_forward, total


def compute_times(adapter: HFAdapter, policy: Policy, *, batch: int, seq_len: int, rates: Rates,
                  ranks: Ranks) -> tuple[list[float], list[float], float]:  # fmt: skip
    """One rank's compute per layer (forward, backward: the profile's measured times where
    it has the layer's policy and the rank holds whole rows, else from FLOPs) and the head's,
    in seconds (``spec_from_shapes``'s terms)."""
    measured = rates.measured if ranks.context == 1 else {}
    tokens = batch * seq_len // ranks.context
    shapes = layer_shapes(adapter.config, seq_len)  # attended: over the whole sequence
    rate = LAYER_EFFICIENCY * rates.peak_flops
    attended = [rank_attended(s, seq_len=seq_len, context=ranks.context, scheme=ranks.scheme)
                for s in shapes]  # fmt: skip
    forward = [
        2 * s.matmul_params * tokens / rate
        + 2 * s.q_dim * a * tokens / (attention_efficiency(s.attended) * rates.peak_flops)
        for s, a in zip(shapes, attended, strict=True)
    ]
    backward = [
        (2 + REPLAY_SHARE[p.family]) * f for f, p in zip(forward, policy.layers, strict=True)
    ]
    if policy.compute.mlp_tile_tokens and tokens > policy.compute.mlp_tile_tokens:
        # a tiled MLP's backward runs its forward once more, tile by tile (models.tiled_mlp;
        # a layer profile of the run measures it with the tiles)
        backward = [
            b + 2 * s.mlp_params * tokens / rate for b, s in zip(backward, shapes, strict=True)
        ]
    for i, p in enumerate(policy.layers):
        if measured and str(p) in measured:
            forward[i], backward[i] = measured[str(p)]
    head = 6 * adapter.vocab_size * adapter.hidden_size * tokens / rate
    return forward, backward, head


def spec_from_shapes(
    adapter: HFAdapter,
    policy: Policy,
    *,
    batch: int,
    seq_len: int,
    rates: Rates,
    clipping: bool,
    offloaded_bytes: list[int],
    ranks: Ranks | None = None,
) -> StepSpec:
    """A ``StepSpec`` from the model's shapes and the policy, with ``rates``: compute from
    FLOPs (the matmuls' at ``LAYER_EFFICIENCY`` of ``peak_flops``, attention's quadratic term
    at ``attention_efficiency``), copies at ``links`` (the PCIe ceilings by default), AdamW at
    ``host_update_gbps``, the cast on delivery (no mirror) at ``cast_gbps`` (``offloaded_bytes``:
    per layer, ``plan.cost``). ``measured``: a layer policy's forward and backward (replay
    included) as the layer profile timed them (``layer_times``); they replace the FLOPs-rate
    times of the layers with that policy. ``batch``: per rank. ``ranks``: several GPUs of this
    host (``_route_times``): each group's AdamW (and the cpu route's sum) on its owner's
    update lane (``runtime.dist.group_owner``) at ``owner_lane_gbps``, the copies of all of
    them slowing the host (``_copy_share``). ``ranks.context`` R > 1: each rank computes S/R
    tokens of every row and its share of attention (``rank_attended``), plus the exchanges
    (``context_exchange_s``, at ``links.gather_gbps``); the profile's times are of one GPU's
    whole layer, so the FLOPs rates stand for them."""

    ranks, links = ranks or Ranks(), rates.links
    cast_gbps = rates.cast_gbps or CAST_GBPS
    tokens = batch * seq_len // ranks.context
    forward, backward, head = compute_times(adapter, policy, batch=batch, seq_len=seq_len,
                                            rates=rates, ranks=ranks)  # fmt: skip
    exchange = ((), ()) if ranks.context == 1 else context_exchange_s(
        layer_shapes(adapter.config, seq_len), policy.layers, tokens=tokens,
        gbps=links.gather_gbps, context=ranks.context, scheme=ranks.scheme)  # fmt: skip
    params = [g.numel for g in adapter.group_specs()]
    grad_bytes = 2  # the compute dtype (bf16) on the device, then to the host
    cast_share = ranks.count if ranks.param_route == "sharded" else 1  # each casts its shard
    compute_s = sum(forward) + sum(backward) + head
    node_gbps = step_update_gbps(adapter, policy, rates, ranks, offloaded_bytes, compute_s)
    adamw_gbps = owner_lane_gbps(node_gbps, ranks.count, rates.pool_gbps, rates.adamw_alone_gbps)
    routes = _route_times(params, ranks, links, adamw_gbps)
    spec = StepSpec(
        forward_s=tuple(forward),
        backward_s=tuple(backward),
        embed_forward_s=0.0,
        head_s=head,
        embed_backward_s=0.0,
        load_s=routes.load_s,
        grad_copy_s=tuple(grad_bytes * n / (links.d2h_gbps * 1e9) for n in params),
        update_s=tuple(ADAMW_BYTES_PER_PARAM * n / (adamw_gbps * 1e9) for n in params),
        cast_s=()
        if policy.mirror
        else tuple(CAST_BYTES_PER_PARAM * n / cast_share / (cast_gbps * 1e9) for n in params),
        offload_s=tuple(b / (links.d2h_gbps * 1e9) for b in offloaded_bytes),
        reload_s=tuple(b / (links.h2d_gbps * 1e9) for b in offloaded_bytes),
        reduce_s=routes.reduce_s,
        host_sum_s=routes.host_sum_s,
        all_to_all_forward_s=exchange[0],
        all_to_all_backward_s=exchange[1],
        owners=update_owners(len(params), ranks.count),
        slots=policy.slots,
        grad_slots=policy.grad_slots,
        clipping=clipping,
    )
    return _make_resident(spec, policy, params, ranks, links)


def _make_resident(
    spec: StepSpec, policy: Policy, params: list[int], ranks: Ranks, links: Links
) -> StepSpec:
    """The policy's GPU-resident groups (its first layers; the embedding and head with
    ``resident_embeddings``) in ``spec``: flagged, so the model gives them no load, cast,
    gradient copy, host update nor version wait; their AdamW is device time
    (``plan.cost.resident_update_s``), counted in the layer's backward and in the embedding's
    and head's compute (the engine runs it on a stream of its own, after the norm with
    clipping: counted in the compute lane, the step is overstated by at most that time).
    Several ranks: each owner updates its groups (1/R of the update on each rank, in parallel)
    and broadcasts the bf16 weights, at the all-gather's rate; the gradient's reduction onto
    the owner is the route's (``reduce_s``)."""

    layers = spec.layers
    groups = {1 + i for i in range(layers) if policy.resident(i)}  # a layer's group: i + 1
    if policy.resident_embeddings:
        groups |= {0, layers + 1}
    if not groups:
        return spec
    r = ranks.count
    backward_s, embed_backward_s, head_s = list(spec.backward_s), spec.embed_backward_s, spec.head_s
    for g in groups:
        device_update_s = resident_update_s(params[g]) / r
        if r > 1:
            device_update_s += 2 * params[g] / (links.gather_gbps * 1e9)
        if g == 0:
            embed_backward_s += device_update_s
        elif g == layers + 1:
            head_s += device_update_s
        else:
            backward_s[g - 1] += device_update_s
    return replace(spec, resident=tuple(g in groups for g in range(layers + 2)),
                   backward_s=tuple(backward_s), embed_backward_s=embed_backward_s,
                   head_s=head_s)  # fmt: skip


def reduce_s(
    group_params: list[int], *, gpus_per_node: int, nodes: int, link_gbit_s: float
) -> list[float]:
    """Per group: its bf16 gradient reduced onto the owner within the node (NVLink), then
    all-reduced among the nodes' owners by a ring (each moves ``2 (N-1)/N`` of the bytes over
    the link, ``2 (N-1)`` hops)."""
    link_bytes_s = link_gbit_s / 8 * 1e9 * LINK_EFFICIENCY
    out = []
    for n in group_params:
        grad_bytes = 2 * n
        within = grad_bytes / (NVLINK_GBPS * 1e9) if gpus_per_node > 1 else 0.0
        across = 0.0
        if nodes > 1:
            ring = 2 * (nodes - 1)
            across = ring / nodes * grad_bytes / link_bytes_s + ring * HOP_LATENCY_S
        out.append(within + across)
    return out
