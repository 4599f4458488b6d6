//! The one way into the engine from Python: GIL released, panics caught, errors typed.

use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::prelude::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use slidedp_core::Error;

/// Runs `work` without the GIL and converts its outcome into a Python result.
pub fn gate<T, F>(py: Python<'_>, work: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> slidedp_core::Result<T> + Send,
{
    match py.detach(|| catch_unwind(AssertUnwindSafe(work))) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(to_py_err(py, &error)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(raise(
                py,
                "EnginePanicError",
                &format!("engine panic: {what}"),
                &[],
            ))
        }
    }
}

/// A JSON-in, JSON-out call into the engine: `input` parsed as `I` (a parse error is an
/// invalid argument), `work` run through [`gate`], its result serialized.
pub fn json_call<I, O, F>(py: Python<'_>, input: &str, work: F) -> PyResult<String>
where
    I: DeserializeOwned + Sync,
    O: Serialize + Send,
    F: FnOnce(&I) -> slidedp_core::Result<O> + Send,
{
    let invalid = |py: Python<'_>, e: serde_json::Error| {
        to_py_err(py, &Error::InvalidArgument(e.to_string()))
    };
    let parsed: I = serde_json::from_str(input).map_err(|e| invalid(py, e))?;
    let output = gate(py, || work(&parsed))?;
    serde_json::to_string(&output).map_err(|e| invalid(py, e))
}

/// A timeout argument in seconds, rejected (typed) when negative or not finite.
pub fn timeout_from_secs(py: Python<'_>, timeout_s: f64) -> PyResult<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(timeout_s).map_err(|_| {
        to_py_err(
            py,
            &Error::InvalidArgument(format!("timeout_s must be >= 0, got {timeout_s}")),
        )
    })
}

/// Maps each engine error to its Python class (one-to-one) with its numbers as attributes.
pub fn to_py_err(py: Python<'_>, error: &Error) -> PyErr {
    let message = error.to_string();
    let (class, fields): (&str, Vec<(&str, u64)>) = match error {
        Error::OutOfSharedMemory {
            needed_bytes,
            available_bytes,
            ..
        } => (
            "OutOfSharedMemoryError",
            vec![
                ("needed_bytes", *needed_bytes),
                ("available_bytes", *available_bytes),
            ],
        ),
        Error::StoreAttach { .. } => ("StoreAttachError", vec![]),
        Error::LayerOutOfRange { layer, layers } => (
            "LayerOutOfRangeError",
            vec![("layer", *layer as u64), ("layers", *layers as u64)],
        ),
        Error::UnknownParameter { .. } => ("UnknownParameterError", vec![]),
        Error::InvalidLayout(_) => ("InvalidLayoutError", vec![]),
        Error::VersionTimeout {
            layer,
            expected,
            got,
            timeout_ms,
        } => (
            "VersionTimeoutError",
            vec![
                ("layer", *layer as u64),
                ("expected", u64::from(*expected)),
                ("got", u64::from(*got)),
                ("timeout_ms", *timeout_ms),
            ],
        ),
        Error::StorePoisoned { layer } => ("StorePoisonedError", vec![("layer", *layer as u64)]),
        Error::LengthMismatch { expected, got, .. } => (
            "LengthMismatchError",
            vec![("expected", *expected as u64), ("got", *got as u64)],
        ),
        Error::UpdateFailed { first, .. } => {
            ("UpdateFailedError", vec![("first", u64::from(*first))])
        }
        Error::UpdateTimeout {
            pending,
            timeout_ms,
        } => (
            "UpdateTimeoutError",
            vec![("pending", *pending as u64), ("timeout_ms", *timeout_ms)],
        ),
        Error::IsaUnsupported { .. } => ("IsaUnsupportedError", vec![]),
        Error::InvalidArgument(_) => ("InvalidArgumentError", vec![]),
        Error::Io { .. } => ("HostIOError", vec![]),
    };
    raise(py, class, &message, &fields)
}

fn raise(py: Python<'_>, class: &str, message: &str, fields: &[(&str, u64)]) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let exception = py
            .import("slidedp.errors")?
            .getattr(class)?
            .call1((message,))?;
        for (name, value) in fields {
            exception.setattr(*name, *value)?;
        }
        Ok(PyErr::from_value(exception))
    };
    build().unwrap_or_else(|import_failure| import_failure)
}
