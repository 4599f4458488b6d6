"""The layout solver's JSON seam (``autopolicy.program``): the Python records carry exactly the
fields of the Rust serde structs (``slidedp_core::solve``), with the same defaults, and survive
a round trip through the native solver; a misnamed field is refused, not defaulted."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from slidedp import _native
from slidedp.autopolicy.program import (
    Candidate,
    HostLane,
    Kind,
    Layout,
    Problem,
    Resident,
    solve,
)
from slidedp.errors import InvalidArgumentError

GIB = 2**30


def _names(record: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(record)}


def _every_field() -> Problem:
    """A problem with every field away from its default, two kinds of two layers each."""
    return Problem(
        layers=4,
        budget_bytes=8.0 * GIB,
        candidates=(
            Candidate(
                name="a: F",
                time_s=0.03,
                forward_s=0.01,
                retained_bytes=1e8,
                offloaded_bytes=2e7,
                transient_bytes=3e7,
                kind=0,
            ),
            Candidate(
                name="b: F",
                time_s=0.04,
                forward_s=0.02,
                retained_bytes=2e8,
                offloaded_bytes=1e7,
                transient_bytes=4e7,
                kind=1,
            ),
        ),
        fixed_s=0.05,
        parked_bytes=1e6,
        host=HostLane(update_s_per_layer=0.02, serial=True, tail_s=0.07),
        resident=Resident(bytes_per_layer=5e8, max_layers=4, update_s_per_layer=0.001),
        kinds=(
            Kind(name="a", layers=2, update_s_per_layer=0.01),
            Kind(name="b", layers=2, update_s_per_layer=0.03),
        ),
        host_budget_bytes=4.0 * GIB,
    )


def _echo(problem: Problem) -> dict[str, Any]:
    echoed: dict[str, Any] = json.loads(_native.solve_problem_echo(json.dumps(problem.to_json())))
    return echoed


def test_the_records_have_the_rust_structs_fields() -> None:
    problem = _every_field()
    echoed = _echo(problem)
    assert set(echoed) == _names(Problem)
    assert {n for c in echoed["candidates"] for n in c} == _names(Candidate)
    assert {n for k in echoed["kinds"] for n in k} == _names(Kind)
    assert set(echoed["host"]) == _names(HostLane)
    assert set(echoed["resident"]) == _names(Resident)
    assert Problem.from_json(echoed) == problem


def test_the_defaults_are_the_rust_structs_defaults() -> None:
    least = Problem(
        layers=2,
        budget_bytes=1.0 * GIB,
        candidates=(Candidate(name="F", time_s=0.03, retained_bytes=1e8),),
        host=HostLane(update_s_per_layer=0.02, serial=False),
        resident=Resident(bytes_per_layer=5e8, max_layers=2),
        kinds=(Kind(name="all", layers=2),),
    )
    sparse = {k: v for k, v in least.to_json().items() if v is not None and v != ()}
    sparse["candidates"] = [{"name": "F", "time_s": 0.03, "retained_bytes": 1e8}]
    sparse["host"] = {"update_s_per_layer": 0.02, "serial": False}
    sparse["resident"] = {"bytes_per_layer": 5e8, "max_layers": 2}
    sparse["kinds"] = [{"name": "all", "layers": 2}]
    del sparse["fixed_s"], sparse["parked_bytes"]
    echoed = json.loads(_native.solve_problem_echo(json.dumps(sparse)))
    assert Problem.from_json(echoed) == least


@pytest.mark.parametrize(
    ("where", "name"),
    [((), "fixed_s"), (("host",), "tail_s"), (("resident",), "max_layers"),
     (("candidates", 1), "offloaded_bytes"), (("kinds", 0), "update_s_per_layer")],
)  # fmt: skip
def test_a_misnamed_field_is_refused_not_defaulted(where: tuple[str | int, ...], name: str) -> None:
    sent = _every_field().to_json()
    part: Any = sent
    for key in where:
        part = part[key]
    part[name + "_renamed"] = part.pop(name)
    with pytest.raises(InvalidArgumentError, match=f"unknown field `{name}_renamed`"):
        _native.solve_layout(json.dumps(sent))


def test_a_solved_layout_has_the_rust_layouts_fields() -> None:
    problem = _every_field()
    raw = json.loads(_native.solve_layout(json.dumps(problem.to_json())))
    assert set(raw) == _names(Layout)
    layout = solve(problem)
    assert layout == Layout.from_json(raw)
    assert sum(layout.counts) == problem.layers
    assert layout.memory_bytes <= problem.budget_bytes
