//! `slidedp._native.predict_step`: the step-time model (`slidedp_core::model`).

use pyo3::prelude::*;
use slidedp_core::Error;
use slidedp_core::model::{StepSpec, predict};

use crate::gate::{gate, to_py_err};

/// The prediction (JSON) for a JSON `StepSpec`: step time, lane busy and exposed times, the
/// critical path, the regime.
#[pyfunction]
pub fn predict_step(py: Python<'_>, spec_json: &str) -> PyResult<String> {
    let spec: StepSpec = serde_json::from_str(spec_json)
        .map_err(|e| to_py_err(py, &Error::InvalidArgument(e.to_string())))?;
    let prediction = gate(py, || predict(&spec))?;
    serde_json::to_string(&prediction)
        .map_err(|e| to_py_err(py, &Error::InvalidArgument(e.to_string())))
}
