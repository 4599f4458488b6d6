//! The Python face of the host engine, `slidedp._native`. Conversions only: every call goes
//! through [`gate::gate`], which releases the GIL, turns panics into errors and maps
//! `slidedp_core::Error` onto the exception tree of `slidedp/errors.py`.

mod gate;
mod kernels;
mod model;
mod solve;
mod store;
mod update;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::PyHostStore>()?;
    m.add_function(wrap_pyfunction!(store::store_layout, m)?)?;
    m.add_function(wrap_pyfunction!(store::store_spec_echo, m)?)?;
    m.add_function(wrap_pyfunction!(model::predict_step, m)?)?;
    m.add_function(wrap_pyfunction!(model::step_spec_echo, m)?)?;
    m.add_function(wrap_pyfunction!(solve::solve_layout, m)?)?;
    m.add_function(wrap_pyfunction!(solve::solve_problem_echo, m)?)?;
    m.add_class::<kernels::PyKernels>()?;
    m.add_class::<update::PyUpdateWorker>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
