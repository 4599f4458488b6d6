//! The update worker: applies AdamW to one chunk of a parameter group at a time, off the
//! caller's thread.
//!
//! The training loop copies a chunk of a group's gradient into one of the store's gradient slots
//! and submits "update this chunk of group g from slot k for step t (then publish version v)"; a
//! dedicated thread runs the SIMD AdamW on the chunk's master/exp_avg/exp_avg_sq (on the kernels'
//! own pool) and, for the group's last chunk, publishes the version, so that any process waiting
//! on that group's gate proceeds. Requests run in submission order; each gets a sequence number,
//! and [`UpdateWorker::wait_completed`] tells the caller when a slot's reader has finished, so the
//! slots form a ring with backpressure.
//!
//! Ownership: the worker holds an `Arc` of the store, so the mapping outlives every update. While
//! an update of group g is queued or running, the worker is the only writer of g's state and the
//! caller must not write the request's gradient slot; everyone else reads g only after waiting
//! for its version. A failure is kept (the first one is reported by `drain`), poisons the store
//! so that peers stop, and turns the remaining requests into no-ops.
//!
//! The cpu gradient route (several ranks of one node, [`HostSumRing`]): every rank copies its
//! own gradient of every group into its landing slots; the owner's request first waits for the
//! other ranks' copies of the chunk, sums every copy into its f32 slot, frees theirs and adds
//! the sum's `Σ g²` to a running total ([`UpdateWorker::take_sum_squares`], for the global
//! norm), then runs AdamW: the caller's thread only announces its copy and submits.
//!
//! Groups named by [`UpdateWorker::prefault`] are faulted into this process (the `prefault`
//! module) while no update is queued, each before its first update: an update that arrives
//! meanwhile waits at most for one 16 MiB piece a thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::kernels::{AdamWStep, Kernels};
use crate::store::HostStore;

mod chunk;
mod prefault;
mod ring;
mod thread;
pub use ring::HostSumRing;
use thread::{Context, run};

/// Update elements `[start, start + len)` of group `group`'s state (offsets relative to the
/// group's `state_offset`) with `hp`, reading the gradient from element 0 of gradient slot
/// `grad_slot`; then publish `publish` for the group, if given. `len == 0` only publishes (a
/// skipped step still advances the group's version). With `host_sum`, the cpu route's sum
/// comes first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateRequest {
    pub group: usize,
    pub start: usize,
    pub len: usize,
    pub grad_slot: usize,
    pub hp: AdamWStep,
    pub publish: Option<u32>,
    pub host_sum: Option<ChunkSum>,
}

impl UpdateRequest {
    /// Whether it writes the group's master, moments and mirror: a sum that only feeds the
    /// gradient norm and a publish of nothing do not (the group's first update is yet to come).
    fn writes_state(&self) -> bool {
        self.len > 0 && self.host_sum.is_none_or(|sum| sum.apply)
    }
}

/// What the cpu gradient route does with a chunk before (or instead of) its AdamW.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChunkSum {
    /// `Some(seq)`: add the other ranks' copies of chunk `seq` into this rank's slot first
    /// (needs the worker's [`HostSumRing`]); `None`: the slot holds the sum already (several
    /// nodes: the caller summed it and all-reduced it across the nodes).
    pub gather_seq: Option<u64>,
    /// Add `Σ g²` of the summed chunk to the running total.
    pub norm: bool,
    /// Then run AdamW; false: the sum only feeds the norm (clipping sends the chunk again with
    /// the clip coefficient).
    pub apply: bool,
}

/// The first failure, kept until reported.
#[derive(Clone, Debug)]
enum Failure {
    /// One of this worker's requests failed (the message names its group and step); `first`:
    /// its poison was the store's first (another rank's failure may have come before).
    Update { message: String, first: bool },
    /// A failed peer poisoned a store this worker was waiting on: the peer reports the cause.
    Peer { layer: usize },
}

impl Failure {
    fn error(&self) -> Error {
        match self {
            Failure::Update { message, first } => Error::UpdateFailed {
                message: message.clone(),
                first: *first,
            },
            Failure::Peer { layer } => Error::StorePoisoned { layer: *layer },
        }
    }
}

#[derive(Debug, Default)]
struct Progress {
    submitted: u64,
    /// Requests past their host sum (all of them once completed).
    summed: u64,
    completed: u64,
    /// `Σ g²` of the chunks summed with `norm` since the last `take_sum_squares`, added in
    /// request order.
    sum_squares: f64,
    failure: Option<Failure>,
}

/// When one request ran: CLOCK_MONOTONIC seconds (the clock of Python's `time.monotonic()`), so
/// a trace can put the update lane next to the host and GPU lanes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateSpan {
    pub group: usize,
    pub start_s: f64,
    pub end_s: f64,
}

/// Spans kept at most (a few steps of a deep model): older ones are dropped first.
const MAX_SPANS: usize = 65_536;

#[derive(Debug, Default)]
struct Shared {
    progress: Mutex<Progress>,
    /// Notified after every completed request.
    advanced: Condvar,
    busy_ns: AtomicU64,
    /// Bytes of state faulted in ahead of their groups' first updates.
    prefaulted_bytes: AtomicU64,
    spans: Mutex<std::collections::VecDeque<UpdateSpan>>,
}

/// What the worker's thread is sent: an update, in submission order, or a group to fault in
/// when no update waits.
enum Job {
    Update(UpdateRequest),
    Prefault(usize),
}

fn monotonic_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[derive(Debug)]
pub struct UpdateWorker {
    store: Arc<HostStore>,
    ring: Option<Arc<HostSumRing>>,
    sender: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    /// The process that started the thread: a fork's copy of the worker has no thread.
    owner_pid: u32,
}

impl UpdateWorker {
    pub fn new(store: Arc<HostStore>, kernels: Kernels) -> Result<Self> {
        Self::start(store, kernels, None)
    }

    /// A worker that also sums the ranks' gradient chunks of the cpu route (`ring` over the
    /// same store).
    pub fn with_ring(store: Arc<HostStore>, kernels: Kernels, ring: HostSumRing) -> Result<Self> {
        Self::start(store, kernels, Some(Arc::new(ring)))
    }

    fn start(
        store: Arc<HostStore>,
        kernels: Kernels,
        ring: Option<Arc<HostSumRing>>,
    ) -> Result<Self> {
        if store.layout().grad_slots == 0 {
            return Err(Error::InvalidArgument(
                "the update worker needs a store created with gradient slots (grad_slots > 0)"
                    .into(),
            ));
        }
        let (sender, receiver) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared::default());
        let context = Context {
            store: store.clone(),
            ring: ring.clone(),
            kernels,
            shared: shared.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("slidedp-update".into())
            .spawn(move || run(&context, receiver))
            .map_err(|e| Error::io("spawn the update thread", e))?;
        Ok(Self {
            store,
            ring,
            sender: Mutex::new(Some(sender)),
            thread: Some(thread),
            shared,
            owner_pid: std::process::id(),
        })
    }

    /// The cpu route's ring, if this worker sums (the caller announces its copies there).
    pub fn ring(&self) -> Option<&HostSumRing> {
        self.ring.as_deref()
    }

    /// Queues one update; returns its sequence number (0, 1, …) at once.
    pub fn submit(&self, request: UpdateRequest) -> Result<u64> {
        check(self.store.layout(), self.ring(), &request)?;
        let sender = self.sender.lock().expect("poisoned");
        let mut progress = self.shared.progress.lock().expect("poisoned");
        let sent = sender.as_ref().map(|s| s.send(Job::Update(request)));
        if !matches!(sent, Some(Ok(()))) {
            return Err(Error::InvalidArgument(
                "the update worker has stopped".into(),
            ));
        }
        progress.submitted += 1;
        Ok(progress.submitted - 1)
    }

    /// Faults the state of `groups` (the ones this worker will update, in the order their
    /// first updates come) into this process while no update is queued; a group whose state
    /// an update wrote first is skipped (a sum for the norm alone writes none). Returns at
    /// once; changes no value.
    pub fn prefault(&self, groups: &[usize]) -> Result<()> {
        for &group in groups {
            self.store.layout().group(group)?;
        }
        let sender = self.sender.lock().expect("poisoned");
        for &group in groups {
            if let Some(sender) = sender.as_ref() {
                // a stopped worker updates nothing more: nothing to fault in for it
                let _ = sender.send(Job::Prefault(group));
            }
        }
        Ok(())
    }

    /// Bytes faulted in ahead of their groups' first updates so far (`prefault`).
    pub fn prefaulted_bytes(&self) -> u64 {
        self.shared.prefaulted_bytes.load(Ordering::Relaxed)
    }

    /// Blocks until the first `count` submitted requests have finished (a slot read by request
    /// `n` is free once `wait_completed(n + 1)` returns); reports the first failure.
    pub fn wait_completed(&self, count: u64, timeout: Duration) -> Result<()> {
        self.wait_for(timeout, |p| p.completed >= count, |p| count - p.completed)
            .map(|_| ())
    }

    /// Blocks until every request submitted so far is past its host sum, then returns the
    /// `Σ g²` those sums added (in request order, f64) and starts the total again at 0.
    pub fn take_sum_squares(&self, timeout: Duration) -> Result<f64> {
        let count = self.shared.progress.lock().expect("poisoned").submitted;
        let mut progress = self.wait_for(timeout, |p| p.summed >= count, |p| count - p.summed)?;
        Ok(std::mem::take(&mut progress.sum_squares))
    }

    /// Waits until `done(progress)` or a failure; `pending` counts what is missing.
    fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&Progress) -> bool,
        pending: impl Fn(&Progress) -> u64,
    ) -> Result<std::sync::MutexGuard<'_, Progress>> {
        let progress = self.shared.progress.lock().expect("poisoned");
        let (progress, wait) = self
            .shared
            .advanced
            .wait_timeout_while(progress, timeout, |p| !done(p) && p.failure.is_none())
            .expect("poisoned");
        if let Some(failure) = &progress.failure {
            return Err(failure.error());
        }
        if wait.timed_out() && !done(&progress) {
            return Err(Error::UpdateTimeout {
                pending: pending(&progress) as usize,
                timeout_ms: timeout.as_millis() as u64,
            });
        }
        Ok(progress)
    }

    /// Blocks until every submitted update has finished; reports the first failure.
    pub fn drain(&self, timeout: Duration) -> Result<()> {
        let submitted = self.shared.progress.lock().expect("poisoned").submitted;
        self.wait_completed(submitted, timeout)
    }

    /// The first failure of an update, if one failed (without waiting): the cause of this
    /// process's poisoned store, reported instead of the poison its waiters wake with. A
    /// failed peer's poison is not this worker's failure (`None`).
    pub fn failure(&self) -> Option<Error> {
        let progress = self.shared.progress.lock().expect("poisoned");
        match &progress.failure {
            Some(failure @ Failure::Update { .. }) => Some(failure.error()),
            _ => None,
        }
    }

    /// The spans of the requests completed since the last call (oldest first).
    pub fn take_spans(&self) -> Vec<UpdateSpan> {
        self.shared
            .spans
            .lock()
            .expect("poisoned")
            .drain(..)
            .collect()
    }

    /// (requests completed, seconds spent updating) since creation.
    pub fn stats(&self) -> (u64, f64) {
        (
            self.shared.progress.lock().expect("poisoned").completed,
            self.shared.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        )
    }
}

fn check(
    layout: &crate::store::StoreLayout,
    ring: Option<&HostSumRing>,
    request: &UpdateRequest,
) -> Result<()> {
    let group = layout.group(request.group)?;
    let fits = request
        .start
        .checked_add(request.len)
        .is_some_and(|end| end <= group.trained_len);
    if !fits || request.len > layout.slot_len || request.grad_slot >= layout.grad_slots {
        return Err(Error::InvalidArgument(format!(
            "update chunk [{}, +{}) of group '{}' from gradient slot {} does not fit (group {} \
             trained elements, slots of {} elements, {} slots)",
            request.start,
            request.len,
            group.name,
            request.grad_slot,
            group.trained_len,
            layout.slot_len,
            layout.grad_slots
        )));
    }
    let gathers = request.host_sum.is_some_and(|s| s.gather_seq.is_some());
    if gathers && ring.and_then(|r| r.local_slot(request.grad_slot)).is_none() {
        return Err(Error::InvalidArgument(format!(
            "a host sum into gradient slot {} needs a worker with the ring of the rank that owns \
             the slot",
            request.grad_slot
        )));
    }
    Ok(())
}

impl Drop for UpdateWorker {
    fn drop(&mut self) {
        // Closing the channel ends the thread once the queue is empty.
        self.sender.lock().expect("poisoned").take();
        if let Some(thread) = self.thread.take() {
            // In a forked child the thread does not exist: joining it would wait forever.
            if std::process::id() == self.owner_pid {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod prefault_tests;
#[cfg(test)]
mod tests;
