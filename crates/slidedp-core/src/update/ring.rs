//! The cpu gradient route's ring across the ranks of one node: every rank copies its own
//! gradient chunk into its own range of the store's gradient slots, and the chunk's owner adds
//! the other ranks' copies into its slot.
//!
//! Signals are the version counters of a small second store (`signals`, one group per counter):
//! `landed[r]` counts the chunks rank `r` has copied into its slots, `consumed[r][k]` is one past
//! the last chunk summed out of rank `r`'s slot `k`. Every rank sends the same chunks in the same
//! order with the same slot round-robin, so a chunk's sequence number names it on every rank.
//! No barrier: a rank waits only for the counters of the chunks it needs.
//!
//! Ownership: a rank writes only its own slots, and rewrites slot `k` only after every owner that
//! read it published `consumed[rank][k]` ([`HostSumRing::wait_consumed`]); an owner writes the
//! sum into its own slot only. The `Arc`s keep both mappings alive while the ring lives.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::kernels::{GradSlice, Kernels};
use crate::store::{Dtype, HostStore, Region};

#[derive(Debug)]
pub struct HostSumRing {
    grads: Arc<HostStore>,
    signals: Arc<HostStore>,
    rank: usize,
    ranks: usize,
    slots_per_rank: usize,
    timeout: Duration,
}

impl HostSumRing {
    /// The number of counters (groups of the `signals` store) for `ranks` ranks of
    /// `slots_per_rank` gradient slots each: `landed.r`, then `consumed.r.k`.
    pub fn signal_count(ranks: usize, slots_per_rank: usize) -> usize {
        ranks + ranks * slots_per_rank
    }

    /// Rank `rank`'s view of the ring over `grads`' f32 gradient slots (rank `r` owns slots
    /// `[r * slots_per_rank, (r + 1) * slots_per_rank)`); waits give up after `timeout`.
    pub fn new(
        grads: Arc<HostStore>,
        signals: Arc<HostStore>,
        rank: usize,
        ranks: usize,
        slots_per_rank: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let layout = grads.layout();
        let counters = Self::signal_count(ranks, slots_per_rank);
        let problem = if rank >= ranks || slots_per_rank == 0 {
            Some(format!(
                "rank {rank} of {ranks} with {slots_per_rank} slots each"
            ))
        } else if layout.grad_dtype.unwrap_or(Dtype::F32) != Dtype::F32 {
            Some("the host sum needs f32 gradient slots".into())
        } else if layout.grad_slots < ranks * slots_per_rank {
            Some(format!(
                "{} gradient slots, {ranks} ranks need {slots_per_rank} each",
                layout.grad_slots
            ))
        } else if signals.layout().groups.len() != counters {
            Some(format!(
                "the signal store has {} counters, {ranks} ranks of {slots_per_rank} slots \
                 need {counters}",
                signals.layout().groups.len()
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(Error::InvalidArgument(format!("host sum ring: {problem}")));
        }
        Ok(Self {
            grads,
            signals,
            rank,
            ranks,
            slots_per_rank,
            timeout,
        })
    }

    /// The index within this rank's slots of the store's gradient slot `grad_slot`, if it is
    /// one of them.
    pub fn local_slot(&self, grad_slot: usize) -> Option<usize> {
        let first = self.rank * self.slots_per_rank;
        (first..first + self.slots_per_rank)
            .contains(&grad_slot)
            .then(|| grad_slot - first)
    }

    fn consumed(&self, rank: usize, slot: usize) -> usize {
        self.ranks + rank * self.slots_per_rank + slot
    }

    /// This rank's chunks up to `seq` are in its slots.
    pub fn landed(&self, seq: u64) -> Result<()> {
        self.signals.publish(self.rank, counter(seq)?)
    }

    /// Blocks until this rank's slot `slot` may be rewritten: chunk `seq` was summed out of it.
    pub fn wait_consumed(&self, slot: usize, seq: u64) -> Result<()> {
        self.check_slot(slot)?;
        let at = self.consumed(self.rank, slot);
        self.signals.wait_version(at, counter(seq)?, self.timeout)?;
        Ok(())
    }

    /// Owner of chunk `seq` (`len` elements in slot `slot` of every rank): waits for every other
    /// rank's copy, adds them into this rank's slot (left to right in rank order, f32), then
    /// frees their slots.
    pub fn gather(&self, kernels: &Kernels, seq: u64, slot: usize, len: usize) -> Result<()> {
        let version = counter(seq)?;
        let dst = self.slot_ptr(self.rank, slot, len)?;
        let others: Vec<usize> = (0..self.ranks).filter(|&r| r != self.rank).collect();
        let mut srcs = Vec::with_capacity(others.len());
        for &r in &others {
            self.signals.wait_version(r, version, self.timeout)?;
            srcs.push(self.slot_ptr(r, slot, len)?);
        }
        // SAFETY: each rank's slot is written only by that rank, and this rank's slot `slot`
        // only by the owner (here) until it frees it; the others' slots stay unchanged until
        // `consumed` is published below (their ranks wait for it before rewriting). This
        // rank's slot is disjoint from theirs; the Arc'd store keeps the mapping alive.
        let (dst, srcs) = unsafe {
            let srcs: Vec<GradSlice<'_>> = srcs
                .iter()
                .map(|&p| GradSlice::F32(std::slice::from_raw_parts(p, len)))
                .collect();
            (std::slice::from_raw_parts_mut(dst, len), srcs)
        };
        kernels.sum_into(dst, &srcs, true)?;
        for &r in &others {
            self.signals.publish(self.consumed(r, slot), version)?;
        }
        Ok(())
    }

    /// Wakes every waiter on the signals (this rank failed: its peers must not hang).
    pub fn poison(&self) {
        self.signals.poison();
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot < self.slots_per_rank {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "host sum slot {slot}: each rank has {} slots",
            self.slots_per_rank
        )))
    }

    /// The first element of rank `rank`'s slot `slot`, checked to hold `len` elements.
    fn slot_ptr(&self, rank: usize, slot: usize, len: usize) -> Result<*mut f32> {
        self.check_slot(slot)?;
        let layout = self.grads.layout();
        if len > layout.slot_len {
            return Err(Error::InvalidArgument(format!(
                "host sum of {len} elements: slots hold {}",
                layout.slot_len
            )));
        }
        let at = (rank * self.slots_per_rank + slot) * layout.grad_slot_bytes();
        // SAFETY: rank < ranks and slot < slots_per_rank, so the slot's index is below
        // grad_slots (`new`) and its `len` <= slot_len f32 lie inside the gradient region.
        Ok(unsafe { self.grads.region(Region::Grad).0.add(at).cast::<f32>() })
    }
}

/// The counter value that says "chunk `seq` is done" (one past it).
fn counter(seq: u64) -> Result<u32> {
    u32::try_from(seq + 1).map_err(|_| {
        Error::InvalidArgument(format!("chunk {seq} is past the signal counters' range"))
    })
}
