"""The host store's JSON seam (``store.StoreSpec`` in, ``store_layout.StoreLayout`` out): the
Python records carry exactly the fields of the Rust serde structs
(``slidedp_core::store::layout``), with the same defaults, and survive a round trip through the
native store; a misnamed field is refused, not defaulted."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from slidedp import _native
from slidedp.errors import InvalidLayoutError
from slidedp.store import GroupSpec, HostStore, ParamSpec, StoreSpec
from slidedp.store_layout import GroupLayout, IndexRange, ParamLayout, RegionOffsets, StoreLayout


def _names(record: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(record)}


def _groups() -> list[GroupSpec]:
    """Two groups: a frozen parameter beside trained ones, both delivery dtypes."""
    return [
        GroupSpec("embed", [ParamSpec("embed.w", (100, 8))]),
        GroupSpec("layers.0", [ParamSpec("layers.0.w", (8, 8)),
                               ParamSpec("layers.0.norm", (8,), "f32", frozen=True)]),
    ]  # fmt: skip


def _every_field() -> StoreSpec:
    return StoreSpec(groups=_groups(), staging_slots=2, chunk_elems=64, grad_slots=3,
                     grad_dtype="bf16", bf16_mirror=True)  # fmt: skip


def _echo(spec: dict[str, Any]) -> dict[str, Any]:
    echoed: dict[str, Any] = json.loads(_native.store_spec_echo(json.dumps(spec)))
    return echoed


def test_the_spec_has_the_rust_structs_fields_and_defaults() -> None:
    spec = _every_field()
    echoed = _echo(spec.to_json())
    assert set(echoed) == _names(StoreSpec)
    assert {n for g in echoed["groups"] for n in g} == _names(GroupSpec)
    assert {n for g in echoed["groups"] for p in g["params"] for n in p} == _names(ParamSpec)
    assert echoed == json.loads(json.dumps(spec.to_json()))
    # what Rust fills in for the fields left out is what the Python records default to
    least = StoreSpec(groups=[GroupSpec("g", [ParamSpec("w", (4,))])], staging_slots=1)
    sparse = {"groups": [{"name": "g", "params": [{"name": "w", "shape": [4], "dtype": "bf16"}]}],
              "staging_slots": 1}  # fmt: skip
    assert _echo(sparse) == json.loads(json.dumps(least.to_json()))


@pytest.mark.parametrize("path", [("bf16_mirror",), ("groups", 0, "name"),
                                  ("groups", 1, "params", 1, "frozen")])  # fmt: skip
def test_a_misnamed_field_is_refused_not_defaulted(path: tuple[str | int, ...]) -> None:
    sent = _every_field().to_json()
    part: Any = sent
    for key in path[:-1]:
        part = part[key]
    part[f"{path[-1]}_renamed"] = part.pop(path[-1])
    with pytest.raises(InvalidLayoutError, match=f"unknown field `{path[-1]}_renamed`"):
        _native.store_layout(json.dumps(sent))


def test_the_layout_has_the_rust_structs_fields() -> None:
    spec = _every_field()
    raw = json.loads(_native.store_layout(json.dumps(spec.to_json())))
    assert set(raw) == _names(StoreLayout)
    assert set(raw["regions"]) == _names(RegionOffsets)
    assert {n for g in raw["groups"] for n in g} == _names(GroupLayout)
    assert {n for g in raw["groups"] for n in g["params"]} == _names(IndexRange)
    assert {n for p in raw["params"] for n in p} == _names(ParamLayout)
    layout = HostStore.plan(_groups(), 2, "bf16", 3, 64, bf16_mirror=True)
    assert layout == StoreLayout.from_json(raw)
    assert json.loads(json.dumps(layout.to_json())) == raw
    # the frozen parameter has no moments; a group's parameters are its range of them
    assert [p.name for p in layout.group_params(1)] == ["layers.0.w", "layers.0.norm"]
    assert [p.moment_offset is None for p in layout.params] == [False, False, True]
