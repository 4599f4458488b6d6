//! A group's host state faulted into this process before its first update, while the worker
//! has nothing else to do.
//!
//! The store's memory is reserved by `fallocate` but tmpfs zeroes each page, and every process
//! maps it, only on its first touch: left to the first AdamW, the Adam moments (8 bytes a
//! parameter, never written before) page-fault inside the run's first update, which a clipped
//! step runs while the next forward waits for it. `MADV_POPULATE_WRITE` does that work ahead, in
//! pieces on the kernels' pool, without changing a byte (so it may run beside anything that
//! reads or writes the memory). It is only a head start: a kernel without it (before Linux
//! 5.14) or any failure just leaves the faults to the update, as before.

use rayon::prelude::*;

use crate::error::Result;
use crate::kernels::Kernels;
use crate::store::shm::page_bytes;
use crate::store::{HostStore, Region};

/// Bytes one `madvise` call populates: small enough that the pool shares a group evenly.
const PIECE_BYTES: usize = 16 << 20;

/// The byte ranges `(address, length)` an update of `group` writes: its trained master
/// weights, both moments and its BF16 mirror range (a store without a mirror: none).
pub(super) fn group_ranges(store: &HostStore, group: usize) -> Result<Vec<(usize, usize)>> {
    let layout = store.layout();
    let g = layout.group(group)?;
    let at = |region: Region, element: usize, bytes: usize| {
        (
            store.region(region).0 as usize + element * bytes,
            g.trained_len * bytes,
        )
    };
    let mut ranges = vec![
        at(Region::Master, g.state_offset, 4),
        at(Region::ExpAvg, g.moment_offset, 4),
        at(Region::ExpAvgSq, g.moment_offset, 4),
    ];
    if layout.mirror_len > 0 {
        let base = store.region(Region::Mirror).0 as usize;
        ranges.push((base + g.mirror_offset * 2, g.slot_len * 2));
    }
    ranges.retain(|&(_, len)| len > 0);
    Ok(ranges)
}

/// How [`populate`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Populated {
    Done,
    /// Stopped between pieces because `interrupted` said so (some pieces may be in already).
    Interrupted,
    /// The kernel cannot (no `MADV_POPULATE_WRITE`) or a piece failed.
    Failed,
}

/// Faults `ranges` into this process, writable, on `kernels`' pool, asking `interrupted`
/// before each piece (so an update that arrives waits for one piece a thread, not the group).
/// Contents are left as they are.
pub(super) fn populate(
    kernels: &Kernels,
    ranges: &[(usize, usize)],
    interrupted: impl Fn() -> bool + Sync,
) -> Populated {
    let page = page_bytes();
    let pieces: Vec<(usize, usize)> = ranges
        .iter()
        .flat_map(|&(address, len)| {
            // madvise wants a page-aligned start: the page holding the first byte starts it
            let start = address / page * page;
            let end = address + len;
            (start..end)
                .step_by(PIECE_BYTES)
                .map(move |at| (at, PIECE_BYTES.min(end - at)))
        })
        .collect();
    let outcome = kernels.install(|| {
        pieces.par_iter().try_for_each(|&(at, len)| {
            if interrupted() {
                return Err(Populated::Interrupted);
            }
            // SAFETY: [at, at + len) lies in the store's live mapping (`group_ranges`, rounded
            // down to its page); MADV_POPULATE_WRITE only faults pages in, writing nothing.
            let rc =
                unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
            if rc == 0 {
                Ok(())
            } else {
                Err(Populated::Failed)
            }
        })
    });
    outcome.err().unwrap_or(Populated::Done)
}
