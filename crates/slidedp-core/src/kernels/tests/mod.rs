//! Kernel tests: every ISA bit-exact against scalar (`exact`), scalar against independent
//! references (`reference`), the API's errors (here), and an ignored throughput run (`bench`).

mod bench;
mod exact;
mod reference;

use super::*;

/// Lengths every ISA is checked on: empty, shorter than one vector, around the vector and loop
/// widths of AVX2 (8/16) and AVX-512 (16/32), and more than 4 chunks with a 1-element last one.
const LENGTHS: [usize; 11] = [0, 1, 7, 15, 16, 17, 31, 33, 64, 1000, 4 * CHUNK_ELEMS + 1];

/// Guard value around placed f32 data (not a NaN, so guards compare equal).
const F32_GUARD: f32 = -1234.5;

/// Tiny xorshift64* generator: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn bits32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Random sign, magnitude spread over 2^-27 .. 2^24 (so f32 sums round often).
    fn wide(&mut self) -> f32 {
        let bits = self.bits32();
        f32::from_bits(
            (bits & 0x8000_0000) | ((100 + (bits >> 8) % 50) << 23) | (bits & 0x007F_FFFF),
        )
    }
}

/// Kernels for every ISA this CPU supports, each with 1, 2 and 3 threads.
fn all_kernels() -> Vec<Kernels> {
    let mut kernels = Vec::new();
    for isa in Isa::all_supported() {
        for threads in [1, 2, 3] {
            kernels.push(Kernels::new(threads, isa).unwrap());
        }
    }
    kernels
}

/// A copy of some data placed `offset` elements past a 64-byte boundary, with guard elements on
/// both sides that no kernel may touch.
struct Placed<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
    guard: T,
}

impl<T: Copy + PartialEq + std::fmt::Debug> Placed<T> {
    fn new(data: &[T], offset: usize, guard: T) -> Placed<T> {
        let mut buf = vec![guard; data.len() + offset + 128];
        let start = buf.as_ptr().align_offset(64) + offset;
        buf[start..start + data.len()].copy_from_slice(data);
        Placed {
            buf,
            start,
            len: data.len(),
            guard,
        }
    }

    fn get(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }

    fn get_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }

    /// The window's contents, after checking that the guards are intact.
    fn checked(&self) -> &[T] {
        let (before, rest) = self.buf.split_at(self.start);
        let after = &rest[self.len..];
        assert!(
            before.iter().chain(after).all(|&g| g == self.guard),
            "a guard element was overwritten"
        );
        self.get()
    }
}

/// Asserts `got` and `want` are bit-identical, naming the first difference.
fn assert_bits_eq<T: Copy + PartialEq + std::fmt::Debug>(got: &[T], want: &[T], context: &str) {
    if got == want {
        return;
    }
    assert_eq!(got.len(), want.len(), "{context}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{context}: element {i} of {}: got {:?}, want {:?}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// The bit patterns of `x`, without a copy (so debug-mode tests compare them with a memcmp).
fn f32_bits(x: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment, and every bit pattern is a valid u32.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u32>(), x.len()) }
}

fn to_bf16(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| scalar::f32_to_bf16(v)).collect()
}

fn hp(step: u64) -> AdamWStep {
    AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        grad_scale: 1.0,
    }
}

#[test]
fn isa_names_parse_back() {
    for isa in Isa::ALL {
        assert_eq!(Isa::parse(isa.name()), Some(isa));
    }
    assert_eq!(Isa::parse("AVX512"), Some(Isa::Avx512));
    assert_eq!(Isa::parse("sse2"), None);
    let supported = Isa::all_supported();
    assert_eq!(supported.first(), Some(&Isa::Scalar));
    assert_eq!(supported.last(), Some(&Isa::detect()));
    let kernels = Kernels::new(2, Isa::detect()).unwrap();
    assert_eq!((kernels.isa(), kernels.threads()), (Isa::detect(), 2));
}

#[test]
fn rejects_zero_threads_and_unsupported_isas() {
    assert!(matches!(
        Kernels::new(0, Isa::Scalar),
        Err(Error::InvalidArgument(_))
    ));
    for isa in Isa::ALL.into_iter().filter(|isa| !isa.is_supported()) {
        match Kernels::new(1, isa) {
            Err(Error::IsaUnsupported { isa: name, best }) => {
                assert_eq!(
                    (name.as_str(), best.as_str()),
                    (isa.name(), Isa::detect().name())
                );
            }
            other => panic!("{isa:?} on a CPU without it: {other:?}"),
        }
    }
}

fn assert_mismatch<T: std::fmt::Debug>(result: Result<T>, what: &str, expected: usize, got: usize) {
    match result {
        Err(Error::LengthMismatch {
            what: w,
            expected: e,
            got: g,
        }) => {
            assert_eq!((w, e, g), (what, expected, got));
        }
        other => panic!("expected a length mismatch on {what}, got {other:?}"),
    }
}

#[test]
fn rejects_length_mismatches() {
    let k = Kernels::new(1, Isa::detect()).unwrap();
    let (mut p, mut m, mut v, g) = (
        vec![1.0f32; 8],
        vec![0.0f32; 8],
        vec![0.0f32; 8],
        vec![0.5f32; 8],
    );
    let (short, mut out7) = (vec![0.5f32; 7], vec![0u16; 7]);
    assert_mismatch(k.cast_f32_to_bf16(&p, &mut out7), "dst", 8, 7);
    let grad = GradSlice::F32(&g);
    assert_mismatch(
        k.adamw(&hp(1), &mut p, &mut m[..7], &mut v, grad, None),
        "exp_avg",
        8,
        7,
    );
    assert_mismatch(
        k.adamw(&hp(1), &mut p, &mut m, &mut v[..7], grad, None),
        "exp_avg_sq",
        8,
        7,
    );
    let short_grad = GradSlice::F32(&short);
    assert_mismatch(
        k.adamw(&hp(1), &mut p, &mut m, &mut v, short_grad, None),
        "grad",
        8,
        7,
    );
    assert_mismatch(
        k.adamw(&hp(1), &mut p, &mut m, &mut v, grad, Some(&mut out7)),
        "bf16_out",
        8,
        7,
    );
    assert_mismatch(k.sum_into(&mut p, &[grad, short_grad], true), "srcs", 8, 7);
    assert_eq!(p, vec![1.0; 8], "a rejected call must not write");
}

#[test]
fn rejects_bad_hyperparameters() {
    let k = Kernels::new(1, Isa::detect()).unwrap();
    let bad = [
        AdamWStep { step: 0, ..hp(1) },
        AdamWStep {
            lr: f64::NAN,
            ..hp(1)
        },
        AdamWStep {
            eps: f64::INFINITY,
            ..hp(1)
        },
        AdamWStep {
            grad_scale: f64::NEG_INFINITY,
            ..hp(1)
        },
        AdamWStep { lr: -1e-3, ..hp(1) },
        AdamWStep {
            weight_decay: -0.1,
            ..hp(1)
        },
        AdamWStep {
            beta1: 1.0,
            ..hp(1)
        },
        AdamWStep {
            beta2: -0.5,
            ..hp(1)
        },
        AdamWStep {
            lr: 1e39,
            weight_decay: 0.0,
            ..hp(1)
        },
    ];
    for hp in bad {
        let (mut p, mut m, mut v) = (vec![1.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 4]);
        let result = k.adamw(
            &hp,
            &mut p,
            &mut m,
            &mut v,
            GradSlice::Bf16(&[0x3F80; 4]),
            None,
        );
        assert!(
            matches!(result, Err(Error::InvalidArgument(_))),
            "{hp:?}: {result:?}"
        );
        assert_eq!(p, vec![1.0; 4], "a rejected call must not write");
    }
}

#[test]
fn empty_inputs_are_no_ops() {
    for k in all_kernels() {
        k.cast_f32_to_bf16(&[], &mut []).unwrap();
        k.adamw(
            &hp(1),
            &mut [],
            &mut [],
            &mut [],
            GradSlice::F32(&[]),
            Some(&mut []),
        )
        .unwrap();
        k.sum_into(&mut [], &[GradSlice::Bf16(&[])], false).unwrap();
        assert_eq!(
            k.sum_squares(GradSlice::F32(&[])).to_bits(),
            0.0f64.to_bits()
        );
    }
}
