"""The host state store seen from Python: torch tensors over the shared mapping, zero-copy.

One process creates the store (``HostStore.create``), others attach by its name
(``HostStore.attach``). Every tensor returned here is a view of the mapping itself: its
``data_ptr()`` lies inside ``[store.address, store.address + store.total_bytes)``, writes are
seen by every attached process, and the mapping stays alive while any view does.

Example::

    store = HostStore.create([GroupSpec("layers.0", [ParamSpec("w", (4, 8))])], staging_slots=2)
    store.master("w").normal_()          # writes the shared FP32 master weights
    store.publish(0, 1)                  # another process: store.wait_version(0, 1, timeout_s=5)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from slidedp import _native
from slidedp.errors import UnknownParameterError
from slidedp.store_layout import Dtype, StoreLayout

StateRegion = Literal["master", "exp_avg", "exp_avg_sq"]
_TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


@dataclass(frozen=True)
class ParamSpec:
    """One named tensor; ``dtype`` is the dtype it is delivered to the GPU in; a ``frozen`` one
    is never updated (no Adam moments, no gradient slot traffic)."""

    name: str
    shape: tuple[int, ...]
    dtype: Literal["bf16", "f32"] = "bf16"
    frozen: bool = False


@dataclass(frozen=True)
class GroupSpec:
    """Parameters that are updated and versioned together (one decoder layer, say)."""

    name: str
    params: Sequence[ParamSpec] = field(default_factory=tuple)

    @property
    def numel(self) -> int:
        """Elements of all its parameters."""
        return sum(math.prod(p.shape) for p in self.params)


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """What the store is asked to hold (``slidedp_core::store::layout::StoreSpec``): the
    groups, ``staging_slots`` and ``grad_slots`` (in ``grad_dtype``) of ``chunk_elems``
    elements each (None: the largest group whole), and whether a BF16 mirror."""

    groups: Sequence[GroupSpec]
    staging_slots: int
    chunk_elems: int | None = None
    grad_slots: int = 0
    grad_dtype: Dtype | None = None
    bf16_mirror: bool = False

    def to_json(self) -> dict[str, Any]:
        groups = [{"name": g.name, "params": [asdict(p) for p in g.params]} for g in self.groups]
        return asdict(self) | {"groups": groups}


class _MappedMemory:
    """Presents ``nbytes`` at ``address`` to numpy while holding ``owner`` (the mapping) alive."""

    def __init__(self, owner: object, address: int, nbytes: int) -> None:
        self._owner = owner
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def _bytes_view(owner: object, address: int, nbytes: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(_MappedMemory(owner, address, nbytes)))


class HostStore:
    """FP32 master weights, Adam moments (of the trained parameters only), BF16 staging slots,
    gradient slots and (optionally) a BF16 mirror of every parameter in one shared mapping.
    Slots hold one transfer chunk (``layout.slot_len`` elements) each. Inside a group the
    trained parameters come first: its first ``trained_len`` state elements, the range of its
    gradient and of its moments (at ``moment_offset``)."""

    def __init__(self, native: _native.HostStore) -> None:
        self._native = native
        self.layout = StoreLayout.from_json(json.loads(native.layout_json()))
        self._params = {p.name: p for p in self.layout.params}
        self._regions: dict[str, torch.Tensor] = {}
        grad_dtype = _TORCH_DTYPES[self.layout.grad_dtype or "f32"]
        dtypes = {"staging": torch.bfloat16, "mirror": torch.bfloat16, "grad": grad_dtype}
        for region in ("master", "exp_avg", "exp_avg_sq", "grad", "staging", "mirror"):
            address, nbytes = native.region(region)
            view = _bytes_view(native, address, nbytes)
            self._regions[region] = view.view(dtypes.get(region, torch.float32))

    @classmethod
    def create(
        cls,
        groups: Sequence[GroupSpec],
        staging_slots: int,
        shm_dir: str = "/dev/shm",
        grad_dtype: Literal["bf16", "f32"] | None = None,
        grad_slots: int = 0,
        chunk_elems: int | None = None,
        bf16_mirror: bool = False,
        parts: int | None = None,
    ) -> HostStore:
        """A new zero-filled store with ``grad_slots`` gradient slots in ``grad_dtype``; slots
        hold ``chunk_elems`` elements (None: the largest group whole); ``bf16_mirror``: a BF16
        copy of every parameter, written by the update worker (``mirror_group``). The memory is
        ``parts`` files zero-filled in parallel (None: one per core, each at least 1 GiB)."""
        spec = StoreSpec(
            groups=groups,
            staging_slots=staging_slots,
            chunk_elems=chunk_elems,
            grad_slots=grad_slots,
            grad_dtype=grad_dtype,
            bf16_mirror=bf16_mirror,
        )
        return cls(_native.HostStore.create(json.dumps(spec.to_json()), shm_dir, parts))

    @classmethod
    def plan(
        cls,
        groups: Sequence[GroupSpec],
        staging_slots: int,
        grad_dtype: Literal["bf16", "f32"] | None = None,
        grad_slots: int = 0,
        chunk_elems: int | None = None,
        bf16_mirror: bool = False,
    ) -> StoreLayout:
        """The layout ``create`` would give these arguments (``regions.total_bytes`` is the
        store's exact size), computed without allocating anything."""
        spec = StoreSpec(
            groups=groups,
            staging_slots=staging_slots,
            chunk_elems=chunk_elems,
            grad_slots=grad_slots,
            grad_dtype=grad_dtype,
            bf16_mirror=bf16_mirror,
        )
        return StoreLayout.from_json(json.loads(_native.store_layout(json.dumps(spec.to_json()))))

    @classmethod
    def attach(cls, name: str) -> HostStore:
        return cls(_native.HostStore.attach(name))

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def address(self) -> int:
        return self._native.address

    @property
    def total_bytes(self) -> int:
        return self._native.total_bytes

    @property
    def num_groups(self) -> int:
        return len(self.layout.groups)

    def region(self, region: StateRegion | Literal["staging", "grad", "mirror"]) -> torch.Tensor:
        """A whole region as a flat tensor: float32, bfloat16 for "staging" and "mirror" (empty
        without one), ``grad_dtype`` for "grad" (all gradient slots; empty when none)."""
        return self._regions[region]

    def param(self, name: str, region: StateRegion = "master") -> torch.Tensor:
        """One parameter's FP32 state, shaped (a frozen parameter has master weights only)."""
        try:
            p = self._params[name]
        except KeyError:
            raise UnknownParameterError(f"parameter '{name}' is not in the store layout") from None
        at = p.state_offset if region == "master" else p.moment_offset
        if at is None:
            raise UnknownParameterError(f"parameter '{name}' is frozen: it has no {region}")
        return self._regions[region][at : at + p.numel].view(p.shape)

    def frozen(self, name: str) -> bool:
        """Whether parameter ``name`` is frozen (never updated, no moments)."""
        return self._params[name].frozen

    def master(self, name: str) -> torch.Tensor:
        return self.param(name, "master")

    def group_state(self, group: int, region: StateRegion) -> torch.Tensor:
        """A group's contiguous range of one state region, padding included (padding stays 0):
        its master weights (``state_len``), or its trained parameters' moments
        (``trained_len``)."""
        g = self.layout.groups[group]
        if region == "master":
            return self._regions[region][g.state_offset : g.state_offset + g.state_len]
        return self._regions[region][g.moment_offset : g.moment_offset + g.trained_len]

    @property
    def has_mirror(self) -> bool:
        return self.layout.mirror_len > 0

    def mirror_group(self, group: int) -> torch.Tensor:
        """A group's BF16 mirror: its slot layout (params at ``slot_offset``, padding zero)."""
        assert self.has_mirror, "the store was created without a BF16 mirror"
        g = self.layout.groups[group]
        return self._regions["mirror"][g.mirror_offset : g.mirror_offset + g.slot_len]

    def staging_slot(self, slot: int) -> torch.Tensor:
        """One BF16 staging slot (``slot_len`` elements): a chunk of a group's slot layout."""
        return self._slot("staging", slot, self.layout.staging_slots)

    def grad_slot(self, slot: int) -> torch.Tensor:
        """One gradient slot (``slot_len`` elements of ``grad_dtype``): a chunk of a group's
        state layout, read by the update worker."""
        return self._slot("grad", slot, self.layout.grad_slots)

    def _slot(self, region: str, slot: int, count: int) -> torch.Tensor:
        n = self.layout.slot_len
        if not 0 <= slot < count:
            raise IndexError(f"{region} slot {slot} of {count}")
        return self._regions[region][slot * n : (slot + 1) * n]

    def publish(self, layer: int, version: int) -> None:
        self._native.publish(layer, version)

    def wait_version(self, layer: int, version: int, timeout_s: float) -> int:
        return self._native.wait_version(layer, version, timeout_s)

    def version(self, layer: int) -> int:
        return self._native.version(layer)

    def poison(self, claim: bool = True) -> bool:
        """Declares the store failed (every waiter in every process wakes with
        ``StorePoisonedError``). With ``claim`` (this process's own failure, not a reaction to
        a peer's): whether it is the store's first claimed failure, in any process."""
        return self._native.poison(claim)
