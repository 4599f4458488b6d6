//! Every supported ISA, at 1, 2 and 3 threads, bit-exact against the scalar reference functions
//! on every length of `LENGTHS`, with each slice starting 0–3 elements past a 64-byte boundary
//! (different slices at different offsets) and guards around it.

use super::*;

/// Inputs for the cast: random bit patterns (all classes: NaN, inf, denormals, ties are rare but
/// present), with special values sprinkled in so short lengths hit them in vector lanes too.
fn cast_input(len: usize, rng: &mut Rng) -> Vec<f32> {
    let special = [
        0x0000_0000u32,
        0x8000_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0000,
        0x7F80_0001,
        0xFFFF_FFFF,
        0x0000_0001,
        0x807F_FFFF,
        0x7F7F_FFFF,
        0x7F7F_8000,
        0x3F80_8000,
        0x3F81_8000,
        0x0001_8000,
    ];
    (0..len)
        .map(|i| {
            f32::from_bits(if i % 3 == 1 {
                special[(i / 3) % special.len()]
            } else {
                rng.bits32()
            })
        })
        .collect()
}

#[test]
fn cast_is_bit_exact_on_every_isa() {
    let kernels = all_kernels();
    let mut rng = Rng::new(1);
    for len in LENGTHS {
        let src = cast_input(len, &mut rng);
        let mut want = vec![0u16; len];
        scalar::cast_f32_to_bf16(&src, &mut want);
        for k in &kernels {
            for offset in 0..4 {
                let context = format!(
                    "cast {:?}/{} len {len} offset {offset}",
                    k.isa(),
                    k.threads()
                );
                let src = Placed::new(&src, offset, F32_GUARD);
                let mut dst = Placed::new(&vec![0xDEAD; len], (offset + 1) % 4, 0xBEEF);
                k.cast_f32_to_bf16(src.get(), dst.get_mut()).unwrap();
                assert_bits_eq(dst.checked(), &want, &context);
            }
        }
    }
}

/// One AdamW configuration of the exactness test.
#[derive(Clone, Copy, Debug)]
struct Case {
    bf16_grad: bool,
    weight_decay: f64,
    grad_scale: f64,
    bf16_out: bool,
}

const STEPS: u64 = 10;

fn case_hp(case: Case, step: u64) -> AdamWStep {
    AdamWStep {
        lr: 1e-2,
        weight_decay: case.weight_decay,
        grad_scale: case.grad_scale,
        ..hp(step)
    }
}

/// The gradient of `step`: mostly O(1), some exact zeros, and some tiny values whose squares
/// (and moments) are f32 denormals.
fn step_grad(len: usize, step: u64) -> Vec<f32> {
    let mut rng = Rng::new(1000 + step);
    (0..len)
        .map(|i| match i % 11 {
            3 => 0.0,
            7 => rng.uniform(-1e-20, 1e-20),
            _ => rng.uniform(-1.0, 1.0),
        })
        .collect()
}

/// The AdamW state after one step.
struct State {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    out: Vec<u16>,
}

/// The gradient of each step, in f32 and in bf16.
type Grads = [(Vec<f32>, Vec<u16>)];

/// The state after each step, computed by `scalar::adamw`.
fn reference_trajectory(case: Case, p0: &[f32], grads: &Grads) -> Vec<State> {
    let len = p0.len();
    let mut state = State {
        p: p0.to_vec(),
        m: vec![0.0; len],
        v: vec![0.0; len],
        out: vec![0; len],
    };
    (1..=STEPS)
        .zip(grads)
        .map(|(step, (g, g16))| {
            let consts = AdamWConsts::new(&case_hp(case, step)).unwrap();
            let grad = if case.bf16_grad {
                GradSlice::Bf16(g16)
            } else {
                GradSlice::F32(g)
            };
            let State { p, m, v, out } = &mut state;
            scalar::adamw(&consts, p, m, v, grad, Some(out));
            State {
                p: p.clone(),
                m: m.clone(),
                v: v.clone(),
                out: out.clone(),
            }
        })
        .collect()
}

/// Runs `case` from `p0` on `k` with its slices placed at `offset`, comparing each step to `want`.
fn run_case(k: &Kernels, case: Case, p0: &[f32], grads: &Grads, offset: usize, want: &[State]) {
    let len = p0.len();
    let mut p = Placed::new(p0, offset, F32_GUARD);
    let mut m = Placed::new(&vec![0.0; len], (offset + 1) % 4, F32_GUARD);
    let mut v = Placed::new(&vec![0.0; len], (offset + 2) % 4, F32_GUARD);
    let mut out = Placed::new(&vec![0; len], (offset + 3) % 4, 0xBEEF);
    for ((step, want), (g, g16)) in (1..=STEPS).zip(want).zip(grads) {
        let context = format!(
            "adamw {:?}/{} {case:?} len {len} offset {offset} step {step}",
            k.isa(),
            k.threads()
        );
        let g16 = Placed::new(g16, offset, 0xBEEF);
        let g = Placed::new(g, (offset + 2) % 4, F32_GUARD);
        let grad = if case.bf16_grad {
            GradSlice::Bf16(g16.get())
        } else {
            GradSlice::F32(g.get())
        };
        let bf16_out = case.bf16_out.then(|| out.get_mut());
        let hp = case_hp(case, step);
        k.adamw(&hp, p.get_mut(), m.get_mut(), v.get_mut(), grad, bf16_out)
            .unwrap();
        assert_bits_eq(
            f32_bits(p.checked()),
            f32_bits(&want.p),
            &format!("{context} param"),
        );
        assert_bits_eq(
            f32_bits(m.checked()),
            f32_bits(&want.m),
            &format!("{context} exp_avg"),
        );
        assert_bits_eq(
            f32_bits(v.checked()),
            f32_bits(&want.v),
            &format!("{context} exp_avg_sq"),
        );
        let want_out = if case.bf16_out {
            &want.out[..]
        } else {
            &vec![0; len]
        };
        assert_bits_eq(out.checked(), want_out, &format!("{context} bf16_out"));
    }
}

#[test]
fn adamw_is_bit_exact_on_every_isa() {
    let kernels = all_kernels();
    let mut rng = Rng::new(2);
    for len in LENGTHS {
        let p0: Vec<f32> = (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let grads: Vec<(Vec<f32>, Vec<u16>)> = (1..=STEPS)
            .map(|step| {
                let g = step_grad(len, step);
                let g16 = to_bf16(&g);
                (g, g16)
            })
            .collect();
        for bits in 0..16u32 {
            let case = Case {
                bf16_grad: bits & 1 != 0,
                weight_decay: if bits & 2 != 0 { 0.1 } else { 0.0 },
                grad_scale: if bits & 4 != 0 { 0.37 } else { 1.0 },
                bf16_out: bits & 8 != 0,
            };
            let want = reference_trajectory(case, &p0, &grads);
            for k in &kernels {
                // Offsets only matter to the SIMD paths; threads only beyond one chunk.
                let offsets = if k.isa() == Isa::Scalar { 0..1 } else { 0..4 };
                if k.threads() == 1 || len > CHUNK_ELEMS {
                    offsets.for_each(|offset| run_case(k, case, &p0, &grads, offset, &want));
                }
            }
        }
    }
}

#[test]
fn sum_into_is_bit_exact_on_every_isa() {
    let kernels = all_kernels();
    let mut rng = Rng::new(3);
    // Source kinds, per number of sources R = 1, 2, 3 (true = bf16).
    let layouts: [&[bool]; 6] = [
        &[false],
        &[true],
        &[false, true],
        &[true, true],
        &[false, true, false],
        &[true, false, true],
    ];
    for len in LENGTHS {
        let dst0: Vec<f32> = (0..len)
            .map(|i| if i % 5 == 2 { -0.0 } else { rng.wide() })
            .collect();
        // every source is -0.0 at i % 7 == 3: a sum of the sources alone stays -0.0 there
        let f32_srcs: Vec<Vec<f32>> = (0..3)
            .map(|_| {
                (0..len)
                    .map(|i| if i % 7 == 3 { -0.0 } else { rng.wide() })
                    .collect()
            })
            .collect();
        let bf16_srcs: Vec<Vec<u16>> = f32_srcs.iter().map(|s| to_bf16(s)).collect();
        for layout in layouts {
            for accumulate in [false, true] {
                let srcs: Vec<GradSlice<'_>> = layout
                    .iter()
                    .enumerate()
                    .map(|(j, &bf16)| {
                        if bf16 {
                            GradSlice::Bf16(&bf16_srcs[j])
                        } else {
                            GradSlice::F32(&f32_srcs[j])
                        }
                    })
                    .collect();
                let mut want = dst0.clone();
                let added = if accumulate {
                    &srcs[..]
                } else {
                    scalar::widen_into(&mut want, srcs[0]);
                    &srcs[1..]
                };
                added
                    .iter()
                    .for_each(|&src| scalar::add_assign(&mut want, src));
                for k in &kernels {
                    for offset in 0..4 {
                        let context = format!(
                            "sum_into {:?}/{} {layout:?} accumulate {accumulate} len {len} offset {offset}",
                            k.isa(),
                            k.threads()
                        );
                        let placed_f32: Vec<_> = f32_srcs
                            .iter()
                            .enumerate()
                            .map(|(j, s)| Placed::new(s, (offset + j + 1) % 4, F32_GUARD))
                            .collect();
                        let placed_bf16: Vec<_> = bf16_srcs
                            .iter()
                            .enumerate()
                            .map(|(j, s)| Placed::new(s, (offset + j + 2) % 4, 0xBEEF))
                            .collect();
                        let srcs: Vec<GradSlice<'_>> = layout
                            .iter()
                            .enumerate()
                            .map(|(j, &bf16)| {
                                if bf16 {
                                    GradSlice::Bf16(placed_bf16[j].get())
                                } else {
                                    GradSlice::F32(placed_f32[j].get())
                                }
                            })
                            .collect();
                        let mut dst = Placed::new(&dst0, offset, F32_GUARD);
                        k.sum_into(dst.get_mut(), &srcs, accumulate).unwrap();
                        assert_bits_eq(f32_bits(dst.checked()), f32_bits(&want), &context);
                        // fused: the same sum, and its Σ x² as sum_squares gives it
                        let mut fused = Placed::new(&dst0, offset, F32_GUARD);
                        let squares = k
                            .sum_into_squares(fused.get_mut(), &srcs, accumulate)
                            .unwrap();
                        assert_bits_eq(f32_bits(fused.checked()), f32_bits(&want), &context);
                        let apart = k.sum_squares(GradSlice::F32(dst.get()));
                        assert_eq!(squares.to_bits(), apart.to_bits(), "{context}");
                    }
                }
            }
        }
    }
}

#[test]
fn sum_squares_matches_scalar_within_reassociation_error() {
    let kernels = all_kernels();
    let mut rng = Rng::new(4);
    for len in LENGTHS.into_iter().chain([3 * SUM_SQUARES_BLOCK_ELEMS + 5]) {
        let x: Vec<f32> = (0..len).map(|_| rng.wide()).collect();
        let x16 = to_bf16(&x);
        let inputs = [("f32", GradSlice::F32(&x)), ("bf16", GradSlice::Bf16(&x16))];
        for (input, data) in inputs {
            let want = scalar::sum_squares(data);
            // Every square is exact in f64 and non-negative, so each order of addition is within
            // (n - 1)·2⁻⁵³ relative of the exact sum: two orders differ by at most 2·n·2⁻⁵³.
            let tolerance = 2.0 * len as f64 * 2f64.powi(-53) * want;
            for k in &kernels {
                for offset in 0..4 {
                    let got = match data {
                        GradSlice::F32(_) => {
                            k.sum_squares(GradSlice::F32(Placed::new(&x, offset, F32_GUARD).get()))
                        }
                        GradSlice::Bf16(_) => {
                            k.sum_squares(GradSlice::Bf16(Placed::new(&x16, offset, 0xBEEF).get()))
                        }
                    };
                    let context = format!(
                        "sum_squares {:?}/{} {input} len {len} offset {offset}",
                        k.isa(),
                        k.threads()
                    );
                    assert!(
                        (got - want).abs() <= tolerance,
                        "{context}: got {got:e}, want {want:e}"
                    );
                    if k.isa() == Isa::Scalar && len <= SUM_SQUARES_BLOCK_ELEMS {
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{context}: one scalar block is the reference"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn sum_squares_does_not_depend_on_the_thread_count() {
    let mut rng = Rng::new(5);
    let x: Vec<f32> = (0..7 * SUM_SQUARES_BLOCK_ELEMS + 3)
        .map(|_| rng.wide())
        .collect();
    let x16 = to_bf16(&x);
    for isa in Isa::all_supported() {
        for data in [GradSlice::F32(&x), GradSlice::Bf16(&x16)] {
            let results: Vec<u64> = (1..=4)
                .map(|threads| {
                    Kernels::new(threads, isa)
                        .unwrap()
                        .sum_squares(data)
                        .to_bits()
                })
                .collect();
            assert!(
                results.iter().all(|&r| r == results[0]),
                "{isa:?}: {results:x?}"
            );
        }
    }
}
