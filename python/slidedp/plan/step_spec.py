"""The step-time model at the JSON seam: frozen records mirroring the serde structs of
``slidedp_core::model`` field for field (``StepSpec`` in, ``Prediction`` out), and
``predict_step``, the one call that crosses it (``_native.predict_step``).

Example::

    spec = spec_from_trace(trace, slots=2, grad_slots=4)   # plan.timing
    print(predict_step(spec).step_s)

Invariant: ``to_json`` writes every field the Rust struct reads and nothing else (the struct
refuses unknown fields); ``_native.step_spec_echo`` reads a spec back as Rust holds it, which
``tests/model/test_step_spec.py`` compares with these records.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slidedp import _native


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """Service times of one step's operations, seconds; per group (``L + 2``: embedding,
    layers, head) or per decoder layer (``L``). ``slidedp_core::model::StepSpec`` documents
    each field; an empty optional list means none (no cast, offload, reduction, host sum,
    resident group, all-to-all; one update lane)."""

    forward_s: tuple[float, ...]  # per layer
    backward_s: tuple[float, ...]  # per layer, the replay included
    embed_forward_s: float
    head_s: float  # the loss forward and backward
    embed_backward_s: float
    load_s: tuple[float, ...]  # per group: into the window
    grad_copy_s: tuple[float, ...]  # per group: the gradient to the host
    update_s: tuple[float, ...]  # per group: its host AdamW
    cast_s: tuple[float, ...] = ()  # per group: the host's BF16 cast before a load
    offload_s: tuple[float, ...] = ()  # per layer: the activations' offload
    reload_s: tuple[float, ...] = ()  # per layer: and their copy back
    reduce_s: tuple[float, ...] = ()  # per group: the gradient's reduction across ranks
    reduce_blocks: bool = True  # the compute stream waits for each reduction
    host_sum_s: tuple[float, ...] = ()  # per group: the cpu route's sum of the ranks' copies
    resident: tuple[bool, ...] = ()  # per group: GPU-resident
    all_to_all_forward_s: tuple[float, ...] = ()  # per layer: context parallelism's exchanges
    all_to_all_backward_s: tuple[float, ...] = ()  # per layer: the backward's and replay's
    owners: tuple[int, ...] = ()  # per group: the rank whose update lane runs its AdamW
    slots: int
    grad_slots: int
    clipping: bool

    @property
    def layers(self) -> int:
        return len(self.forward_s)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StepSpec:
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The model's step (``slidedp_core::model::Prediction``): its period, each lane's work
    and the compute lane's idle time by the lane it waited for (by the lane's name,
    ``compute``, ``h2d``...), the critical path's operations, the regime."""

    step_s: float
    busy_s: dict[str, float]
    exposed_s: dict[str, float]
    critical_path: tuple[str, ...]
    regime: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Prediction:
        return cls(**(dict(d) | {"critical_path": tuple(d["critical_path"])}))


def predict_step(spec: StepSpec) -> Prediction:
    """The model's prediction for ``spec``; a spec of inconsistent lengths or negative times:
    ``InvalidArgumentError``."""
    return Prediction.from_json(json.loads(_native.predict_step(json.dumps(spec.to_json()))))
