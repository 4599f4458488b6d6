//! The update worker's thread: it runs the queued requests in order (the cpu route's host
//! sum first, then AdamW and the publish) and, while none waits, faults in the state of the
//! groups still to be updated (`prefault`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::Instant;

use super::chunk::{grad_chunk, update_chunk};
use super::prefault::{self, Populated};
use super::{
    Failure, HostSumRing, Job, MAX_SPANS, Progress, Shared, UpdateRequest, UpdateSpan, monotonic_s,
};
use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::store::HostStore;

/// What the worker's thread works with.
pub(super) struct Context {
    pub(super) store: Arc<HostStore>,
    pub(super) ring: Option<Arc<HostSumRing>>,
    pub(super) kernels: Kernels,
    pub(super) shared: Arc<Shared>,
}

impl Context {
    fn advance(&self, step: impl FnOnce(&mut Progress)) {
        let mut progress = self.shared.progress.lock().expect("poisoned");
        step(&mut progress);
        self.shared.advanced.notify_all();
    }

    fn failed(&self) -> bool {
        let progress = self.shared.progress.lock().expect("poisoned");
        progress.failure.is_some()
    }

    /// Keeps the first failure, claiming the store for it under the progress lock: whoever
    /// wakes on the poison and asks for the cause (`failure`, the same lock) finds it, and
    /// whether it was the store's first claimed failure. A peer's poison (a reaction) only
    /// wakes the others.
    fn fail(&self, request: &UpdateRequest, error: Error) {
        self.advance(|p| {
            if p.failure.is_some() {
                return;
            }
            p.failure = Some(match error {
                Error::StorePoisoned { layer } => Failure::Peer { layer },
                error => Failure::Update {
                    message: format!("group {} step {}: {error}", request.group, request.hp.step),
                    first: self.store.poison(true),
                },
            });
        });
        self.store.poison(false); // claimed above, or a reaction: wake, claim nothing
        if let Some(ring) = &self.ring {
            ring.poison();
        }
    }

    /// The cpu route's sum of the request's chunk; its `Σ g²` joins the total (`norm`).
    fn host_sum(&self, request: &UpdateRequest) -> Result<()> {
        let Some(sum) = request.host_sum else {
            self.advance(|p| p.summed += 1);
            return Ok(());
        };
        let squares = match (sum.gather_seq, &self.ring) {
            (Some(seq), Some(ring)) => {
                let slot = ring
                    .local_slot(request.grad_slot)
                    .expect("checked at submit");
                ring.gather(&self.kernels, seq, slot, request.len, sum.norm)?
            }
            _ => sum.norm.then(|| {
                // SAFETY: the slot holds the request's chunk (`check`) and nobody writes it
                // while the request runs (module docs); the Arc'd store keeps the mapping alive.
                let grad = unsafe { grad_chunk(&self.store, request.grad_slot, 0, request.len) };
                self.kernels.sum_squares(grad)
            }),
        };
        self.advance(|p| {
            p.sum_squares += squares.unwrap_or(0.0);
            p.summed += 1;
        });
        Ok(())
    }

    fn serve(&self, request: &UpdateRequest) -> Result<()> {
        self.host_sum(request)?;
        if request.host_sum.is_some_and(|s| !s.apply) {
            return Ok(());
        }
        update_chunk(&self.store, &self.kernels, request)?;
        request
            .publish
            .map_or(Ok(()), |v| self.store.publish(request.group, v))
    }

    fn run_update(&self, request: &UpdateRequest) {
        if !self.failed() {
            let (start, start_s) = (Instant::now(), monotonic_s());
            let outcome = self.serve(request);
            self.record(request, start, start_s);
            if let Err(error) = outcome {
                self.fail(request, error);
            }
        }
        // a failed request's sum counts as done: its waiters wake with the failure
        self.advance(|p| {
            p.summed = p.summed.max(p.completed + 1);
            p.completed += 1;
        });
    }

    /// Faults `group`'s state in (`prefault::populate`) until more than `received` updates
    /// have been submitted (one waits in the queue: it goes first).
    fn prefault(&self, group: usize, received: u64) -> Populated {
        let Ok(ranges) = prefault::group_ranges(&self.store, group) else {
            return Populated::Failed; // checked at `UpdateWorker::prefault`
        };
        let update_waits = || self.shared.progress.lock().expect("poisoned").submitted > received;
        let outcome = prefault::populate(&self.kernels, &ranges, update_waits);
        if outcome == Populated::Done {
            let bytes: usize = ranges.iter().map(|&(_, len)| len).sum();
            self.shared
                .prefaulted_bytes
                .fetch_add(bytes as u64, Ordering::Relaxed);
        }
        outcome
    }

    fn record(&self, request: &UpdateRequest, start: Instant, start_s: f64) {
        let shared = &self.shared;
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
    }
}

/// The groups waiting to be faulted in, and the ones the worker has updated already.
#[derive(Default)]
pub(super) struct Prefaults {
    pub(super) waiting: std::collections::VecDeque<usize>,
    updated: std::collections::HashSet<usize>,
    /// Off after a failed `populate` (an older kernel): the updates fault on their own.
    off: bool,
}

impl Prefaults {
    /// After `group`'s prefault: an interrupted one is taken up again first, a failed one
    /// turns them off.
    pub(super) fn ended(&mut self, group: usize, outcome: Populated) {
        match outcome {
            Populated::Done => {}
            Populated::Interrupted => self.waiting.push_front(group),
            Populated::Failed => self.off = true,
        }
    }

    pub(super) fn next(&mut self) -> Option<usize> {
        while let Some(group) = self.waiting.pop_front() {
            if !self.off && !self.updated.contains(&group) {
                return Some(group);
            }
        }
        None
    }
}

pub(super) fn run(context: &Context, receiver: mpsc::Receiver<Job>) {
    let mut prefaults = Prefaults::default();
    let mut received = 0; // updates taken from the queue
    loop {
        // every update queued runs first; a group is faulted in only while none waits, and
        // one that arrives meanwhile stops it (the group is taken up again after)
        let job = match receiver.try_recv() {
            Ok(job) => job,
            Err(mpsc::TryRecvError::Disconnected) => return,
            Err(mpsc::TryRecvError::Empty) => match prefaults.next() {
                Some(group) if !context.failed() => {
                    prefaults.ended(group, context.prefault(group, received));
                    continue;
                }
                Some(_) => continue, // a failed worker updates nothing more
                None => match receiver.recv() {
                    Ok(job) => job,
                    Err(mpsc::RecvError) => return,
                },
            },
        };
        match job {
            Job::Prefault(group) => prefaults.waiting.push_back(group),
            Job::Update(request) => {
                received += 1;
                if request.writes_state() {
                    prefaults.updated.insert(request.group);
                }
                context.run_update(&request);
            }
        }
    }
}
