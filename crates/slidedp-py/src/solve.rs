//! `slidedp._native.solve_layout`: the policy solver's integer program (`slidedp_core::solve`).

use pyo3::prelude::*;
use slidedp_core::Error;
use slidedp_core::solve::{Problem, solve};

use crate::gate::{gate, to_py_err};

/// The fastest layout (JSON `Layout`) of a JSON `Problem` that fits its budget.
#[pyfunction]
pub fn solve_layout(py: Python<'_>, problem_json: &str) -> PyResult<String> {
    let problem: Problem = serde_json::from_str(problem_json)
        .map_err(|e| to_py_err(py, &Error::InvalidArgument(e.to_string())))?;
    let layout = gate(py, || solve(&problem))?;
    serde_json::to_string(&layout)
        .map_err(|e| to_py_err(py, &Error::InvalidArgument(e.to_string())))
}
