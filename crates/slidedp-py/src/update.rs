//! `slidedp._native.UpdateWorker`: host AdamW per parameter group on a background thread, and
//! the cpu gradient route's sums of the ranks' chunks before it.

use pyo3::prelude::*;
use slidedp_core::Error;
use slidedp_core::kernels::{AdamWStep, Isa, Kernels};
use slidedp_core::update::{ChunkSum, HostSumRing, UpdateRequest, UpdateWorker};

use crate::gate::{gate, timeout_from_secs};
use crate::kernels::PyKernels;
use crate::store::PyHostStore;

#[pyclass(frozen, name = "UpdateWorker", module = "slidedp._native")]
pub struct PyUpdateWorker {
    inner: UpdateWorker,
}

#[pymethods]
impl PyUpdateWorker {
    /// `ring`: `(signals, rank, ranks, slots_per_rank, timeout_s)` of the cpu gradient route
    /// (`signals`: its counters and landing slots).
    #[new]
    #[pyo3(signature = (store, threads, ring=None))]
    fn new(
        py: Python<'_>,
        store: &PyHostStore,
        threads: usize,
        ring: Option<(PyRef<'_, PyHostStore>, usize, usize, usize, f64)>,
    ) -> PyResult<Self> {
        let store = store.inner.clone();
        let ring = match ring {
            Some((signals, rank, ranks, slots, timeout_s)) => {
                let timeout = timeout_from_secs(py, timeout_s)?;
                Some((signals.inner.clone(), rank, ranks, slots, timeout))
            }
            None => None,
        };
        let inner = gate(py, || {
            let kernels = Kernels::new(threads, Isa::detect())?;
            match ring {
                Some((signals, rank, ranks, slots, timeout)) => {
                    let ring =
                        HostSumRing::new(store.clone(), signals, rank, ranks, slots, timeout)?;
                    UpdateWorker::with_ring(store, kernels, ring)
                }
                None => UpdateWorker::new(store, kernels),
            }
        })?;
        Ok(Self { inner })
    }

    /// Queues AdamW on one chunk of a group from a gradient slot (after the cpu route's sum:
    /// `host_sum = (gather_seq, norm, apply)`); returns its sequence number.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (group, start, length, grad_slot, *, step, lr, beta1, beta2, eps,
                        weight_decay, grad_scale, publish=None, host_sum=None))]
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
        host_sum: Option<(Option<u64>, bool, bool)>,
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
            host_sum: host_sum.map(|(gather_seq, norm, apply)| ChunkSum {
                gather_seq,
                norm,
                apply,
            }),
        };
        gate(py, || self.inner.submit(request))
    }

    /// Blocks (GIL released) until every request submitted so far is past its host sum;
    /// returns the sums' `Σ g²` since the last call and starts again at 0.
    fn take_sum_squares(&self, py: Python<'_>, timeout_s: f64) -> PyResult<f64> {
        let timeout = timeout_from_secs(py, timeout_s)?;
        gate(py, || self.inner.take_sum_squares(timeout))
    }

    /// This rank's gradient chunks up to `seq` are in its slots (the ring's `landed`).
    fn landed(&self, py: Python<'_>, seq: u64) -> PyResult<()> {
        gate(py, || self.ring()?.landed(seq))
    }

    /// Blocks (GIL released) until this rank's slot `slot` was summed out of for chunk `seq`.
    fn wait_consumed(&self, py: Python<'_>, slot: usize, seq: u64) -> PyResult<()> {
        gate(py, || self.ring()?.wait_consumed(slot, seq))
    }

    /// Owner, on the calling thread (GIL released): sums every rank's landed chunk `seq` into
    /// this rank's f32 slot `slot` and frees the others' landing slots.
    fn gather(
        &self,
        py: Python<'_>,
        kernels: &PyKernels,
        seq: u64,
        slot: usize,
        length: usize,
    ) -> PyResult<()> {
        gate(py, || {
            let ring = self.ring()?;
            ring.gather(&kernels.inner, seq, slot, length, false)
                .map(|_| ())
        })
    }

    /// Faults the state of `groups` into this process while no update is queued (in this
    /// order, each before its first update); returns at once.
    fn prefault(&self, py: Python<'_>, groups: Vec<usize>) -> PyResult<()> {
        gate(py, || self.inner.prefault(&groups))
    }

    /// Bytes faulted in ahead of their groups' first updates so far.
    fn prefaulted_bytes(&self) -> u64 {
        self.inner.prefaulted_bytes()
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

impl PyUpdateWorker {
    fn ring(&self) -> slidedp_core::Result<&HostSumRing> {
        self.inner.ring().ok_or_else(|| {
            Error::InvalidArgument("this update worker was made without a host sum ring".into())
        })
    }
}
