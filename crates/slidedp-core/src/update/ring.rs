//! The cpu gradient route's ring across the ranks of one node: every rank copies its own
//! gradient chunk, in the device's dtype, into its own landing slots (the gradient slots of the
//! small `signals` store), and the chunk's owner sums every rank's copy into its own f32
//! gradient slot of the main store, where AdamW and the norm read it.
//!
//! Signals are the version counters of `signals` (one group per counter): `landed[r]` counts
//! the chunks rank `r` has copied into its landing slots, `consumed[r][k]` is one past the last
//! chunk summed out of rank `r`'s landing slot `k`. Every rank sends the same chunks in the same
//! order with the same slot round-robin, so a chunk's sequence number names it on every rank.
//! No barrier: a rank waits only for the counters of the chunks it needs.
//!
//! The sum is the owner's copy first, then the others in rank order, left to right in f32
//! (`Kernels::sum_into`: bf16 widens exactly), so it is bit for bit the f32 sum of the ranks'
//! widened copies in that order, whatever dtype they landed in.
//!
//! Ownership: a rank writes only its own landing slots, and rewrites slot `k` only after every
//! owner that read it published `consumed[rank][k]` ([`HostSumRing::wait_consumed`]); an owner
//! writes the sum into its own f32 slot only, which no rank copies into. The `Arc`s keep both
//! mappings alive while the ring lives.

use std::sync::Arc;
use std::time::Duration;

use super::chunk::grad_chunk;
use crate::error::{Error, Result};
use crate::kernels::{GradSlice, Kernels};
use crate::store::{Dtype, HostStore, Region, StoreLayout};

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

    /// Rank `rank`'s view of the ring: `signals` holds the counters and every rank's landing
    /// slots (bf16 or f32, of `grads`' slot length), `grads` the f32 gradient slots the sums
    /// land in (rank `r` owns slots `[r * slots_per_rank, (r + 1) * slots_per_rank)` of both);
    /// waits give up after `timeout`.
    pub fn new(
        grads: Arc<HostStore>,
        signals: Arc<HostStore>,
        rank: usize,
        ranks: usize,
        slots_per_rank: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let problem = ring_problem(&grads, &signals, rank, ranks, slots_per_rank);
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
    /// rank's copy, sums every rank's copy (its own first, then the others in rank order, f32)
    /// into its own f32 slot, then frees the others' landing slots. With `squares`, returns the
    /// sum's `Σ g²` as `Kernels::sum_squares` of the slot gives it (taken in the same pass).
    pub fn gather(
        &self,
        kernels: &Kernels,
        seq: u64,
        slot: usize,
        len: usize,
        squares: bool,
    ) -> Result<Option<f64>> {
        let version = counter(seq)?;
        let dst = self.sum_ptr(slot, len)?;
        let others: Vec<usize> = (0..self.ranks).filter(|&r| r != self.rank).collect();
        // SAFETY: a landing slot is written only by its rank, which landed the chunk (this
        // rank's own: its `landed` came first; the others': waited for below) and leaves it
        // unchanged until `consumed` is published below (this rank's own: until its request
        // completes).
        let own = unsafe { self.landing(self.rank, slot, len)? };
        let mut srcs = vec![own];
        for &r in &others {
            self.signals.wait_version(r, version, self.timeout)?;
            // SAFETY: see above.
            srcs.push(unsafe { self.landing(r, slot, len)? });
        }
        // SAFETY: `dst` is this rank's f32 slot `slot` of `grads`, written only by its owner
        // (here) and read by its AdamW after this, apart from every landing slot (another
        // store); the Arc'd store keeps the mapping alive.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        let squared = if squares {
            Some(kernels.sum_into_squares(dst, &srcs, false)?)
        } else {
            kernels.sum_into(dst, &srcs, false)?;
            None
        };
        for &r in &others {
            self.signals.publish(self.consumed(r, slot), version)?;
        }
        Ok(squared)
    }

    /// Wakes every waiter on the signals (this rank failed: its peers must not hang).
    pub fn poison(&self) {
        self.signals.poison(false); // the host store's poison claims the failure
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

    /// The first element of this rank's f32 slot `slot` of `grads` (where its sums land),
    /// checked to hold `len` elements.
    fn sum_ptr(&self, slot: usize, len: usize) -> Result<*mut f32> {
        let at = self.slot_at(self.grads.layout(), self.rank, slot, len)?;
        // SAFETY: `slot_at` checked the slot lies inside the f32 gradient region (`new`).
        Ok(unsafe { self.grads.region(Region::Grad).0.add(at).cast::<f32>() })
    }

    /// Rank `rank`'s landing slot `slot` (its first `len` elements).
    ///
    /// # Safety
    /// Rank `rank` writes that memory: the caller keeps the slice only while the rank leaves the
    /// slot unchanged (after its `landed` of the chunk, before this rank's `consumed` of it).
    unsafe fn landing(&self, rank: usize, slot: usize, len: usize) -> Result<GradSlice<'_>> {
        self.slot_at(self.signals.layout(), rank, slot, len)?;
        // SAFETY: `slot_at` checked the slot lies inside the landing region, of the dtype its
        // layout names (`new`); the Arc'd store outlives `&self`; unchanged: the contract.
        Ok(unsafe { grad_chunk(&self.signals, rank * self.slots_per_rank + slot, 0, len) })
    }

    /// The byte offset in `layout`'s gradient region of rank `rank`'s slot `slot`, checked to
    /// hold `len` elements.
    fn slot_at(&self, layout: &StoreLayout, rank: usize, slot: usize, len: usize) -> Result<usize> {
        self.check_slot(slot)?;
        if len > layout.slot_len {
            return Err(Error::InvalidArgument(format!(
                "host sum of {len} elements: slots hold {}",
                layout.slot_len
            )));
        }
        // rank < ranks and slot < slots_per_rank: below grad_slots of both stores (`new`)
        Ok((rank * self.slots_per_rank + slot) * layout.grad_slot_bytes())
    }
}

/// What makes `grads` and `signals` unfit for rank `rank` of a ring of `ranks` ranks with
/// `slots_per_rank` slots each, if anything.
fn ring_problem(
    grads: &HostStore,
    signals: &HostStore,
    rank: usize,
    ranks: usize,
    slots_per_rank: usize,
) -> Option<String> {
    let (layout, landing) = (grads.layout(), signals.layout());
    let (slots, counters) = (
        ranks * slots_per_rank,
        HostSumRing::signal_count(ranks, slots_per_rank),
    );
    if rank >= ranks || slots_per_rank == 0 {
        Some(format!(
            "rank {rank} of {ranks} with {slots_per_rank} slots each"
        ))
    } else if layout.grad_dtype.unwrap_or(Dtype::F32) != Dtype::F32 {
        Some("the host sum needs f32 gradient slots".into())
    } else if layout.grad_slots < slots {
        Some(format!(
            "{} gradient slots, {ranks} ranks need {slots_per_rank} each",
            layout.grad_slots
        ))
    } else if landing.groups.len() != counters {
        Some(format!(
            "the signal store has {} counters, {ranks} ranks of {slots_per_rank} slots need \
             {counters}",
            landing.groups.len()
        ))
    } else if landing.grad_slots < slots || landing.slot_len != layout.slot_len {
        Some(format!(
            "the signal store has {} landing slots of {} elements, {ranks} ranks need \
             {slots_per_rank} each of {} (create it with gradient slots of the store's length)",
            landing.grad_slots, landing.slot_len, layout.slot_len
        ))
    } else {
        None
    }
}

/// The counter value that says "chunk `seq` is done" (one past it).
fn counter(seq: u64) -> Result<u32> {
    u32::try_from(seq + 1).map_err(|_| {
        Error::InvalidArgument(format!("chunk {seq} is past the signal counters' range"))
    })
}
