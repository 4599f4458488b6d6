//! `slidedp._native.solve_layout`: the policy solver's integer program (`slidedp_core::solve`).

use pyo3::prelude::*;
use slidedp_core::solve::{Problem, solve};

use crate::gate::json_call;

/// The fastest layout (JSON `Layout`) of a JSON `Problem` that fits its budget.
#[pyfunction]
pub fn solve_layout(py: Python<'_>, problem_json: &str) -> PyResult<String> {
    json_call(py, problem_json, |problem: &Problem| solve(problem))
}

/// A JSON `Problem` as the solver reads it, written back (every field, defaults filled): the
/// Python records of the program are checked against it.
#[pyfunction]
pub fn solve_problem_echo(py: Python<'_>, problem_json: &str) -> PyResult<String> {
    json_call(py, problem_json, |problem: &Problem| Ok(problem.clone()))
}
