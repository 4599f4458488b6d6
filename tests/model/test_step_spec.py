"""The step-time model's JSON seam (``plan.step_spec``): the Python records carry exactly the
fields of the Rust serde structs (``slidedp_core::model``), with the same defaults, and survive
a round trip through the native model; a misnamed field is refused, not defaulted."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from slidedp import _native
from slidedp.errors import InvalidArgumentError
from slidedp.plan.step_spec import Prediction, StepSpec, predict_step

LAYERS = 3
GROUPS = LAYERS + 2


def _names(record: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(record)}


def _least() -> StepSpec:
    return StepSpec(
        forward_s=(1.0,) * LAYERS, backward_s=(2.0,) * LAYERS, embed_forward_s=0.1,
        head_s=1.0, embed_backward_s=0.2, load_s=(0.5,) * GROUPS,
        grad_copy_s=(0.5,) * GROUPS, update_s=(0.3,) * GROUPS, slots=2, grad_slots=4,
        clipping=True,
    )  # fmt: skip


def _every_field() -> StepSpec:
    """Every optional field away from its default (two ranks on the cpu route, offloaded
    activations, no mirror, the embedding and first layer resident, context parallelism's
    all-to-alls)."""
    return dataclasses.replace(
        _least(),
        cast_s=(0.05,) * GROUPS,
        offload_s=(0.04,) * LAYERS,
        reload_s=(0.06,) * LAYERS,
        reduce_s=(0.01,) * GROUPS,
        reduce_blocks=False,
        host_sum_s=(0.02,) * GROUPS,
        resident=(True, True, False, False, False),
        all_to_all_forward_s=(0.03,) * LAYERS,
        all_to_all_backward_s=(0.07,) * LAYERS,
    )


def _echo(spec_json: dict[str, Any]) -> dict[str, Any]:
    echoed: dict[str, Any] = json.loads(_native.step_spec_echo(json.dumps(spec_json)))
    return echoed


def test_the_record_has_the_rust_structs_fields() -> None:
    spec = _every_field()
    echoed = _echo(spec.to_json())
    assert set(echoed) == _names(StepSpec)
    assert StepSpec.from_json(echoed) == spec


def test_the_defaults_are_the_rust_structs_defaults() -> None:
    least = _least()
    defaulted = {
        f.name for f in dataclasses.fields(StepSpec) if f.default is not dataclasses.MISSING
    }
    sparse = {k: v for k, v in least.to_json().items() if k not in defaulted}
    assert StepSpec.from_json(_echo(sparse)) == least


@pytest.mark.parametrize("name", ["head_s", "reduce_blocks", "resident", "all_to_all_forward_s"])
def test_a_misnamed_field_is_refused_not_defaulted(name: str) -> None:
    sent = _every_field().to_json()
    sent[name + "_renamed"] = sent.pop(name)
    with pytest.raises(InvalidArgumentError, match=f"unknown field `{name}_renamed`"):
        _native.predict_step(json.dumps(sent))


def test_a_prediction_has_the_rust_predictions_fields() -> None:
    spec = _every_field()
    raw = json.loads(_native.predict_step(json.dumps(spec.to_json())))
    assert set(raw) == _names(Prediction)
    predicted = predict_step(spec)
    assert predicted == Prediction.from_json(raw)
    assert predicted.step_s > 0
    lanes = {"host", "h2d", "compute", "d2h", "update", "offload", "reduce", "all_to_all"}
    assert set(predicted.busy_s) <= lanes
