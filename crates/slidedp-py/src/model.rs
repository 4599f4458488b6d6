//! `slidedp._native.predict_step`: the step-time model (`slidedp_core::model`).

use pyo3::prelude::*;
use slidedp_core::model::{StepSpec, predict};

use crate::gate::json_call;

/// The prediction (JSON) for a JSON `StepSpec`: step time, lane busy and exposed times, the
/// critical path, the regime.
#[pyfunction]
pub fn predict_step(py: Python<'_>, spec_json: &str) -> PyResult<String> {
    json_call(py, spec_json, |spec: &StepSpec| predict(spec))
}

/// A JSON `StepSpec` as the model reads it, written back (every field, defaults filled): the
/// Python record of the spec is checked against it.
#[pyfunction]
pub fn step_spec_echo(py: Python<'_>, spec_json: &str) -> PyResult<String> {
    json_call(py, spec_json, |spec: &StepSpec| Ok(spec.clone()))
}
