"""What a resumed ``runtime.policy: auto`` run keeps: the layout, GPU-resident layers, chunk and
routes its checkpoint ran with (``trainer_state.json``'s policy), instead of choosing again.

Example::

    kept = kept_policy(checkpoint, layers=28, whole_layer=layer_chunk_elems(adapter))
    cfg, line = kept_line(cfg, kept, candidates, checkpoint)   # None above: choose afresh
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidedp.errors import ConfigError
from slidedp.io.checkpoint import STATE_FILE
from slidedp.plan.layout import parse_layout
from slidedp.plan.policy import resident_text
from slidedp.plan.predict import ROUTES, Route, route_name

if TYPE_CHECKING:
    from slidedp.config import TrainConfig


@dataclass(frozen=True)
class Kept:
    """What a resumed run's checkpoint ran with (``trainer_state.json``'s policy)."""

    layers: str
    resident_layers: int
    route: Route  # (param_route, grad_route)
    resident_embeddings: bool = False
    chunk_elems: int = 0  # and the gradient ring cut to it (0: the whole layer)
    grad_slots: int = 0


def kept_policy(resume: Path | None, layers: int, whole_layer: int) -> Kept | None:
    """The layout, GPU-resident layer count, chunk and routes a resumed run's checkpoint ran
    with (``trainer_state.json``), if it has them for this model (``whole_layer``: the chunk of
    one layer, which the checkpoint records for a config's 0)."""
    if resume is None:
        return None
    try:
        policy = json.loads((resume / STATE_FILE).read_text())["policy"]
        layout, resident = str(policy["layers"]), int(policy.get("resident_layers", 0))
        route = (str(policy["param_route"]), str(policy["grad_route"]))
        fits = len(parse_layout(layout, layers, 0.0)) == layers and 0 <= resident <= layers
        embeddings = policy.get("resident_embeddings", False)
        chunk, slots = int(policy.get("chunk_elems", 0)), int(policy.get("grad_slots", 0))
        chunk = 0 if chunk == whole_layer else chunk
        if not fits or route not in ROUTES or not isinstance(embeddings, bool) or chunk < 0:
            return None
        return Kept(layout, resident, route, embeddings, chunk, slots)
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None


def _with(cfg: TrainConfig, **runtime: Any) -> TrainConfig:
    return dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(**runtime))


def kept_line(
    cfg: TrainConfig, kept: Kept, candidates: list[Route], resume: Path
) -> tuple[TrainConfig, str]:
    """The resumed run keeps its checkpoint's layout and, where auto chooses them, routes; on
    several ranks its GPU-resident groups where the gradient route is gpu (the cpu route
    refuses them)."""
    rt = cfg.runtime
    route = (rt.layout.param_route, rt.layout.grad_route)
    if rt.launch.world > 1 and kept.route in candidates:
        route = kept.route
    keeps = rt.launch.world == 1 or route[1] == "gpu"
    resident = kept.resident_layers if keeps else 0
    embeddings = kept.resident_embeddings and keeps
    cfg = _with(cfg, layers=kept.layers, resident_layers=resident, resident_embeddings=embeddings)
    chunk = ""
    if kept.chunk_elems and not rt.layout.chunk_elems and kept.grad_slots > 0:
        cfg = _with(cfg, chunk_elems=kept.chunk_elems, grad_slots=kept.grad_slots)
        chunk = f", chunk {kept.chunk_elems:,} elements"
    routes = ""
    if rt.launch.world > 1:
        cfg = _with(cfg, param_route=route[0], grad_route=route[1])
        routes = f", routes {route_name(route)}"
    line = (
        f"policy   auto: {kept.layers}, {resident_text(resident, embeddings)}{chunk}{routes} "
        f"(kept from {resume.name})"
    )
    return cfg, line
