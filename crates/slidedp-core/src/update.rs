//! The update worker: applies AdamW to one parameter group at a time, off the caller's thread.
//!
//! The training loop submits "update group g for step t, then publish version v" as soon as the
//! group's gradient sits in the store's `grad` region; a dedicated thread runs the SIMD AdamW on
//! the group's master/exp_avg/exp_avg_sq (on the kernels' own pool) and publishes the version, so
//! that any process waiting on that group's gate proceeds. Requests run in submission order.
//!
//! Ownership: the worker holds an `Arc` of the store, so the mapping outlives every update. While
//! an update of group g is queued or running, the worker is the only writer of g's state and the
//! caller must not write g's gradient; everyone else reads g only after waiting for its version.
//! A failure is kept (the first one is reported by `drain`), poisons the store so that peers stop,
//! and turns the remaining requests into no-ops.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::kernels::{AdamWStep, GradSlice, Kernels};
use crate::store::{Dtype, HostStore, Region};

/// Update group `group` with `hp`, then publish `version` for it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateRequest {
    pub group: usize,
    pub hp: AdamWStep,
    pub version: u32,
}

#[derive(Debug, Default)]
struct Progress {
    pending: usize,
    first_error: Option<String>,
}

#[derive(Debug, Default)]
struct Shared {
    progress: Mutex<Progress>,
    idle: Condvar,
    busy_ns: AtomicU64,
    completed: AtomicU64,
}

#[derive(Debug)]
pub struct UpdateWorker {
    store: Arc<HostStore>,
    sender: Mutex<Option<mpsc::Sender<UpdateRequest>>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl UpdateWorker {
    pub fn new(store: Arc<HostStore>, kernels: Kernels) -> Result<Self> {
        if store.layout().grad_dtype.is_none() {
            return Err(Error::InvalidArgument(
                "the update worker needs a store created with a gradient region (grad_dtype)"
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
        })
    }

    /// Queues one update; returns at once.
    pub fn submit(&self, request: UpdateRequest) -> Result<()> {
        self.store.layout().group(request.group)?;
        self.shared.progress.lock().expect("poisoned").pending += 1;
        let sender = self.sender.lock().expect("poisoned");
        let sent = sender.as_ref().map(|s| s.send(request));
        if !matches!(sent, Some(Ok(()))) {
            self.shared.progress.lock().expect("poisoned").pending -= 1;
            return Err(Error::InvalidArgument(
                "the update worker has stopped".into(),
            ));
        }
        Ok(())
    }

    /// Blocks until every submitted update has finished; reports the first failure.
    pub fn drain(&self, timeout: Duration) -> Result<()> {
        let progress = self.shared.progress.lock().expect("poisoned");
        let (progress, wait) = self
            .shared
            .idle
            .wait_timeout_while(progress, timeout, |p| p.pending > 0)
            .expect("poisoned");
        if let Some(message) = &progress.first_error {
            return Err(Error::UpdateFailed {
                message: message.clone(),
            });
        }
        if wait.timed_out() {
            return Err(Error::UpdateTimeout {
                pending: progress.pending,
                timeout_ms: timeout.as_millis() as u64,
            });
        }
        Ok(())
    }

    /// (updates completed, seconds spent updating) since creation.
    pub fn stats(&self) -> (u64, f64) {
        (
            self.shared.completed.load(Ordering::Relaxed),
            self.shared.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        )
    }
}

impl Drop for UpdateWorker {
    fn drop(&mut self) {
        // Closing the channel ends the thread once the queue is empty.
        self.sender.lock().expect("poisoned").take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
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
            let start = Instant::now();
            let outcome = update_group(store, kernels, &request)
                .and_then(|()| store.publish(request.group, request.version));
            shared
                .busy_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            shared.completed.fetch_add(1, Ordering::Relaxed);
            outcome
        };
        let mut progress = shared.progress.lock().expect("poisoned");
        if let Err(error) = outcome {
            store.poison();
            progress.first_error.get_or_insert(format!(
                "group {} step {}: {error}",
                request.group, request.hp.step
            ));
        }
        progress.pending -= 1;
        if progress.pending == 0 {
            shared.idle.notify_all();
        }
    }
}

/// AdamW over one group, one kernel call per run of parameters sharing a decay class (weight
/// decay only on tensors of two or more dimensions, as HF Trainer does). A run spans the padding
/// between its parameters: padding is zero in every region and AdamW keeps it zero.
fn update_group(store: &HostStore, kernels: &Kernels, request: &UpdateRequest) -> Result<()> {
    let layout = store.layout();
    let group = layout.group(request.group)?;
    let params = &layout.params[group.params.clone()];
    let grad_dtype = layout.grad_dtype.unwrap_or(Dtype::F32);
    let mut start = 0;
    while start < params.len() {
        let decays = params[start].shape.len() >= 2;
        let mut end = start + 1;
        while end < params.len() && (params[end].shape.len() >= 2) == decays {
            end += 1;
        }
        let offset = params[start].state_offset;
        let len = params[end - 1].state_offset + params[end - 1].numel - offset;
        let hp = AdamWStep {
            weight_decay: if decays { request.hp.weight_decay } else { 0.0 },
            ..request.hp
        };
        // SAFETY: [offset, offset + len) lies inside every state region and the grad region
        // (layout construction); the caller's protocol (module docs) makes this worker the only
        // writer of the group and keeps the gradient unchanged while the update runs; the Arc'd
        // store keeps the mapping alive.
        unsafe {
            let state = |region| store.region(region).0.cast::<f32>().add(offset);
            let master = std::slice::from_raw_parts_mut(state(Region::Master), len);
            let exp_avg = std::slice::from_raw_parts_mut(state(Region::ExpAvg), len);
            let exp_avg_sq = std::slice::from_raw_parts_mut(state(Region::ExpAvgSq), len);
            let grad_base = store.region(Region::Grad).0;
            let grad = match grad_dtype {
                Dtype::F32 => GradSlice::F32(std::slice::from_raw_parts(
                    grad_base.cast::<f32>().add(offset),
                    len,
                )),
                Dtype::Bf16 => GradSlice::Bf16(std::slice::from_raw_parts(
                    grad_base.cast::<u16>().add(offset),
                    len,
                )),
            };
            kernels.adamw(&hp, master, exp_avg, exp_avg_sq, grad, None)?;
        }
        start = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
