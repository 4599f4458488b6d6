"""The command line of ``slidedp bench train --gpus N`` (``--ranks N`` on CPU): which runs of
several ranks join the single-GPU ones.

Run (on a machine with 2 GPUs)::

    slidedp bench train --shape qwen3-4b --sweep 4,16 --gpus 2 --json scale.json
    slidedp bench train --shape qwen3-4b --batch 4 --gpus 2 --routes all

Weak scaling: ``--batch`` is each rank's, rank ``r`` trains rows ``[r*B, (r+1)*B)``. Per batch:
ours once per route of ``--routes`` (``PARAM/GRAD``, ``all`` or ``auto``), FSDP2-offload and the
peers that scale on N ranks, and once the collectives' bandwidths (``bench.collectives``). The
reference and RoundPipe run on one GPU only; the reference is projected (x N).

    specs = scaled_specs(spec, systems, scale, at_batch)  # the N-rank runs at spec.batch
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slidedp.autopolicy.auto import AUTO, check_auto_free
from slidedp.bench.measure import RunSpec
from slidedp.bench.peers import PEERS, split_variant
from slidedp.config import TrainSection
from slidedp.config_runtime import RuntimeSection
from slidedp.errors import ConfigError
from slidedp.models.hf import HFAdapter
from slidedp.plan.policy import layer_numel
from slidedp.runtime.dist import check_config

Route = tuple[str, str]  # (param_route, grad_route)
ROUTES: tuple[Route, ...] = tuple(
    (param, grad) for param in ("replicated", "sharded") for grad in ("gpu", "cpu")
)
AUTO_ROUTE: Route = ("auto", "auto")  # --routes auto: runtime.policy=auto chooses the route
SCALED_SYSTEMS = ("ours", "fsdp2")  # the built-in systems that run on N ranks


def scales(name: str) -> bool:
    """Whether the system ``name`` (a variant: its system's) also runs on N ranks."""
    system = split_variant(name)[0]
    return system in SCALED_SYSTEMS or (system in PEERS and PEERS[system].scales)


def route_name(route: Route) -> str:
    return "auto" if route == AUTO_ROUTE else f"{route[0]}/{route[1]}"


@dataclass(frozen=True)
class Scale:
    """The runs of several ranks that join the single-GPU bench."""

    world: int
    routes: tuple[Route, ...]  # ours on ``world`` ranks, once per route
    main_route: Route  # the route of the weak-scaling summary: the config's if run
    first: bool = False  # the runs on ``world`` ranks before the one-GPU runs of each batch
    collectives: bool = True  # measure the collectives' bandwidths first
    context: int = 1  # ours' ranks that split each row (--context-parallel; bench.context)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="also run ours, fsdp2 and the peers of --systems on N GPUs at N x batch (weak "
        "scaling), the route table and the collectives' bandwidths",
    )
    arg("--ranks", type=int, default=None, metavar="N", help="as --gpus, CPU processes (gloo)")
    arg(
        "--routes",
        default=None,
        help="with --gpus/--ranks: ours' routes, PARAM/GRAD comma-separated "
        "(replicated|sharded/gpu|cpu), or all; auto: runtime.policy=auto chooses the layout and "
        "route; default the config's (auto with --set runtime.policy=auto)",
    )
    arg(
        "--scaled-first",
        action="store_true",
        help="with --gpus/--ranks: the runs on N ranks before the one-GPU runs of each batch "
        "(a run cut short by a time limit has its N-rank figures)",
    )
    arg(
        "--no-collectives",
        action="store_true",
        help="with --gpus/--ranks: skip the collectives' bandwidths (a minute or more on 4 GPUs)",
    )


def _routes(text: str | None, runtime: dict[str, Any]) -> tuple[Route, ...]:
    if text is None:
        if runtime["policy"] == AUTO:
            return (AUTO_ROUTE,)
        return ((runtime["param_route"], runtime["grad_route"]),)
    if text.strip() == "all":
        return ROUTES
    routes = []
    for item in text.split(","):
        param, _, grad = item.strip().partition("/")
        if item.strip() == AUTO:
            routes.append(AUTO_ROUTE)
            continue
        if (param, grad) not in ROUTES:
            raise ConfigError(
                f"--routes {text!r}: use all, or comma-separated PARAM/GRAD routes from "
                f"{', '.join(map(route_name, ROUTES))}, or auto"
            )
        routes.append((param, grad))
    return tuple(dict.fromkeys(routes))


def _world(args: argparse.Namespace, device: str) -> int:
    """N of ``--gpus N``/``--ranks N``, checked against the device and the visible GPUs."""
    if args.gpus is not None and args.ranks is not None:
        raise ConfigError("--gpus and --ranks: give one (GPUs, or CPU processes with --device cpu)")
    flag = "--gpus" if args.gpus is not None else "--ranks"
    world = int(args.gpus if args.gpus is not None else args.ranks)
    if world < 2:
        raise ConfigError(f"{flag} {world}: needs 2 or more (leave it out for one GPU)")
    if flag == "--ranks" and device != "cpu":
        raise ConfigError("--ranks runs CPU processes: add --device cpu (or use --gpus N)")
    if flag == "--gpus" and device != "cuda":
        raise ConfigError("--gpus needs CUDA: on CPU use --ranks N --device cpu")
    visible = torch.cuda.device_count() if flag == "--gpus" else world
    if visible < world:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if mask is None else f" (CUDA_VISIBLE_DEVICES={mask})"
        raise ConfigError(
            f"--gpus {world} but {visible} CUDA device(s) are visible{shown}: "
            f"use --gpus {visible} or more visible GPUs"
        )
    return world


def parse_scale(
    args: argparse.Namespace, systems: list[str], device: str, ours: dict[str, Any]
) -> Scale | None:
    """The ``--gpus``/``--ranks``/``--routes`` part of the command, or one ``ConfigError``
    line; None without ``--gpus``/``--ranks`` (the single-GPU bench, unchanged)."""
    if args.gpus is None and args.ranks is None:
        flags = {
            "--routes": args.routes is not None,
            "--scaled-first": args.scaled_first,
            "--no-collectives": args.no_collectives,
        }
        named = [flag for flag, on in flags.items() if on]
        if named:
            raise ConfigError(f"{named[0]} needs --gpus N (or --ranks N --device cpu)")
        return None
    world = _world(args, device)
    if not any(scales(name) for name in systems):
        raise ConfigError(
            f"--systems {','.join(systems)}: the runs on {world} ranks need ours, fsdp2 or a "
            f"peer that runs on several GPUs ({', '.join(p for p in PEERS if PEERS[p].scales)})"
        )
    routes = _routes(args.routes, ours["runtime"])
    # the bench sets the global batch (world x batch): only the routes' own rules can fail here
    train = dataclasses.replace(TrainSection(**ours["train"]), global_batch_size=world)
    for route in routes:
        given = _route_runtime(ours["runtime"], route)
        runtime = RuntimeSection.from_keys(**given)
        try:
            if route == AUTO_ROUTE:
                check_auto_free(runtime)
            check_config(world, runtime, train)
        except ConfigError as e:
            raise ConfigError(
                f"route {route_name(route)}: {e} (with --set section.key=value)"
            ) from None
    config_route = (ours["runtime"]["param_route"], ours["runtime"]["grad_route"])
    main_route = config_route if config_route in routes else routes[0]
    return Scale(world, routes, main_route, args.scaled_first, not args.no_collectives)


def _route_runtime(runtime: dict[str, Any], route: Route) -> dict[str, Any]:
    """Ours' runtime keys on ``route``: the route set, or for ``AUTO_ROUTE`` the config's
    routes left to ``runtime.policy: auto``."""
    if route == AUTO_ROUTE:
        return {**runtime, "policy": AUTO}
    return {**runtime, "param_route": route[0], "grad_route": route[1]}


def scaled_specs(
    single: RunSpec, systems: list[str], scale: Scale, at_batch: Sequence[RunSpec] = ()
) -> list[RunSpec]:
    """The runs of ``scale.world`` ranks at ``single``'s batch: ours per route, then fsdp2, then
    each peer's run of ``at_batch`` (its one-GPU run: its variant, overrides and timeout) that
    scales."""
    specs = []
    if "ours" in systems:
        for route in scale.routes:
            runtime = _route_runtime(single.ours["runtime"], route)
            ours = {**single.ours, "runtime": {**runtime, "context_parallel": scale.context}}
            specs.append(dataclasses.replace(single, system="ours", world=scale.world, ours=ours,
                                             auto_routes=route == AUTO_ROUTE,
                                             context=scale.context))  # fmt: skip
    if "fsdp2" in systems:
        specs.append(dataclasses.replace(single, system="fsdp2", world=scale.world))
    for run in at_batch:
        if run.system in PEERS and scales(run.system):
            specs.append(dataclasses.replace(run, world=scale.world))
    return specs


def collectives_spec(single: RunSpec, scale: Scale, config: Any) -> RunSpec:
    """The collectives' run on ``scale.world`` ranks for the model of ``config``, at the size
    of its largest decoder layer."""

    return dataclasses.replace(
        single,
        system="collectives",
        batch=0,
        world=scale.world,
        layer_numel=layer_numel(HFAdapter(config)),
    )


def run_keys(spec: RunSpec) -> dict[str, Any]:
    """What a run of the report needs besides the worker's result: its ranks and route."""
    route = None
    if spec.system == "ours" and spec.world > 1:
        runtime = spec.ours["runtime"]
        chosen = AUTO_ROUTE if spec.auto_routes else (runtime["param_route"], runtime["grad_route"])
        route = route_name(chosen)
    return {"world": spec.world, "route": route}
