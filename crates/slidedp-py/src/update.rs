//! `slidedp._native.UpdateWorker`: host AdamW per parameter group on a background thread.

use pyo3::prelude::*;
use slidedp_core::kernels::{AdamWStep, Isa, Kernels};
use slidedp_core::update::{UpdateRequest, UpdateWorker};

use crate::gate::{gate, timeout_from_secs};
use crate::store::PyHostStore;

#[pyclass(frozen, name = "UpdateWorker", module = "slidedp._native")]
pub struct PyUpdateWorker {
    inner: UpdateWorker,
}

#[pymethods]
impl PyUpdateWorker {
    #[new]
    fn new(py: Python<'_>, store: &PyHostStore, threads: usize) -> PyResult<Self> {
        let store = store.inner.clone();
        let inner = gate(py, || {
            UpdateWorker::new(store, Kernels::new(threads, Isa::detect())?)
        })?;
        Ok(Self { inner })
    }

    /// Queues AdamW on one chunk of a group from a gradient slot; returns its sequence number.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (group, start, length, grad_slot, *, step, lr, beta1, beta2, eps,
                        weight_decay, grad_scale, publish=None))]
    fn submit(
        &self,
        py: Python<'_>,
        group: usize,
        start: usize,
        length: usize,
        grad_slot: usize,
        step: u64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        grad_scale: f64,
        publish: Option<u32>,
    ) -> PyResult<u64> {
        let hp = AdamWStep {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
            grad_scale,
        };
        let request = UpdateRequest {
            group,
            start,
            len: length,
            grad_slot,
            hp,
            publish,
        };
        gate(py, || self.inner.submit(request))
    }

    /// Blocks (GIL released) until the first `count` submitted requests are done.
    fn wait_completed(&self, py: Python<'_>, count: u64, timeout_s: f64) -> PyResult<()> {
        let timeout = timeout_from_secs(py, timeout_s)?;
        gate(py, || self.inner.wait_completed(count, timeout))
    }

    /// Blocks (GIL released) until every submitted update is done.
    fn drain(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = timeout_from_secs(py, timeout_s)?;
        gate(py, || self.inner.drain(timeout))
    }

    /// Raises the first update failure, if any (without waiting).
    fn raise_failure(&self, py: Python<'_>) -> PyResult<()> {
        gate(py, || self.inner.failure().map_or(Ok(()), Err))
    }

    /// [(group, start_s, end_s)] of the requests completed since the last call
    /// (CLOCK_MONOTONIC seconds, Python's `time.monotonic()`).
    fn take_spans(&self) -> Vec<(usize, f64, f64)> {
        self.inner
            .take_spans()
            .into_iter()
            .map(|s| (s.group, s.start_s, s.end_s))
            .collect()
    }

    /// (requests completed, seconds spent updating).
    fn stats(&self) -> (u64, f64) {
        self.inner.stats()
    }
}
