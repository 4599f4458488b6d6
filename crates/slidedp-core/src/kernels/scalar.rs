//! Scalar reference kernels. They DEFINE the math: the SIMD paths reproduce every elementwise
//! result bit for bit (and call these functions for their short heads and tails).

use super::{AdamWStep, GradSlice};
use crate::error::{Error, Result};

/// bf16 bits → f32; exact, since bf16 is the upper half of an f32.
#[inline]
pub(super) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 → bf16 bits, rounded to nearest even exactly like PyTorch's
/// `c10::detail::round_to_nearest_even` (the wrapping add handles ±inf, ±0, denormals and ties);
/// a NaN stays a quiet NaN, keeping its sign and the top of its payload.
#[inline]
pub(super) fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        ((bits >> 16) as u16) | 0x0040
    } else {
        (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
    }
}

/// The f32 constants of one AdamW call: derived in f64, rounded to f32 once (as torch's
/// single-tensor AdamW does with Python floats).
#[derive(Clone, Copy, Debug)]
pub(super) struct AdamWConsts {
    /// `1 - lr * weight_decay`.
    pub(super) decay: f32,
    /// `1 - beta1`.
    pub(super) b1c: f32,
    pub(super) beta2: f32,
    /// `1 - beta2`.
    pub(super) b2c: f32,
    /// `-(lr / (1 - beta1^step))`; the negation is exact.
    pub(super) neg_step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub(super) bc2_sqrt: f32,
    pub(super) eps: f32,
    pub(super) grad_scale: f32,
}

impl AdamWConsts {
    /// Checks `hp` (torch's ranges, finite values, step >= 1) and derives the constants.
    pub(super) fn new(hp: &AdamWStep) -> Result<AdamWConsts> {
        let invalid = |msg: String| Err(Error::InvalidArgument(format!("AdamW: {msg}")));
        if hp.step == 0 {
            return invalid("step is 1-based, got 0".into());
        }
        let finite = [
            ("lr", hp.lr),
            ("beta1", hp.beta1),
            ("beta2", hp.beta2),
            ("eps", hp.eps),
            ("weight_decay", hp.weight_decay),
            ("grad_scale", hp.grad_scale),
        ];
        if let Some((name, value)) = finite.iter().find(|(_, value)| !value.is_finite()) {
            return invalid(format!("{name} must be finite, got {value}"));
        }
        let non_negative = [
            ("lr", hp.lr),
            ("eps", hp.eps),
            ("weight_decay", hp.weight_decay),
        ];
        if let Some((name, value)) = non_negative.iter().find(|(_, value)| *value < 0.0) {
            return invalid(format!("{name} must be >= 0, got {value}"));
        }
        let betas = [("beta1", hp.beta1), ("beta2", hp.beta2)];
        if let Some((name, value)) = betas.iter().find(|(_, value)| !(0.0..1.0).contains(value)) {
            return invalid(format!("{name} must be in [0, 1), got {value}"));
        }
        let step = hp.step as f64;
        let consts = AdamWConsts {
            decay: (1.0 - hp.lr * hp.weight_decay) as f32,
            b1c: (1.0 - hp.beta1) as f32,
            beta2: hp.beta2 as f32,
            b2c: (1.0 - hp.beta2) as f32,
            neg_step_size: -((hp.lr / (1.0 - hp.beta1.powf(step))) as f32),
            bc2_sqrt: (1.0 - hp.beta2.powf(step)).sqrt() as f32,
            eps: hp.eps as f32,
            grad_scale: hp.grad_scale as f32,
        };
        if !(consts.decay.is_finite() && consts.neg_step_size.is_finite()) {
            return invalid(format!(
                "{hp:?} overflows f32 (1 - lr*weight_decay or the step size)"
            ));
        }
        Ok(consts)
    }
}

/// One AdamW update of one element; `grad` is the unscaled gradient. Each line rounds exactly as
/// the torch op named beside it does on CPU (checked bit for bit against torch 2.15's ops over 12
/// steps). torch's own f32 `sqrt` is not always correctly rounded (MKL/Sleef builds); this one is,
/// so torch.optim.AdamW's single-tensor path can differ from it by an ulp on a few elements.
#[inline]
pub(super) fn adamw_elem(c: &AdamWConsts, p: &mut f32, m: &mut f32, v: &mut f32, grad: f32) {
    let g = grad * c.grad_scale; // clip_grad_norm_'s grad.mul_(coef)
    let decayed = *p * c.decay; // param.mul_(1 - lr * weight_decay)
    *m = c.b1c.mul_add(g - *m, *m); // exp_avg.lerp_(grad, 1 - beta1)
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    *v = (c.b2c * g).mul_add(g, *v * c.beta2);
    // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    let denom = v.sqrt() / c.bc2_sqrt + c.eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size): torch evaluates `self + value * t1 / t2`
    // as `self + (value * t1) / t2`, unfused.
    *p = decayed + (c.neg_step_size * *m) / denom;
}

/// `dst[i] = bf16(src[i])`.
pub(super) fn cast_f32_to_bf16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16(s);
    }
}

/// AdamW over equally long slices; with `out`, `out[i] = bf16(p[i])` after the update.
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
    for (i, ((p, m), v)) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).enumerate() {
        adamw_elem(c, p, m, v, grad.at(i));
        if let Some(out) = out.as_deref_mut() {
            out[i] = f32_to_bf16(*p);
        }
    }
}

/// `dst[i] += src[i]` in f32.
pub(super) fn add_assign(dst: &mut [f32], src: GradSlice<'_>) {
    assert_eq!(dst.len(), src.len());
    match src {
        GradSlice::F32(src) => dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s),
        GradSlice::Bf16(src) => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d += bf16_to_f32(s)),
    }
}

/// `dst[i] = src[i]`, widened exactly: a copy, so every ISA uses this one (no rounding to
/// reproduce; the compiler vectorizes it).
pub(super) fn widen_into(dst: &mut [f32], src: GradSlice<'_>) {
    assert_eq!(dst.len(), src.len());
    match src {
        GradSlice::F32(src) => dst.copy_from_slice(src),
        GradSlice::Bf16(src) => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = bf16_to_f32(s)),
    }
}

/// `Σ x[i]²`, added in index order in f64.
pub(super) fn sum_squares(x: GradSlice<'_>) -> f64 {
    let square = |v: f32| f64::from(v) * f64::from(v);
    match x {
        GradSlice::F32(x) => x.iter().fold(0.0, |sum, &v| sum + square(v)),
        GradSlice::Bf16(x) => x.iter().fold(0.0, |sum, &v| sum + square(bf16_to_f32(v))),
    }
}
