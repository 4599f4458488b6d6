//! One update request's chunk: AdamW over its parameter pieces, and the gradient slot it reads.

use crate::error::{Error, Result};
use crate::kernels::{AdamWStep, GradSlice, Kernels};
use crate::store::{Dtype, HostStore, Region};

use super::UpdateRequest;

/// AdamW over one chunk, one kernel call per parameter piece in it (weight decay only on tensors
/// of two or more dimensions, as HF Trainer does). Padding between parameters is never touched:
/// a gradient slot is reused by every group, so its padding holds stale values.
pub(super) fn update_chunk(
    store: &HostStore,
    kernels: &Kernels,
    request: &UpdateRequest,
) -> Result<()> {
    let layout = store.layout();
    let group = layout.group(request.group)?;
    let (chunk_lo, chunk_hi) = (request.start, request.start + request.len);
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
        // `check` keeps the chunk inside the trained prefix: a frozen parameter is never in it
        let moments = param.moment_offset.ok_or_else(|| {
            Error::InvalidArgument(format!("update of frozen parameter '{}'", param.name))
        })?;
        let (offset, len, grad_at) = (group.state_offset + lo, hi - lo, lo - chunk_lo);
        let moment_at = moments + (lo - param_lo);
        // SAFETY: [offset, offset + len) lies inside the parameter's master weights and
        // [moment_at, moment_at + len) inside its moments (a trained parameter has them), its
        // mirror range inside the group's mirror range; [grad_at, grad_at + len) lies inside
        // gradient slot `grad_slot` (`check`: the chunk is at most a slot long); the caller's
        // protocol (module docs) makes this worker the only writer of the group and keeps the
        // slot unchanged while the update runs; the Arc'd store keeps the mapping alive.
        unsafe {
            let f32_at = |region, at| store.region(region).0.cast::<f32>().add(at);
            let master = std::slice::from_raw_parts_mut(f32_at(Region::Master, offset), len);
            let exp_avg = std::slice::from_raw_parts_mut(f32_at(Region::ExpAvg, moment_at), len);
            let exp_avg_sq =
                std::slice::from_raw_parts_mut(f32_at(Region::ExpAvgSq, moment_at), len);
            let grad = grad_chunk(store, request.grad_slot, grad_at, len);
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

/// Elements `[at, at + len)` of gradient slot `slot`, in the store's gradient dtype.
///
/// # Safety
/// `slot < grad_slots` and `at + len <= slot_len`, and nobody writes that range while the
/// slice lives (it borrows `store`, which keeps the mapping alive).
pub(super) unsafe fn grad_chunk(
    store: &HostStore,
    slot: usize,
    at: usize,
    len: usize,
) -> GradSlice<'_> {
    let layout = store.layout();
    // SAFETY: inside the gradient region, per the caller's contract.
    unsafe {
        let base = store
            .region(Region::Grad)
            .0
            .add(slot * layout.grad_slot_bytes());
        match layout.grad_dtype.unwrap_or(Dtype::F32) {
            Dtype::F32 => {
                GradSlice::F32(std::slice::from_raw_parts(base.cast::<f32>().add(at), len))
            }
            Dtype::Bf16 => {
                GradSlice::Bf16(std::slice::from_raw_parts(base.cast::<u16>().add(at), len))
            }
        }
    }
}
