//! The kernels against independent references: the cast against `half` (round to nearest even,
//! like torch), AdamW against torch's ops and against the same formula in f64, sum_squares
//! against exact integer sums.

use super::*;

/// Whether bf16 `b` is a NaN (exponent all ones, mantissa not zero).
fn is_bf16_nan(b: u16) -> bool {
    b & 0x7F80 == 0x7F80 && b & 0x007F != 0
}

/// Checks the cast of `src` on every kernel against `half::bf16::from_f32` (NaN: any NaN of the
/// same sign) and, where given, against a hand-computed result.
fn check_cast_against_half(src: &[f32], known: &[(u32, u16)]) {
    for k in all_kernels() {
        let mut dst = vec![0u16; src.len()];
        k.cast_f32_to_bf16(src, &mut dst).unwrap();
        for (&x, &got) in src.iter().zip(&dst) {
            let context = format!(
                "{:?}/{}: cast of {:#010x} gave {got:#06x}",
                k.isa(),
                k.threads(),
                x.to_bits()
            );
            if x.is_nan() {
                assert!(is_bf16_nan(got), "{context}, not a NaN");
                assert_eq!(got >> 15, (x.to_bits() >> 31) as u16, "{context}: sign");
            } else {
                assert_eq!(
                    got,
                    half::bf16::from_f32(x).to_bits(),
                    "{context}, half disagrees"
                );
            }
            if let Some(&(_, want)) = known.iter().find(|(bits, _)| *bits == x.to_bits()) {
                assert_eq!(got, want, "{context}, want {want:#06x}");
            }
        }
    }
}

#[test]
fn cast_matches_half_on_special_values() {
    let known: [(u32, u16); 24] = [
        (0x0000_0000, 0x0000), // +0
        (0x8000_0000, 0x8000), // -0
        (0x7F80_0000, 0x7F80), // +inf
        (0xFF80_0000, 0xFF80), // -inf
        (0x0000_0001, 0x0000), // smallest denormal: rounds to +0
        (0x8000_0001, 0x8000), // ... and to -0
        (0x007F_FFFF, 0x0080), // largest denormal: rounds up to the smallest normal
        (0x807F_FFFF, 0x8080),
        (0x0001_0000, 0x0001), // smallest bf16 denormal, exact
        (0x0080_0000, 0x0080), // smallest normal
        (0x7F7F_FFFF, 0x7F80), // f32::MAX rounds to +inf
        (0xFF7F_FFFF, 0xFF80),
        (0x3F80_8000, 0x3F80), // tie, even below: down
        (0x3F81_8000, 0x3F82), // tie, odd below: up
        (0xBF80_8000, 0xBF80),
        (0xBF81_8000, 0xBF82),
        (0x0000_8000, 0x0000), // denormal ties
        (0x0001_8000, 0x0002),
        (0x7F7F_8000, 0x7F80), // tie at the top: up to inf
        (0x7F7E_8000, 0x7F7E), // ... or down to even
        (0x3F80_8001, 0x3F81), // just above a tie
        (0x3F80_7FFF, 0x3F80), // just below a tie
        (0x3F80_0000, 0x3F80), // 1.0, exact
        (0x4049_0FDB, 0x4049), // pi
    ];
    let nans = [
        0x7FC0_0000u32,
        0x7F80_0001,
        0xFFC0_0000,
        0xFFFF_FFFF,
        0x7FFF_FFFF,
        0x7F81_0000,
        0xFF80_0001,
    ];
    let patterns: Vec<u32> = known.iter().map(|&(bits, _)| bits).chain(nans).collect();
    // Cycle through enough copies that each value lands in every vector lane and in the tails.
    let src: Vec<f32> = (0..patterns.len() * 33)
        .map(|i| f32::from_bits(patterns[i % patterns.len()]))
        .collect();
    check_cast_against_half(&src, &known);
    let max = f32::MAX.to_bits();
    assert!(
        known.iter().any(|&(bits, _)| bits == max),
        "f32::MAX is covered"
    );
}

#[test]
fn cast_matches_half_on_random_bits() {
    let mut rng = Rng::new(7);
    let src: Vec<f32> = (0..200_003).map(|_| f32::from_bits(rng.bits32())).collect();
    check_cast_against_half(&src, &[]);
}

#[test]
fn adamw_scalar_tracks_an_f64_reference() {
    const STEPS: u64 = 10;
    let hp_at = |step| AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-3,
        weight_decay: 0.1,
        step,
        grad_scale: 0.37,
    };
    let len = 4099;
    let mut rng = Rng::new(8);
    let p0: Vec<f32> = (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect();
    // |grad| in [0.5, 1): the moments stay within a factor 2 of |g|, so m/denom is well
    // conditioned and its relative error stays a small multiple of the f32 roundings.
    let grads: Vec<Vec<f32>> = (0..STEPS)
        .map(|_| {
            (0..len)
                .map(|_| rng.uniform(0.5, 1.0) * if rng.unit() < 0.5 { -1.0 } else { 1.0 })
                .collect()
        })
        .collect();

    let k = Kernels::new(1, Isa::Scalar).unwrap();
    let (mut p, mut m, mut v) = (p0.clone(), vec![0.0f32; len], vec![0.0f32; len]);
    let mut p64: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let (mut m64, mut v64) = (vec![0.0f64; len], vec![0.0f64; len]);
    for (step, g) in (1..=STEPS).zip(&grads) {
        let hp = hp_at(step);
        k.adamw(&hp, &mut p, &mut m, &mut v, GradSlice::F32(g), None)
            .unwrap();
        let bias1 = 1.0 - hp.beta1.powf(step as f64);
        let bias2 = 1.0 - hp.beta2.powf(step as f64);
        for i in 0..len {
            let g = f64::from(g[i]) * hp.grad_scale;
            p64[i] *= 1.0 - hp.lr * hp.weight_decay;
            m64[i] += (1.0 - hp.beta1) * (g - m64[i]);
            v64[i] = hp.beta2 * v64[i] + (1.0 - hp.beta2) * g * g;
            let denom = v64[i].sqrt() / bias2.sqrt() + hp.eps;
            p64[i] -= hp.lr / bias1 * m64[i] / denom;
        }
    }
    // Each step rounds ~12 times, each time by at most u = 2⁻²⁴ relative to a quantity of size
    // <= |g|max (m), <= |g|max² (v), <= |p| (the f32 decay constant, the decay product and the
    // final add: 3 roundings) or <= lr·|m̂/denom| <= 2·lr (the update). Errors add up over the
    // steps and are amplified at most ~2× by m/denom (|g| varies 2×), so 8·u per step for the
    // moments and 3·u·|p| + 64·u·lr for p bound them (the largest error seen is ~1/4 of that),
    // while ~1000× smaller than what a misplaced eps or bias correction changes.
    let u = 2f64.powi(-24);
    let g_max = 0.37;
    let steps = STEPS as f64;
    let mut worst = 0.0f64;
    for i in 0..len {
        let checks = [
            (f64::from(m[i]), m64[i], steps * 8.0 * u * g_max, "exp_avg"),
            (
                f64::from(v[i]),
                v64[i],
                steps * 8.0 * u * g_max * g_max,
                "exp_avg_sq",
            ),
            (
                f64::from(p[i]),
                p64[i],
                steps * (3.0 * u * p64[i].abs() + 64.0 * u * 1e-2),
                "param",
            ),
        ];
        for (got, want, tolerance, what) in checks {
            let error = (got - want).abs();
            assert!(
                error <= tolerance,
                "{what}[{i}]: f32 {got:e}, f64 {want:e}, error {error:e} > {tolerance:e}"
            );
            worst = worst.max(error / tolerance);
        }
    }
    assert!(worst > 0.0, "the f32 and f64 runs should differ somewhere");
}

/// Inputs and results of one AdamW step computed with torch 2.15's CPU ops (`mul_`, `lerp_`,
/// `mul_` + `addcmul_`, `sqrt` (here correctly rounded, in f64), `div`, `add_`, `addcdiv_`) at
/// lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.1, grad_scale 0.37, step 5. The first
/// ten elements are ones where `fma(-step_size, m / denom, p)` rounds differently from torch's
/// `p + (-step_size * m) / denom`.
const TORCH_STEP: [[u32; 12]; 7] = [
    [
        0xBEEC7FB1, 0x3C8BC711, 0xBCD46164, 0xBD741B16, 0xB97398EC, 0xBE5905AE, 0xBD2100AE,
        0x39005A5A, 0xB973E4A7, 0x3CA68C6C, 0x3EACBBC9, 0xBE360B3B,
    ],
    [
        0x3B47543C, 0xBC4F16C0, 0x3D03ED17, 0x3DE6C2DA, 0xBDC2461E, 0x3E0FCD65, 0xBDF3486F,
        0x3E549A97, 0xBE0697A3, 0xBE8B50E4, 0x3D9FCAF5, 0x3CAEE9F7,
    ],
    [
        0x3C202F7F, 0x3BAB6C4D, 0x3BB3E789, 0x3BDE6579, 0x3B98CDA2, 0x3C0C6BD7, 0x37CE8CCC,
        0x3B3DC38F, 0x3BB660AF, 0x3BCC2F8A, 0x3C15ECB4, 0x3B85042B,
    ],
    [
        0x3ED813DE, 0xBFB2C10E, 0x3F66760A, 0x3FACEC3A, 0x3F8FFC20, 0x3F41B221, 0xBE647161,
        0xBD8752E7, 0xBFA84A31, 0x3E984712, 0xBFC2424E, 0x3ED6B54F,
    ],
    [
        0xBEEC7DD4, 0x3C8CF738, 0xBCD58938, 0xBD755B70, 0xB901B812, 0xBE594B3A, 0xBD1277C9,
        0xB9F5E5A6, 0x3918BB44, 0x3CAAB780, 0x3EACB418, 0xBE361F29,
    ],
    [
        0x3C9657AC, 0xBD811EB4, 0x3D7F2A9F, 0x3E1B0714, 0xBD333705, 0x3E1E16CD, 0xBDEBDC03,
        0x3E3CD709, 0xBE2AF267, 0xBE6F800E, 0x3C667F5A, 0x3D0E43D1,
    ],
    [
        0x3C206CC2, 0x3BB40019, 0x3BB75C2E, 0x3BE65C79, 0x3B9E53A8, 0x3C0D909C, 0x3803BFB6,
        0x3B3D9D02, 0x3BBDF320, 0x3BCC60DB, 0x3C1AF0DB, 0x3B85AC12,
    ],
];

#[test]
fn adamw_rounds_like_torch_ops() {
    let hp = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 5,
        grad_scale: 0.37,
    };
    // Tiled 6 times so every element also goes through the vector loops of every ISA.
    let column = |row: usize| -> Vec<f32> {
        (0..72)
            .map(|i| f32::from_bits(TORCH_STEP[row][i % 12]))
            .collect()
    };
    for k in all_kernels() {
        let (mut p, mut m, mut v, g) = (column(0), column(1), column(2), column(3));
        k.adamw(&hp, &mut p, &mut m, &mut v, GradSlice::F32(&g), None)
            .unwrap();
        let context = format!("{:?}/{}", k.isa(), k.threads());
        assert_bits_eq(
            f32_bits(&p),
            f32_bits(&column(4)),
            &format!("{context} param"),
        );
        assert_bits_eq(
            f32_bits(&m),
            f32_bits(&column(5)),
            &format!("{context} exp_avg"),
        );
        assert_bits_eq(
            f32_bits(&v),
            f32_bits(&column(6)),
            &format!("{context} exp_avg_sq"),
        );
    }
}

#[test]
fn sum_squares_is_exact_on_integers() {
    let mut rng = Rng::new(9);
    let len = 5 * SUM_SQUARES_BLOCK_ELEMS + 77;
    // Integers |x| <= 256 are exact in bf16 and every partial sum (< 2^53) is exact in f64, so
    // every order of addition gives the exact integer sum.
    let ints: Vec<i64> = (0..len)
        .map(|_| (rng.next_u64() % 513) as i64 - 256)
        .collect();
    let want = ints.iter().map(|x| x * x).sum::<i64>() as f64;
    let x: Vec<f32> = ints.iter().map(|&i| i as f32).collect();
    let x16 = to_bf16(&x);
    for k in all_kernels() {
        for offset in [0, 1, 3] {
            let (xs, x16s) = (&x[offset..], &x16[offset..]);
            let want = want - ints[..offset].iter().map(|x| x * x).sum::<i64>() as f64;
            assert_eq!(
                k.sum_squares(GradSlice::F32(xs)),
                want,
                "{:?}/{} f32 offset {offset}",
                k.isa(),
                k.threads()
            );
            assert_eq!(
                k.sum_squares(GradSlice::Bf16(x16s)),
                want,
                "{:?}/{} bf16 offset {offset}",
                k.isa(),
                k.threads()
            );
        }
    }
}
