"""The routes stage of ``runtime.policy: auto`` on several GPUs of one host: which parameter
route (``replicated``: the whole layer to every rank; ``sharded``: 1/R each and an all-gather)
and which gradient route (``gpu``: reduced on the devices; ``cpu``: summed on the host) a run
takes. Each candidate is the run with the chosen layout on that route, predicted by
``plan.predict.route_steps`` (routes the machine cannot hold or the launch refuses are left
out); the config's route is kept unless another is predicted ``select.MIN_GAIN`` faster, as the
layout stage keeps the all-F default. The chunk is the chunk stage's, chosen before.

Example::

    steps = route_steps(cfg, adapter, machine, list(ROUTES), rates)
    choice = choose_route(steps, default=("replicated", "gpu"))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slidedp.autopolicy.select import MIN_GAIN
from slidedp.errors import ConfigError
from slidedp.plan.machine import gpu_peak
from slidedp.plan.predict import ROUTES, Route, host_rates, links_for, route_name, route_steps
from slidedp.plan.timing import layer_times

if TYPE_CHECKING:
    from slidedp.config import TrainConfig
    from slidedp.models.hf import HFAdapter
    from slidedp.plan.machine import HostRate, Machine


@dataclass(frozen=True)
class RouteChoice:
    route: Route  # the chosen (param_route, grad_route)
    step_s: dict[Route, float]  # the predicted step of every candidate route, seconds
    default: Route  # the config's route, kept unless another is MIN_GAIN faster
    kept_default: bool  # another route was predicted faster, but not by MIN_GAIN

    @property
    def gain(self) -> float:
        """The chosen route's predicted speed over the config's."""
        return self.step_s[self.default] / self.step_s[self.route]

    def describe(self) -> str:
        """``replicated/gpu (predicted 0.812 s; sharded/gpu 0.815, replicated/cpu 1.113, ...)``."""
        others = ", ".join(
            f"{route_name(r)} {s:.3f}" for r, s in sorted(self.step_s.items(), key=lambda x: x[1])
            if r != self.route
        )  # fmt: skip
        why = ""
        if self.kept_default:
            best = min(self.step_s, key=lambda r: self.step_s[r])
            why = f"; kept: {route_name(best)} is not {MIN_GAIN:.0%} faster"
        elif self.route != self.default:
            why = f"; {self.gain:.2f}x the config's {route_name(self.default)}"
        return (
            f"{route_name(self.route)} (predicted {self.step_s[self.route]:.3f} s"
            + (f"; {others}" if others else "")
            + f"{why})"
        )


def candidate_routes(cfg: TrainConfig, fixed: bool | None) -> list[Route]:
    """The routes auto may take: only the config's with ``fixed``; with None, every route
    whose keys the config leaves at their defaults (a key that differs from the dataclass
    default is the user's: a route set to its default value cannot be told from an unset
    one, and auto may then change it)."""
    rt = cfg.runtime
    config_route = (rt.layout.param_route, rt.layout.grad_route)
    if fixed:
        return [config_route]
    defaults = type(rt)()
    param_free = fixed is False or rt.layout.param_route == defaults.layout.param_route
    grad_free = fixed is False or rt.layout.grad_route == defaults.layout.grad_route
    return [
        (p, g)
        for p, g in ROUTES
        if (param_free or p == rt.layout.param_route) and (grad_free or g == rt.layout.grad_route)
    ]


def choose_route(steps: dict[Route, float], default: Route) -> RouteChoice:
    """The fastest of ``steps``, unless ``default`` (among them) is within ``MIN_GAIN`` of it."""
    if not steps:
        raise ConfigError("runtime.policy=auto: no route fits this machine (slidedp estimate)")
    best = min(steps, key=lambda r: steps[r])
    if default not in steps:  # the config's route does not fit: the fastest that does
        return RouteChoice(best, steps, best, kept_default=False)
    if steps[default] < (1 + MIN_GAIN) * steps[best]:
        return RouteChoice(default, steps, default, kept_default=best != default)
    return RouteChoice(best, steps, default, kept_default=False)


def routes_for(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    candidates: list[Route],
    report: dict[str, Any],
    host: HostRate,
) -> tuple[TrainConfig, str]:
    """``cfg`` on the routes ``choose_route`` picks among ``candidates`` for the layer times of
    ``report`` and the host rates of ``host``, and what it says (the config's routes, and why,
    where the model cannot predict them). GPU-resident groups take a gpu gradient route (the
    cpu route refuses them): a cpu route is the same layout with every group on the host."""
    rt = cfg.runtime
    config_route = (rt.layout.param_route, rt.layout.grad_route)
    resident = bool(rt.layout.resident_layers or rt.layout.resident_embeddings)
    host_only = dataclasses.replace(
        cfg, runtime=rt.with_keys(resident_layers=0, resident_embeddings=False)
    )
    peak, _ = gpu_peak(machine.gpu_name)
    links = links_for(rt.launch.world, adapter, machine) if machine.device == "cuda" else None
    why = None
    if machine.device != "cuda":
        why = "the route model is for GPUs"
    elif peak is None:
        why = f"no peak FLOP/s on record for {machine.gpu_name}"
    elif links is None:
        why = "the links between the GPUs are not measured"
    if why is not None or peak is None or links is None:
        kept = host_only if resident and config_route[1] == "cpu" else cfg
        return kept, f"{route_name(config_route)}, the config's ({why})"
    rates = host_rates(peak, host, links, layer_times(report))
    steps = route_steps(cfg, adapter, machine, candidates, rates)  # resident: gpu routes only
    if resident:
        on_host = [route for route in candidates if route[1] == "cpu"]
        steps |= route_steps(host_only, adapter, machine, on_host, rates)
    choice = choose_route(steps, config_route)
    fixed = ", fixed by the config" if len(candidates) == 1 else ""
    if resident and choice.route[1] == "cpu":
        cfg, fixed = host_only, f"{fixed}, the GPU-resident groups on the host there"
    said = (
        f"{choice.describe()}{fixed}; reduce {links.reduce_gbps:.0f}, all_gather "
        f"{links.gather_gbps:.0f} GB/s measured, copies at the PCIe ceilings"
    )
    runtime = cfg.runtime.with_keys(param_route=choice.route[0], grad_route=choice.route[1])
    return dataclasses.replace(cfg, runtime=runtime), said
