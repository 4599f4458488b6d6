//! Per-chunk dispatch from an [`Isa`] to the scalar, AVX2 or AVX-512 function.
//!
//! SAFETY (for each call of a `#[target_feature]` function below): a [`Supported`] can only be
//! made by `Supported::new`, after `is_supported()` confirmed that this CPU and OS run the ISA's
//! instructions.

use super::{GradSlice, Isa, scalar};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use scalar::AdamWConsts;

/// An instruction set this CPU supports: the only key to the `#[target_feature]` functions.
#[derive(Clone, Copy, Debug)]
pub(super) struct Supported(Isa);

impl Supported {
    /// `isa`, if this CPU supports it.
    pub(super) fn new(isa: Isa) -> Option<Supported> {
        isa.is_supported().then_some(Supported(isa))
    }

    pub(super) fn isa(self) -> Isa {
        self.0
    }
}

pub(super) fn cast_chunk(isa: Supported, src: &[f32], dst: &mut [u16]) {
    match isa.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX2 + FMA.
        Isa::Avx2 => unsafe { avx2::cast_f32_to_bf16(src, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX-512F.
        Isa::Avx512 => unsafe { avx512::cast_f32_to_bf16(src, dst) },
        _ => scalar::cast_f32_to_bf16(src, dst),
    }
}

pub(super) fn adamw_chunk(
    isa: Supported,
    consts: &AdamWConsts,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: GradSlice<'_>,
    out: Option<&mut [u16]>,
) {
    match isa.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX2 + FMA.
        Isa::Avx2 => unsafe { avx2::adamw(consts, p, m, v, g, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX-512F.
        Isa::Avx512 => unsafe { avx512::adamw(consts, p, m, v, g, out) },
        _ => scalar::adamw(consts, p, m, v, g, out),
    }
}

pub(super) fn add_chunk(isa: Supported, dst: &mut [f32], src: GradSlice<'_>) {
    match isa.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX2 + FMA.
        Isa::Avx2 => unsafe { avx2::add_assign(dst, src) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX-512F.
        Isa::Avx512 => unsafe { avx512::add_assign(dst, src) },
        _ => scalar::add_assign(dst, src),
    }
}

pub(super) fn sum_squares_block(isa: Supported, x: GradSlice<'_>) -> f64 {
    match isa.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX2 + FMA.
        Isa::Avx2 => unsafe { avx2::sum_squares(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see the module doc: this CPU supports AVX-512F.
        Isa::Avx512 => unsafe { avx512::sum_squares(x) },
        _ => scalar::sum_squares(x),
    }
}
