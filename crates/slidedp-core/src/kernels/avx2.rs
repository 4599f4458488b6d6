//! AVX2 + FMA kernels: the scalar math on 8 f32 lanes, bit for bit (the same operations in the
//! same order, FMA where scalar uses `mul_add`, IEEE sqrt and division). Loops take 16 elements
//! per iteration; the last < 16 elements of a slice go through `scalar`. `avx512.rs` mirrors
//! this file.
//!
//! Every function requires a CPU with AVX2 and FMA (the caller checks); loads and stores go
//! through the bounds-checked helpers at the top.

use std::arch::x86_64::*;

use super::GradSlice;
use super::scalar::{self, AdamWConsts};

/// f32 lanes per vector.
const LANES: usize = 8;
/// Elements per loop iteration (two vectors).
const STEP: usize = 2 * LANES;

#[inline]
#[target_feature(enable = "avx2,fma")]
fn load_f32(s: &[f32], i: usize) -> __m256 {
    let s = &s[i..i + LANES];
    // SAFETY: `s` is 8 readable f32; unaligned loads are allowed.
    unsafe { _mm256_loadu_ps(s.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn store_f32(s: &mut [f32], i: usize, x: __m256) {
    let s = &mut s[i..i + LANES];
    // SAFETY: `s` is 8 writable f32; unaligned stores are allowed.
    unsafe { _mm256_storeu_ps(s.as_mut_ptr(), x) }
}

/// 8 bf16 → 8 f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load_bf16(s: &[u16], i: usize) -> __m256 {
    let s = &s[i..i + LANES];
    // SAFETY: `s` is 8 readable u16 (16 bytes); unaligned loads are allowed.
    let bits = unsafe { _mm_loadu_si128(s.as_ptr().cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn load_grad(g: GradSlice<'_>, i: usize) -> __m256 {
    match g {
        GradSlice::F32(s) => load_f32(s, i),
        GradSlice::Bf16(s) => load_bf16(s, i),
    }
}

/// Stores 16 bf16.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn store_bf16x16(s: &mut [u16], i: usize, x: __m256i) {
    let s = &mut s[i..i + STEP];
    // SAFETY: `s` is 16 writable u16 (32 bytes); unaligned stores are allowed.
    unsafe { _mm256_storeu_si256(s.as_mut_ptr().cast(), x) }
}

/// `scalar::f32_to_bf16` on 8 lanes, each result in the low half of its 32-bit lane. Integer
/// ops, not a bf16 conversion instruction, so denormals round exactly as torch rounds them.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn round_bf16(x: __m256) -> __m256i {
    let bits = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
    let quiet_nan = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    _mm256_blendv_epi8(rounded, quiet_nan, is_nan)
}

/// Packs the rounded lanes of `lo` then `hi` into 16 bf16, in order.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pack_bf16(lo: __m256i, hi: __m256i) -> __m256i {
    // Each lane holds a value <= 0xFFFF, so the unsigned saturation never triggers; packus
    // interleaves 128-bit halves (lo0 hi0 lo1 hi1), the permute puts them back in order.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi))
}

/// `scalar::cast_f32_to_bf16`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn cast_f32_to_bf16(src: &[f32], dst: &mut [u16]) {
    let n = src.len();
    assert_eq!(dst.len(), n);
    let mut i = 0;
    while i + STEP <= n {
        let lo = round_bf16(load_f32(src, i));
        let hi = round_bf16(load_f32(src, i + LANES));
        store_bf16x16(dst, i, pack_bf16(lo, hi));
        i += STEP;
    }
    scalar::cast_f32_to_bf16(&src[i..], &mut dst[i..]);
}

/// `AdamWConsts` broadcast to all lanes.
struct Consts {
    decay: __m256,
    b1c: __m256,
    beta2: __m256,
    b2c: __m256,
    neg_step_size: __m256,
    bc2_sqrt: __m256,
    eps: __m256,
    grad_scale: __m256,
}

impl Consts {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn new(c: &AdamWConsts) -> Consts {
        Consts {
            decay: _mm256_set1_ps(c.decay),
            b1c: _mm256_set1_ps(c.b1c),
            beta2: _mm256_set1_ps(c.beta2),
            b2c: _mm256_set1_ps(c.b2c),
            neg_step_size: _mm256_set1_ps(c.neg_step_size),
            bc2_sqrt: _mm256_set1_ps(c.bc2_sqrt),
            eps: _mm256_set1_ps(c.eps),
            grad_scale: _mm256_set1_ps(c.grad_scale),
        }
    }
}

/// `scalar::adamw_elem` on elements `i..i + 8`; returns the updated parameters.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn adamw8(
    k: &Consts,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: __m256,
    i: usize,
) -> __m256 {
    let g = _mm256_mul_ps(grad, k.grad_scale);
    let decayed = _mm256_mul_ps(load_f32(p, i), k.decay);
    let m_old = load_f32(m, i);
    let m_new = _mm256_fmadd_ps(k.b1c, _mm256_sub_ps(g, m_old), m_old);
    let v_new = _mm256_fmadd_ps(
        _mm256_mul_ps(k.b2c, g),
        g,
        _mm256_mul_ps(load_f32(v, i), k.beta2),
    );
    let denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_new), k.bc2_sqrt), k.eps);
    let update = _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, m_new), denom);
    let p_new = _mm256_add_ps(decayed, update);
    store_f32(p, i, p_new);
    store_f32(m, i, m_new);
    store_f32(v, i, v_new);
    p_new
}

/// `scalar::adamw`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn adamw(
    c: &AdamWConsts,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: GradSlice<'_>,
    mut out: Option<&mut [u16]>,
) {
    let n = p.len();
    assert!(m.len() == n && v.len() == n && grad.len() == n);
    assert!(out.as_ref().is_none_or(|o| o.len() == n));
    let k = Consts::new(c);
    let mut i = 0;
    while i + STEP <= n {
        let lo = adamw8(&k, p, m, v, load_grad(grad, i), i);
        let hi = adamw8(&k, p, m, v, load_grad(grad, i + LANES), i + LANES);
        if let Some(out) = out.as_deref_mut() {
            store_bf16x16(out, i, pack_bf16(round_bf16(lo), round_bf16(hi)));
        }
        i += STEP;
    }
    let out_tail = out.map(|o| &mut o[i..]);
    scalar::adamw(
        c,
        &mut p[i..],
        &mut m[i..],
        &mut v[i..],
        grad.range(i..n),
        out_tail,
    );
}

/// `scalar::add_assign`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn add_assign(dst: &mut [f32], src: GradSlice<'_>) {
    let n = dst.len();
    assert_eq!(src.len(), n);
    let mut i = 0;
    while i + LANES <= n {
        store_f32(dst, i, _mm256_add_ps(load_f32(dst, i), load_grad(src, i)));
        i += LANES;
    }
    scalar::add_assign(&mut dst[i..], src.range(i..n));
}

/// `scalar::sum_squares`, with 4 × 4 f64 accumulator lanes (added in another order).
#[target_feature(enable = "avx2,fma")]
pub(super) fn sum_squares(x: GradSlice<'_>) -> f64 {
    let n = x.len();
    let mut acc = [_mm256_setzero_pd(); 4];
    let mut i = 0;
    while i + STEP <= n {
        for (half, pair) in acc.chunks_exact_mut(2).enumerate() {
            let f = load_grad(x, i + half * LANES);
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(f));
            // The f64 square of an f32 is exact, so the FMA rounds like `sum + square`.
            pair[0] = _mm256_fmadd_pd(lo, lo, pair[0]);
            pair[1] = _mm256_fmadd_pd(hi, hi, pair[1]);
        }
        i += STEP;
    }
    let total = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
    let mut lanes = [0.0f64; 4];
    // SAFETY: `lanes` is 4 writable f64; unaligned stores are allowed.
    unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), total) };
    lanes.iter().sum::<f64>() + scalar::sum_squares(x.range(i..n))
}
