"""The layout solver's integer program at the JSON seam: frozen records mirroring the serde
structs of ``slidedp_core::solve`` field for field (``Candidate``, ``Kind``, ``HostLane``,
``Resident``, ``Problem`` in; ``Layout`` out), and ``solve``, the one call that crosses it
(``_native.solve_layout``).

Example::

    layout = solve(Problem(layers=36, budget_bytes=40 * 2**30, candidates=(...,)))
    print(layout.counts, layout.step_s)

Invariant: ``to_json`` writes every field the Rust struct reads and nothing else (the structs
refuse unknown fields); ``_native.solve_problem_echo`` reads a problem back as Rust holds it,
which ``tests/autopolicy/test_program.py`` compares with these records.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slidedp import _native


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One activation candidate of a decoder layer, as the layer profiler measured it."""

    name: str
    time_s: float  # its forward + backward (replay included) in the engine
    forward_s: float = 0.0  # its forward alone
    retained_bytes: float  # device bytes kept from its forward to its backward
    offloaded_bytes: float = 0.0  # bytes moved to host memory and back
    transient_bytes: float = 0.0  # the largest transient of its backward
    kind: int = 0  # its kind of layer: an index into ``Problem.kinds``


@dataclass(frozen=True, kw_only=True)
class Kind:
    """A kind of decoder layer: how many layers are of it, their host update each (None: the
    host lane's ``update_s_per_layer``)."""

    name: str
    layers: int
    update_s_per_layer: float | None = None


@dataclass(frozen=True, kw_only=True)
class HostLane:
    """The host update lane per streamed layer; ``serial``: it follows the backward
    (clipping); ``tail_s``: the embedding's and head's update after the backward."""

    update_s_per_layer: float
    serial: bool
    tail_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Resident:
    """GPU-resident layers: device bytes each, how many may be, their device update each."""

    bytes_per_layer: float
    max_layers: int
    update_s_per_layer: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Problem:
    """The integer program (``slidedp_core::solve::Problem``; its module docs say the rows)."""

    layers: int
    budget_bytes: float  # device bytes for activations and resident layers
    candidates: tuple[Candidate, ...]
    fixed_s: float = 0.0  # step time outside the layers' compute
    parked_bytes: float = 0.0  # a clipped step's parked gradients, beside the transient
    host: HostLane | None = None
    resident: Resident | None = None
    kinds: tuple[Kind, ...] = ()  # empty: one kind, every layer
    host_budget_bytes: float | None = None  # offloaded activations' host bytes; None: unbounded

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Problem:
        host, resident = d["host"], d["resident"]
        return cls(
            layers=d["layers"],
            budget_bytes=d["budget_bytes"],
            candidates=tuple(Candidate(**c) for c in d["candidates"]),
            fixed_s=d["fixed_s"],
            parked_bytes=d["parked_bytes"],
            host=None if host is None else HostLane(**host),
            resident=None if resident is None else Resident(**resident),
            kinds=tuple(Kind(**k) for k in d["kinds"]),
            host_budget_bytes=d["host_budget_bytes"],
        )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The program's solution (``slidedp_core::solve::Layout``)."""

    counts: tuple[int, ...]  # layers per candidate, in the problem's order
    resident_layers: int
    step_s: float
    compute_s: float
    host_s: float
    memory_bytes: float
    offloaded_bytes: float  # host bytes of the offloaded activations

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Layout:
        return cls(**(dict(d) | {"counts": tuple(d["counts"])}))


def solve(problem: Problem) -> Layout:
    """The fastest layout of ``problem`` within its budget; none fits: ``InvalidArgumentError``."""
    return Layout.from_json(json.loads(_native.solve_layout(json.dumps(problem.to_json()))))
