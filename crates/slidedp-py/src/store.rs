//! `slidedp._native.HostStore`: the shared-memory state store.

use std::path::Path;
use std::sync::Arc;

use pyo3::prelude::*;
use slidedp_core::Error;
use slidedp_core::store::{HostStore, PartCount, Region, StoreSpec};

use crate::gate::{gate, json_call, timeout_from_secs, to_py_err};

/// The resolved layout JSON (`regions.total_bytes` included) that `HostStore.create` would give
/// `spec_json`, computed without allocating: what `slidedp estimate` sizes a run with.
#[pyfunction]
pub fn store_layout(py: Python<'_>, spec_json: &str) -> PyResult<String> {
    let spec: StoreSpec = serde_json::from_str(spec_json)
        .map_err(|e| to_py_err(py, &Error::InvalidLayout(e.to_string())))?;
    let layout = gate(py, || HostStore::plan(&spec))?;
    serde_json::to_string(&layout).map_err(|e| to_py_err(py, &Error::InvalidLayout(e.to_string())))
}

/// A JSON `StoreSpec` as the store reads it, written back (every field, defaults filled): the
/// Python record of the spec is checked against it.
#[pyfunction]
pub fn store_spec_echo(py: Python<'_>, spec_json: &str) -> PyResult<String> {
    json_call(py, spec_json, |spec: &StoreSpec| Ok(spec.clone()))
}

#[pyclass(frozen, name = "HostStore", module = "slidedp._native")]
pub struct PyHostStore {
    pub(crate) inner: Arc<HostStore>,
}

#[pymethods]
impl PyHostStore {
    /// Creates a store from a JSON `StoreSpec` in `shm_dir` (e.g. "/dev/shm") out of `parts`
    /// files filled in parallel (None: one per core, each at least 1 GiB).
    #[staticmethod]
    #[pyo3(signature = (spec_json, shm_dir, parts=None))]
    fn create(
        py: Python<'_>,
        spec_json: &str,
        shm_dir: &str,
        parts: Option<usize>,
    ) -> PyResult<Self> {
        let spec: StoreSpec = serde_json::from_str(spec_json)
            .map_err(|e| to_py_err(py, &Error::InvalidLayout(e.to_string())))?;
        let parts = parts.map_or(PartCount::Auto, PartCount::Exactly);
        let inner = gate(py, || {
            HostStore::create_in_parts(&spec, Path::new(shm_dir), parts)
        })?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Attaches to a store that another living process created.
    #[staticmethod]
    fn attach(py: Python<'_>, name: &str) -> PyResult<Self> {
        let inner = gate(py, || HostStore::attach(name))?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    #[getter]
    fn address(&self) -> usize {
        self.inner.base_ptr() as usize
    }

    #[getter]
    fn total_bytes(&self) -> usize {
        self.inner.total_bytes()
    }

    /// The resolved layout (groups, params, offsets) as JSON.
    fn layout_json(&self, py: Python<'_>) -> PyResult<String> {
        serde_json::to_string(self.inner.layout())
            .map_err(|e| to_py_err(py, &Error::InvalidLayout(e.to_string())))
    }

    /// (address, byte length) of "master", "exp_avg", "exp_avg_sq", "grad", "staging" or
    /// "mirror".
    fn region(&self, py: Python<'_>, name: &str) -> PyResult<(usize, usize)> {
        let region = Region::parse(name).ok_or_else(|| {
            to_py_err(
                py,
                &Error::InvalidArgument(format!(
                    "unknown region '{name}' (master, exp_avg, exp_avg_sq, grad, staging, mirror)"
                )),
            )
        })?;
        let (ptr, len) = self.inner.region(region);
        Ok((ptr as usize, len))
    }

    fn publish(&self, py: Python<'_>, layer: usize, version: u32) -> PyResult<()> {
        gate(py, || self.inner.publish(layer, version))
    }

    /// Blocks (GIL released) until `layer` reaches `version`; returns the version seen.
    fn wait_version(
        &self,
        py: Python<'_>,
        layer: usize,
        version: u32,
        timeout_s: f64,
    ) -> PyResult<u32> {
        let timeout = timeout_from_secs(py, timeout_s)?;
        gate(py, || self.inner.wait_version(layer, version, timeout))
    }

    fn version(&self, py: Python<'_>, layer: usize) -> PyResult<u32> {
        gate(py, || self.inner.version(layer))
    }

    /// Declares the store failed: every waiter, in every process, gets StorePoisonedError.
    /// With ``claim`` (this process's own failure, not a reaction to a peer's), returns whether
    /// it is the store's first claimed failure, in any process (the one reported).
    #[pyo3(signature = (claim = true))]
    fn poison(&self, claim: bool) -> bool {
        self.inner.poison(claim)
    }
}
