"""A resumed ``runtime.policy: auto`` run on several ranks keeps its checkpoint's GPU-resident
groups where its gradient route is gpu (each rank owns its groups' state) and runs them on the
host where the route is cpu, which refuses them."""

from __future__ import annotations

from pathlib import Path

from autopolicy.test_route_choice import _cfg
from slidedp.autopolicy.kept import Kept, kept_line
from slidedp.plan.predict import ROUTES


def test_a_resumed_run_on_two_gpus_keeps_its_resident_groups_on_the_gpu_route(
    tmp_path: Path,
) -> None:
    for route in ROUTES:
        kept = Kept("28xN-r0", 20, route, resident_embeddings=True)
        cfg, line = kept_line(_cfg(tmp_path), kept, list(ROUTES), tmp_path / "checkpoint-4")
        layout = cfg.runtime.layout
        assert (layout.param_route, layout.grad_route) == route
        on_gpu = route[1] == "gpu"
        assert (layout.resident_layers, layout.resident_embeddings) == (
            (20, True) if on_gpu else (0, False)
        )
        shown = "20 GPU-resident + embeddings" if on_gpu else "0 GPU-resident"
        assert line == (f"policy   auto: 28xN-r0, {shown}, routes {route[0]}/{route[1]} "
                        "(kept from checkpoint-4)")  # fmt: skip
