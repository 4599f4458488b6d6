"""The policy selector's layout stage (paper §3.6, Algorithm 1): from the layer profile's
Pareto candidates and the GPU budget, the integer program (``slidedp_core::solve``, through
``_native.solve_layout``) picks how many layers get each candidate, ``plan.layout.place``
orders them, and the step-time model and the memory estimate check the result against the
fixed default (all ``F``), which is always a candidate.

Example::

    report = profile_layer(args)                   # measured or cached
    choice = select_layout(cfg, adapter, machine, report)
    print(choice.layout, choice.solution["step_s"])
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from slidedp import _native
from slidedp.errors import ConfigError
from slidedp.plan.cost import resident_bytes_per_layer
from slidedp.plan.device import pick_dtype
from slidedp.plan.layout import LayerPolicy, format_layout, parse_entry, place
from slidedp.plan.timing import ADAMW_BYTES_PER_PARAM
from slidedp.profile.pareto import layer_time, memory

if TYPE_CHECKING:
    from slidedp.config import TrainConfig
    from slidedp.estimate import Machine
    from slidedp.models.hf import HFAdapter

# measured on the H100 (BENCHMARKS.md, issue #14): a clipped layout keeping 55 GiB of
# activations reserved 6% more than the estimate (the allocator does not reuse every block
# freed by the parked gradients); the budget keeps that share free
HEADROOM = 0.06
DEFAULT = LayerPolicy("F")
# a layout leaves the default only when predicted this much faster: on the H100 (BENCHMARKS.md,
# issue #16) predicted gains of 9% and 20% measured 0.99x and 0.97x where the host update bound
# the step, and a layout spends GPU memory the default leaves free
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Choice:
    layout: str  # runtime.layers' text form, placed
    layers: tuple[LayerPolicy, ...]
    budget_bytes: int  # device bytes the layout's activations may use
    problem: dict[str, Any]  # the integer program, as solved
    solution: dict[str, Any]  # slidedp_core::solve::Layout
    default: dict[str, Any]  # the fixed default's accounting in the same program, and "fits"
    program_layout: str = ""  # the program's own layout, placed, and its resident layers
    resident_layers: int = 0  # runtime.resident_layers: the first ones stay on the GPU
    kept_default: bool = False  # the program's layout was not MIN_GAIN faster: all F instead

    @property
    def gain(self) -> float:
        """The program's layout's predicted speed over the default's."""
        return float(self.default["step_s"] / self.solution["step_s"])


def profile_candidates(report: dict[str, Any]) -> list[tuple[LayerPolicy, dict[str, Any]]]:
    """The Pareto-efficient candidates of a ``slidedp profile layer`` report, plus ``F-r0``
    (the fixed default), as the program's ``Candidate`` records."""
    out: dict[LayerPolicy, dict[str, Any]] = {}
    for c in report["candidates"]:
        _, policy = parse_entry(c["policy"], 0.0)
        if not (c["pareto"] or policy == DEFAULT):
            continue
        # the larger of the measured and the cost model's bytes: the estimate that checks
        # the run counts the cost model's, the device holds the measured ones
        transient = max(c["transient_bytes"] or 0, c["estimated_transient_bytes"])
        out[policy] = {
            "name": str(policy),
            "time_s": layer_time(c),
            "forward_s": max(float(c["forward_s"]), float(c["reload_s"])),
            "retained_bytes": float(max(memory(c), c["estimated_retained_bytes"])),
            "offloaded_bytes": float(max(c["offloaded_bytes"], c["estimated_offloaded_bytes"])),
            "transient_bytes": float(transient),
        }
    if DEFAULT not in out:
        raise ConfigError("the layer profile has no F-r0 row (the fixed default): re-profile")
    return list(out.items())


@dataclass(frozen=True)
class Budget:
    bytes: int  # device bytes for the activations (retained, prefetch pool, transient)
    parked_bytes: int  # the parked gradients of a clipped step, beside the transient


def activation_budget(
    cfg: TrainConfig, adapter: HFAdapter, machine: Machine, total_bytes: int
) -> Budget:
    """Device bytes left for activations: ``total_bytes`` less what no layout changes (the
    window, the chunked loss, the allocator's reserve, the CUDA context: ``estimate``'s terms
    for the same run), less ``HEADROOM``; and the parked gradients, which take the retained
    activations' place once the clipped backward has freed them."""
    from slidedp.estimate import estimate_run

    probe = replace(machine, device="cuda", gpu_total_bytes=total_bytes)
    runtime = replace(cfg.runtime, layers="F", offload_ratio=0.0, policy="", resident_layers=0)
    gpu = estimate_run(replace(cfg, runtime=runtime), adapter, probe, step_model=False).gpu
    assert gpu is not None
    fixed = gpu.needed_bytes - gpu.layer_bytes - max(gpu.checkpoint_bytes, gpu.parked_grad_bytes)
    if fixed >= total_bytes:
        raise ConfigError(
            f"the window, the loss and the CUDA context alone need {fixed / 2**30:.2f} GiB of "
            f"the GPU's {total_bytes / 2**30:.2f} GiB: no activation layout fits"
        )
    return Budget(int((total_bytes - fixed) * (1.0 - HEADROOM)), gpu.parked_grad_bytes)


def host_update_s_per_layer(adapter: HFAdapter, gbps: float) -> float:
    """A decoder layer's host AdamW pass at ``gbps`` (the kernel's measured bandwidth), the
    mean over the layers: the program counts it once per layer."""
    layers = range(adapter.num_layers)
    params = sum(p.numel() for i in layers for p in adapter.layer_module(i).parameters())
    return ADAMW_BYTES_PER_PARAM * params / adapter.num_layers / (gbps * 1e9)


def host_update_s_tail(adapter: HFAdapter, gbps: float) -> float:
    """The host AdamW pass of the embedding and head groups (never resident): their gradients
    come last in the backward, so this part of the update ends every step."""
    specs = adapter.group_specs()
    params = specs[adapter.embed_group].numel + specs[adapter.head_group].numel
    return ADAMW_BYTES_PER_PARAM * params / (gbps * 1e9)


def solve(problem: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(_native.solve_layout(json.dumps(problem)))
    return result


def select_layout(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    report: dict[str, Any],
    *,
    total_bytes: int,
    update_gbps: float,
    resident: bool = True,
    budget_cut_bytes: int = 0,
) -> Choice:
    """The fastest placed layout of the profile's candidates within ``total_bytes`` of device
    memory, the host update at ``update_gbps`` counted (after the backward with clipping), and
    with ``resident`` how many layers stay GPU-resident (their memory against the same budget,
    their update off the host lane). ``budget_cut_bytes``: taken off the activations' budget
    (``plan.validate``'s feedback: what a validated choice reserved beyond the device)."""
    cands = profile_candidates(report)
    budget = activation_budget(cfg, adapter, machine, total_bytes)
    if budget_cut_bytes:
        budget = replace(budget, bytes=max(0, budget.bytes - budget_cut_bytes))
    clipping = cfg.train.max_grad_norm > 0
    problem: dict[str, Any] = {
        "layers": adapter.num_layers,
        "budget_bytes": float(budget.bytes),
        "parked_bytes": float(budget.parked_bytes),
        "candidates": [c for _, c in cands],
        "host": {
            "update_s_per_layer": host_update_s_per_layer(adapter, update_gbps),
            "serial": clipping,
            "tail_s": host_update_s_tail(adapter, update_gbps),
        },
    }
    if resident:
        dtype = pick_dtype(cfg.train.dtype, torch.device("cuda"))
        problem["resident"] = {
            "bytes_per_layer": float(resident_bytes_per_layer(adapter, dtype, clipping=clipping)),
            "max_layers": adapter.num_layers,
        }
    solution = solve(problem)
    counts = [(p, int(n)) for (p, _), n in zip(cands, solution["counts"], strict=True) if n > 0]
    retained = {p: int(c["retained_bytes"]) for p, c in cands}
    layers = place(counts, retained)
    default_counts = [adapter.num_layers if p == DEFAULT else 0 for p, _ in cands]
    # the default's accounting in the same program, within its own bytes (it may not fit the
    # budget); a finite bound keeps the program well scaled
    f = dict(cands)[DEFAULT]
    own = adapter.num_layers * f["retained_bytes"] + 2 * f["offloaded_bytes"] + f["transient_bytes"]
    unbounded = {"budget_bytes": own + 2**30, "parked_bytes": 0.0}
    default = solve(problem | {"candidates": [f], "resident": None} | unbounded)
    default["counts"] = default_counts
    default["fits"] = default["memory_bytes"] <= budget.bytes
    layout = format_layout(layers)
    program = f"{layout}, {solution['resident_layers']} GPU-resident"
    choice = Choice(layout, layers, budget.bytes, problem, solution, default, program,
                    resident_layers=int(solution["resident_layers"]))  # fmt: skip
    all_f = (DEFAULT,) * adapter.num_layers
    if (
        (layers, choice.resident_layers) != (all_f, 0)
        and default["fits"]
        and (choice.gain < 1 + MIN_GAIN)
    ):
        return replace(choice, layout=format_layout(all_f), layers=all_f, resident_layers=0,
                       kept_default=True)  # fmt: skip
    return choice
