"""The host store's resolved layout at the JSON seam: frozen records mirroring the serde
structs of ``slidedp_core::store::layout`` field for field (``StoreLayout`` and its
``GroupLayout``, ``ParamLayout``, ``RegionOffsets``), read once where the store or its plan
crosses from Rust (``HostStore.layout``, ``HostStore.plan``).

Example::

    layout = HostStore.plan(adapter.group_specs(), staging_slots=2)
    print(layout.regions.total_bytes, [p.name for p in layout.group_params(1)])

Invariant: ``from_json`` takes exactly the fields Rust writes (an unknown or missing one is a
``TypeError``); ``tests/test_store_layout.py`` compares them with a layout Rust resolved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Dtype = Literal["bf16", "f32"]


@dataclass(frozen=True, kw_only=True)
class IndexRange:
    """``std::ops::Range<usize>``: ``[start, end)``."""

    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """A parameter's resolved place: element offsets into the master weights, each Adam moment
    array (None: frozen, no moments) and a BF16 staging slot (from the slot's start)."""

    name: str
    group: int
    shape: tuple[int, ...]
    dtype: Dtype
    numel: int
    frozen: bool
    state_offset: int
    moment_offset: int | None
    slot_offset: int


@dataclass(frozen=True, kw_only=True)
class GroupLayout:
    """A group's resolved place: ``params`` indexes ``StoreLayout.params``; its master range
    (padding included), its trained parameters' part (gradient and moments, at
    ``moment_offset``), its staging-slot elements and its offset in the BF16 mirror."""

    name: str
    params: IndexRange
    state_offset: int
    state_len: int
    trained_len: int
    moment_offset: int
    slot_len: int
    mirror_offset: int


@dataclass(frozen=True, kw_only=True)
class RegionOffsets:
    """Byte offsets of the regions inside the shared mapping, and its size."""

    versions: int
    master: int
    exp_avg: int
    exp_avg_sq: int
    grad: int
    staging: int
    mirror: int
    total_bytes: int


@dataclass(frozen=True, kw_only=True)
class StoreLayout:
    """The store's layout (``slidedp_core::store::layout::StoreLayout``): element counts of the
    master and moment arrays, of a slot (the chunk) and of the mirror (0: none)."""

    groups: tuple[GroupLayout, ...]
    params: tuple[ParamLayout, ...]
    state_len: int
    moment_len: int
    slot_len: int
    staging_slots: int
    grad_slots: int
    grad_dtype: Dtype | None
    mirror_len: int
    regions: RegionOffsets

    def group_params(self, group: int | GroupLayout) -> tuple[ParamLayout, ...]:
        """The parameters of ``group`` (its index, or itself), in layout order."""
        g = self.groups[group] if isinstance(group, int) else group
        return self.params[g.params.start : g.params.end]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StoreLayout:
        groups = tuple(
            GroupLayout(**(g | {"params": IndexRange(**g["params"])})) for g in d["groups"]
        )
        params = tuple(ParamLayout(**(p | {"shape": tuple(p["shape"])})) for p in d["params"])
        rest = {k: v for k, v in d.items() if k not in ("groups", "params", "regions")}
        return cls(groups=groups, params=params, regions=RegionOffsets(**d["regions"]), **rest)
