//! AVX-512F kernels, a close mirror of `avx2.rs` on 16 f32 lanes: the scalar math bit for bit.
//! Loops take 32 elements per iteration; the last < 32 elements of a slice go through `scalar`.
//!
//! Large bf16 outputs (the cast, AdamW's `out`) are meant for DMA staging and never read back by
//! the CPU: their 64-byte-aligned body is written with non-temporal stores (after a scalar head
//! up to the first 64-byte boundary), and an `sfence` ends the function on the thread that
//! stored, since non-temporal stores are weakly ordered.
//!
//! Every function requires a CPU with AVX-512F, AVX2 and FMA (the caller checks); loads and
//! stores go through the bounds-checked helpers at the top.

use std::arch::x86_64::*;

use super::GradSlice;
use super::scalar::{self, AdamWConsts};

/// f32 lanes per vector.
const LANES: usize = 16;
/// Elements per loop iteration (two vectors; their 32 bf16 fill one 64-byte line).
const STEP: usize = 2 * LANES;
/// Slices at least this long get non-temporal bf16 stores.
const STREAM_MIN_ELEMS: usize = 8 * 1024;

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn load_f32(s: &[f32], i: usize) -> __m512 {
    let s = &s[i..i + LANES];
    // SAFETY: `s` is 16 readable f32; unaligned loads are allowed.
    unsafe { _mm512_loadu_ps(s.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn store_f32(s: &mut [f32], i: usize, x: __m512) {
    let s = &mut s[i..i + LANES];
    // SAFETY: `s` is 16 writable f32; unaligned stores are allowed.
    unsafe { _mm512_storeu_ps(s.as_mut_ptr(), x) }
}

/// 16 bf16 → 16 f32 (exact).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn load_bf16(s: &[u16], i: usize) -> __m512 {
    let s = &s[i..i + LANES];
    // SAFETY: `s` is 16 readable u16 (32 bytes); unaligned loads are allowed.
    let bits = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn load_grad(g: GradSlice<'_>, i: usize) -> __m512 {
    match g {
        GradSlice::F32(s) => load_f32(s, i),
        GradSlice::Bf16(s) => load_bf16(s, i),
    }
}

/// Stores 32 bf16, non-temporally when `stream` (then `s[i..]` must be 64-byte aligned).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn store_bf16x32(s: &mut [u16], i: usize, x: __m512i, stream: bool) {
    let s = &mut s[i..i + STEP];
    if stream {
        assert!(s.as_ptr().addr().is_multiple_of(64));
        // SAFETY: `s` is 32 writable u16 (64 bytes), 64-byte aligned as asserted just above.
        unsafe { _mm512_stream_si512(s.as_mut_ptr().cast(), x) }
    } else {
        // SAFETY: `s` is 32 writable u16 (64 bytes); unaligned stores are allowed.
        unsafe { _mm512_storeu_si512(s.as_mut_ptr().cast(), x) }
    }
}

/// `scalar::f32_to_bf16` on 16 lanes, each result in the low half of its 32-bit lane. Integer
/// ops, not `vcvtneps2bf16` (which treats denormals as zero), so denormals round as torch does.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn round_bf16(x: __m512) -> __m512i {
    let bits = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
    let quiet_nan = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
    let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_mov_epi32(rounded, is_nan, quiet_nan)
}

/// Packs the rounded lanes of `lo` then `hi` into 32 bf16, in order.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn pack_bf16(lo: __m512i, hi: __m512i) -> __m512i {
    // Each lane holds a value <= 0xFFFF, so the truncating narrowing is exact.
    let lo = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo));
    _mm512_inserti64x4::<1>(lo, _mm512_cvtepi32_epi16(hi))
}

/// Elements before `s` reaches a 64-byte boundary (all of them if it never does); 0 unless
/// `s` is long enough to be streamed.
fn stream_head(s: &[u16]) -> usize {
    if s.len() < STREAM_MIN_ELEMS {
        return 0;
    }
    s.as_ptr().align_offset(64).min(s.len())
}

/// `scalar::cast_f32_to_bf16`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) fn cast_f32_to_bf16(src: &[f32], dst: &mut [u16]) {
    let n = src.len();
    assert_eq!(dst.len(), n);
    let stream = n >= STREAM_MIN_ELEMS;
    let mut i = stream_head(dst);
    scalar::cast_f32_to_bf16(&src[..i], &mut dst[..i]);
    while i + STEP <= n {
        let lo = round_bf16(load_f32(src, i));
        let hi = round_bf16(load_f32(src, i + LANES));
        store_bf16x32(dst, i, pack_bf16(lo, hi), stream);
        i += STEP;
    }
    scalar::cast_f32_to_bf16(&src[i..], &mut dst[i..]);
    if stream {
        _mm_sfence();
    }
}

/// `AdamWConsts` broadcast to all lanes.
struct Consts {
    decay: __m512,
    b1c: __m512,
    beta2: __m512,
    b2c: __m512,
    neg_step_size: __m512,
    bc2_sqrt: __m512,
    eps: __m512,
    grad_scale: __m512,
}

impl Consts {
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn new(c: &AdamWConsts) -> Consts {
        Consts {
            decay: _mm512_set1_ps(c.decay),
            b1c: _mm512_set1_ps(c.b1c),
            beta2: _mm512_set1_ps(c.beta2),
            b2c: _mm512_set1_ps(c.b2c),
            neg_step_size: _mm512_set1_ps(c.neg_step_size),
            bc2_sqrt: _mm512_set1_ps(c.bc2_sqrt),
            eps: _mm512_set1_ps(c.eps),
            grad_scale: _mm512_set1_ps(c.grad_scale),
        }
    }
}

/// `scalar::adamw_elem` on elements `i..i + 16`; returns the updated parameters.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn adamw16(
    k: &Consts,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: __m512,
    i: usize,
) -> __m512 {
    let g = _mm512_mul_ps(grad, k.grad_scale);
    let decayed = _mm512_mul_ps(load_f32(p, i), k.decay);
    let m_old = load_f32(m, i);
    let m_new = _mm512_fmadd_ps(k.b1c, _mm512_sub_ps(g, m_old), m_old);
    let v_new = _mm512_fmadd_ps(
        _mm512_mul_ps(k.b2c, g),
        g,
        _mm512_mul_ps(load_f32(v, i), k.beta2),
    );
    let denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v_new), k.bc2_sqrt), k.eps);
    let update = _mm512_div_ps(_mm512_mul_ps(k.neg_step_size, m_new), denom);
    let p_new = _mm512_add_ps(decayed, update);
    store_f32(p, i, p_new);
    store_f32(m, i, m_new);
    store_f32(v, i, v_new);
    p_new
}

/// `scalar::adamw`.
#[target_feature(enable = "avx512f,avx2,fma")]
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
    let stream = out.is_some() && n >= STREAM_MIN_ELEMS;
    let mut i = out.as_deref().map_or(0, stream_head);
    let out_head = out.as_deref_mut().map(|o| &mut o[..i]);
    scalar::adamw(
        c,
        &mut p[..i],
        &mut m[..i],
        &mut v[..i],
        grad.range(0..i),
        out_head,
    );
    while i + STEP <= n {
        let lo = adamw16(&k, p, m, v, load_grad(grad, i), i);
        let hi = adamw16(&k, p, m, v, load_grad(grad, i + LANES), i + LANES);
        if let Some(out) = out.as_deref_mut() {
            store_bf16x32(out, i, pack_bf16(round_bf16(lo), round_bf16(hi)), stream);
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
    if stream {
        _mm_sfence();
    }
}

/// `scalar::add_assign`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) fn add_assign(dst: &mut [f32], src: GradSlice<'_>) {
    let n = dst.len();
    assert_eq!(src.len(), n);
    let mut i = 0;
    while i + LANES <= n {
        store_f32(dst, i, _mm512_add_ps(load_f32(dst, i), load_grad(src, i)));
        i += LANES;
    }
    scalar::add_assign(&mut dst[i..], src.range(i..n));
}

/// `scalar::sum_squares`, with 4 × 8 f64 accumulator lanes (added in another order).
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) fn sum_squares(x: GradSlice<'_>) -> f64 {
    let n = x.len();
    let mut acc = [_mm512_setzero_pd(); 4];
    let mut i = 0;
    while i + STEP <= n {
        for (half, pair) in acc.chunks_exact_mut(2).enumerate() {
            let f = load_grad(x, i + half * LANES);
            let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
            let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(f),
            )));
            // The f64 square of an f32 is exact, so the FMA rounds like `sum + square`.
            pair[0] = _mm512_fmadd_pd(lo, lo, pair[0]);
            pair[1] = _mm512_fmadd_pd(hi, hi, pair[1]);
        }
        i += STEP;
    }
    let total = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
    let mut lanes = [0.0f64; 8];
    // SAFETY: `lanes` is 8 writable f64; unaligned stores are allowed.
    unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), total) };
    lanes.iter().sum::<f64>() + scalar::sum_squares(x.range(i..n))
}
