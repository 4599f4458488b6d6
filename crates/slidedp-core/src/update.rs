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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::kernels::{AdamWStep, GradSlice, Kernels};
use crate::store::{Dtype, HostStore, Region};

/// Update elements `[start, start + len)` of group `group`'s state (offsets relative to the
/// group's `state_offset`) with `hp`, reading the gradient from element 0 of gradient slot
/// `grad_slot`; then publish `publish` for the group, if given. `len == 0` only publishes (a
/// skipped step still advances the group's version).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateRequest {
    pub group: usize,
    pub start: usize,
    pub len: usize,
    pub grad_slot: usize,
    pub hp: AdamWStep,
    pub publish: Option<u32>,
}

#[derive(Debug, Default)]
struct Progress {
    submitted: u64,
    completed: u64,
    first_error: Option<String>,
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
    spans: Mutex<std::collections::VecDeque<UpdateSpan>>,
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
    sender: Mutex<Option<mpsc::Sender<UpdateRequest>>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    /// The process that started the thread: a fork's copy of the worker has no thread.
    owner_pid: u32,
}

impl UpdateWorker {
    pub fn new(store: Arc<HostStore>, kernels: Kernels) -> Result<Self> {
        if store.layout().grad_slots == 0 {
            return Err(Error::InvalidArgument(
                "the update worker needs a store created with gradient slots (grad_slots > 0)"
                    .into(),
            ));
        }
        let (sender, receiver) = mpsc::channel::<UpdateRequest>();
        let shared = Arc::new(Shared::default());
        let (thread_store, thread_shared) = (store.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("slidedp-update".into())
            .spawn(move || run(&thread_store, &kernels, &thread_shared, receiver))
            .map_err(|e| Error::io("spawn the update thread", e))?;
        Ok(Self {
            store,
            sender: Mutex::new(Some(sender)),
            thread: Some(thread),
            shared,
            owner_pid: std::process::id(),
        })
    }

    /// Queues one update; returns its sequence number (0, 1, …) at once.
    pub fn submit(&self, request: UpdateRequest) -> Result<u64> {
        check(self.store.layout(), &request)?;
        let sender = self.sender.lock().expect("poisoned");
        let mut progress = self.shared.progress.lock().expect("poisoned");
        let sent = sender.as_ref().map(|s| s.send(request));
        if !matches!(sent, Some(Ok(()))) {
            return Err(Error::InvalidArgument(
                "the update worker has stopped".into(),
            ));
        }
        progress.submitted += 1;
        Ok(progress.submitted - 1)
    }

    /// Blocks until the first `count` submitted requests have finished (a slot read by request
    /// `n` is free once `wait_completed(n + 1)` returns); reports the first failure.
    pub fn wait_completed(&self, count: u64, timeout: Duration) -> Result<()> {
        let progress = self.shared.progress.lock().expect("poisoned");
        let (progress, wait) = self
            .shared
            .advanced
            .wait_timeout_while(progress, timeout, |p| {
                p.completed < count && p.first_error.is_none()
            })
            .expect("poisoned");
        if let Some(message) = &progress.first_error {
            return Err(Error::UpdateFailed {
                message: message.clone(),
            });
        }
        if wait.timed_out() {
            return Err(Error::UpdateTimeout {
                pending: (count - progress.completed) as usize,
                timeout_ms: timeout.as_millis() as u64,
            });
        }
        Ok(())
    }

    /// Blocks until every submitted update has finished; reports the first failure.
    pub fn drain(&self, timeout: Duration) -> Result<()> {
        let submitted = self.shared.progress.lock().expect("poisoned").submitted;
        self.wait_completed(submitted, timeout)
    }

    /// The first failure of an update, if one failed (without waiting): the cause of this
    /// process's poisoned store, reported instead of the poison its waiters wake with.
    pub fn failure(&self) -> Option<Error> {
        let progress = self.shared.progress.lock().expect("poisoned");
        progress
            .first_error
            .clone()
            .map(|message| Error::UpdateFailed { message })
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

fn check(layout: &crate::store::StoreLayout, request: &UpdateRequest) -> Result<()> {
    let group = layout.group(request.group)?;
    let fits = request
        .start
        .checked_add(request.len)
        .is_some_and(|end| end <= group.state_len);
    if !fits || request.len > layout.slot_len || request.grad_slot >= layout.grad_slots {
        return Err(Error::InvalidArgument(format!(
            "update chunk [{}, +{}) of group '{}' from gradient slot {} does not fit (group {} \
             elements, slots of {} elements, {} slots)",
            request.start,
            request.len,
            group.name,
            request.grad_slot,
            group.state_len,
            layout.slot_len,
            layout.grad_slots
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

fn run(
    store: &HostStore,
    kernels: &Kernels,
    shared: &Shared,
    receiver: mpsc::Receiver<UpdateRequest>,
) {
    for request in receiver {
        let failed = shared
            .progress
            .lock()
            .expect("poisoned")
            .first_error
            .is_some();
        let outcome = if failed {
            Ok(())
        } else {
            let (start, start_s) = (Instant::now(), monotonic_s());
            let outcome = update_chunk(store, kernels, &request).and_then(|()| {
                request
                    .publish
                    .map_or(Ok(()), |v| store.publish(request.group, v))
            });
            shared
                .busy_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if request.len > 0 {
                let mut spans = shared.spans.lock().expect("poisoned");
                if spans.len() == MAX_SPANS {
                    spans.pop_front();
                }
                spans.push_back(UpdateSpan {
                    group: request.group,
                    start_s,
                    end_s: monotonic_s(),
                });
            }
            outcome
        };
        let mut progress = shared.progress.lock().expect("poisoned");
        if let Err(error) = outcome {
            // Kept before the store is poisoned: whoever wakes on the poison finds the cause.
            progress.first_error.get_or_insert(format!(
                "group {} step {}: {error}",
                request.group, request.hp.step
            ));
            store.poison();
        }
        progress.completed += 1;
        shared.advanced.notify_all();
    }
}

/// AdamW over one chunk, one kernel call per parameter piece in it (weight decay only on tensors
/// of two or more dimensions, as HF Trainer does). Padding between parameters is never touched:
/// a gradient slot is reused by every group, so its padding holds stale values.
fn update_chunk(store: &HostStore, kernels: &Kernels, request: &UpdateRequest) -> Result<()> {
    let layout = store.layout();
    let group = layout.group(request.group)?;
    let grad_dtype = layout.grad_dtype.unwrap_or(Dtype::F32);
    let (chunk_lo, chunk_hi) = (request.start, request.start + request.len);
    let grad_slot = store
        .region(Region::Grad)
        .0
        .wrapping_add(request.grad_slot * layout.grad_slot_bytes());
    for param in &layout.params[group.params.clone()] {
        let param_lo = param.state_offset - group.state_offset;
        let (lo, hi) = (
            param_lo.max(chunk_lo),
            (param_lo + param.numel).min(chunk_hi),
        );
        if lo >= hi {
            continue;
        }
        let hp = AdamWStep {
            weight_decay: if param.shape.len() >= 2 {
                request.hp.weight_decay
            } else {
                0.0
            },
            ..request.hp
        };
        let (offset, len, grad_at) = (group.state_offset + lo, hi - lo, lo - chunk_lo);
        // SAFETY: [offset, offset + len) lies inside the parameter, hence inside every state
        // region (and its mirror range inside the group's mirror range); [grad_at, grad_at + len) lies inside gradient slot `grad_slot` (`check`: the
        // chunk is at most a slot long); the caller's protocol (module docs) makes this worker
        // the only writer of the group and keeps the slot unchanged while the update runs; the
        // Arc'd store keeps the mapping alive.
        unsafe {
            let state = |region| store.region(region).0.cast::<f32>().add(offset);
            let master = std::slice::from_raw_parts_mut(state(Region::Master), len);
            let exp_avg = std::slice::from_raw_parts_mut(state(Region::ExpAvg), len);
            let exp_avg_sq = std::slice::from_raw_parts_mut(state(Region::ExpAvgSq), len);
            let grad = match grad_dtype {
                Dtype::F32 => GradSlice::F32(std::slice::from_raw_parts(
                    grad_slot.cast::<f32>().add(grad_at),
                    len,
                )),
                Dtype::Bf16 => GradSlice::Bf16(std::slice::from_raw_parts(
                    grad_slot.cast::<u16>().add(grad_at),
                    len,
                )),
            };
            // The mirror holds the parameter at its slot offset inside the group's range.
            let mirror = (layout.mirror_len > 0).then(|| {
                let at = group.mirror_offset + param.slot_offset + (lo - param_lo);
                let base = store.region(Region::Mirror).0.cast::<u16>();
                std::slice::from_raw_parts_mut(base.add(at), len)
            });
            kernels.adamw(&hp, master, exp_avg, exp_avg_sq, grad, mirror)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
