"""One step's time, predicted: ``predict(plan, adapter, shape, rates)`` runs the step-time model
(``plan.timing``, the Rust operation graph) for a ``Plan`` at one rank's batch and sequence.

``rates_for`` gathers what the machine measured and cached (the GPU's peak from
``plan.machine.gpu_peak``, the layer profile, the host AdamW rate, the links between GPUs);
``route_steps`` predicts one layout on each parameter/gradient route of several GPUs. A
context-parallel run (``Shape.context``) is predicted per rank with its all-to-alls. The
estimate's report, ``slidedp plan`` and ``runtime.policy: auto`` all predict through here.

Invariant: reads caches only; nothing is measured here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from slidedp.config import TrainConfig
from slidedp.errors import ConfigError
from slidedp.estimate import context_shape, estimate_memory, shortages
from slidedp.models.hf import HFAdapter
from slidedp.plan.cost import layer_footprint
from slidedp.plan.machine import HostRate, Machine, gpu_peak
from slidedp.plan.policy import Plan, layer_numel
from slidedp.plan.resolve import resolve_plan
from slidedp.plan.step_spec import Prediction, predict_step
from slidedp.plan.timing import ContextScheme, Links, Ranks, Rates, layer_times, spec_from_shapes
from slidedp.profile.layer import cached_profile, profile_spec
from slidedp.profile.links import cached_links
from slidedp.runtime.dist import check_config

ParamRoute = Literal["replicated", "sharded"]
GradRoute = Literal["gpu", "cpu"]
Route = tuple[ParamRoute, GradRoute]  # as `bench train --routes` writes them: PARAM/GRAD
ROUTES: tuple[Route, ...] = (
    ("replicated", "gpu"),
    ("replicated", "cpu"),
    ("sharded", "gpu"),
    ("sharded", "cpu"),
)


def route_name(route: Route) -> str:
    return f"{route[0]}/{route[1]}"


@dataclass(frozen=True, kw_only=True)
class CalibratedPrediction(Prediction):
    """The step-time model's prediction and which of its rates were measured
    (``calibration``, for the reports)."""

    calibration: str


@dataclass(frozen=True)
class Shape:
    """One rank's share of a step: rows of ``seq_len`` tokens, ``world`` ranks of this host,
    ``context`` of them splitting every row by ``scheme`` (each computes ``seq_len / context``
    tokens)."""

    rows: int
    seq_len: int
    world: int = 1
    context: int = 1
    scheme: ContextScheme = "ulysses"

    @classmethod
    def of_run(cls, cfg: TrainConfig, adapter: HFAdapter) -> Shape:
        launch = cfg.runtime.launch
        rows = cfg.train.global_batch_size // launch.data_world
        context = context_shape(cfg, adapter)
        scheme = context.scheme if context else "ulysses"
        return cls(rows, cfg.data.seq_len, launch.world, launch.context_parallel, scheme)


def links_for(world: int, adapter: HFAdapter, machine: Machine) -> Links | None:
    """The layer-sized reduce and all-gather between ``world`` GPUs where ``profile.links``
    cached them; None where they are not measured (the copies stay at ``plan.timing``'s PCIe
    ceilings either way: the host probe's joint copy rates are paced by its AdamW passes)."""
    if world <= 1 or machine.gpu_name is None:
        return None
    probe = cached_links(world, machine.gpu_name, layer_numel(adapter))
    if probe is None:
        return None
    return Links(reduce_gbps=float(probe["reduce_gbps"]), gather_gbps=float(probe["gather_gbps"]),
                 source="measured")  # fmt: skip


def host_rates(
    peak: float,
    host: HostRate,
    links: Links,
    measured: dict[str, tuple[float, float]],
    calibration: tuple[str, ...] = (),
) -> Rates:
    """The step-time model's rates with ``host``'s AdamW (under copies, alone, one of several
    ranks' pools) and cast."""
    return Rates(peak, host.gbps, host.cast_gbps, links, measured, calibration, host.alone_gbps,
                 host.pool_gbps)  # fmt: skip


def rates_for(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, host: HostRate
) -> Rates | None:
    """The rates of ``cfg`` on ``machine`` from the caches (None off CUDA or for a GPU without
    a peak on record): the run's layer profile where cached, ``host``'s AdamW rate."""
    peak, _ = gpu_peak(machine.gpu_name)
    if machine.device != "cuda" or peak is None:
        return None
    report = cached_profile(profile_spec(cfg))
    measured = layer_times(report) if report else {}
    links = links_for(cfg.runtime.launch.world, adapter, machine)
    said = [f"host AdamW {host.source}"] if host.source.startswith("measured") else []
    if links is not None:
        said.append("reduce and all_gather between the GPUs (cached)")
    return host_rates(peak, host, links or Links(), measured, tuple(said))


def predict(plan: Plan, adapter: HFAdapter, shape: Shape, rates: Rates) -> CalibratedPrediction:
    """The step-time model's prediction of ``plan`` (``predict_step``) and which of the rates
    were measured."""
    policy, shard = plan.policy, shape.seq_len // shape.context
    offloaded = [
        layer_footprint(adapter, p, shape.rows, shard, plan.dtype, i,
                        policy.compute).offloaded_bytes
        for i, p in enumerate(policy.layers)
    ]  # fmt: skip
    spec = spec_from_shapes(
        adapter,
        policy,
        batch=shape.rows,
        seq_len=shape.seq_len,
        rates=rates,
        clipping=plan.optim.max_grad_norm > 0,
        offloaded_bytes=offloaded,
        ranks=Ranks(
            shape.world, policy.grad_route, policy.param_route, shape.context, shape.scheme
        ),
    )
    # context parallel: FLOP rates for the layers (spec_from_shapes), the exchange's link
    covered = sum(str(p) in rates.measured for p in policy.layers) if shape.context == 1 else 0
    parts = [f"layer profile: {covered} of {len(policy.layers)} layers"] * bool(covered)
    if shape.context > 1:
        links = rates.links
        exchange = "all-to-all" if shape.scheme == "ulysses" else "key/value all-gather"
        parts.append(f"{exchange} at the all_gather's {links.gather_gbps:.0f} GB/s, {links.source}")
    calibration = ", ".join([*parts, *rates.calibration]) or "uncalibrated rates"
    return CalibratedPrediction(**vars(predict_step(spec)), calibration=calibration)


def route_steps(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, routes: list[Route], rates: Rates
) -> dict[Route, float]:
    """The predicted step, in seconds, of ``cfg`` (its layout, several ranks of this host) on
    each of ``routes`` that the launch accepts (``runtime.dist.check_config``) and ``machine``
    holds (``estimate.shortages``)."""
    rt, steps = cfg.runtime, {}
    for param, grad in routes:
        on_route = dataclasses.replace(
            cfg, runtime=rt.with_keys(param_route=param, grad_route=grad)
        )
        try:
            check_config(rt.launch.world, on_route.runtime, cfg.train)
        except ConfigError:
            continue
        plan = resolve_plan(on_route, adapter, machine)
        if shortages(estimate_memory(on_route, adapter, machine, plan)):
            continue
        step = predict(plan, adapter, Shape.of_run(on_route, adapter), rates)
        steps[(param, grad)] = step.step_s
    return steps
