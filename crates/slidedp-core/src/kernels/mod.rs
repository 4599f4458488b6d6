//! SIMD kernels of the host engine: the f32 → bf16 cast, the AdamW update (with fused emission of
//! the updated bf16 copy), gradient summation and the sum of squares.
//!
//! `scalar` DEFINES the math; the AVX2 and AVX-512 paths reproduce every elementwise result bit
//! for bit (`sum_squares` alone reassociates its f64 additions inside a block). The ISA is chosen
//! once, when a [`Kernels`] is built, from what the CPU reports at run time; no path needs the
//! binary to be compiled for a particular CPU.
//!
//! Every call runs on the `Kernels`' own thread pool, over chunks of `CHUNK_ELEMS` elements;
//! chunk boundaries change no result. The pool's threads start with the floating-point
//! environment (MXCSR) of the thread that built the `Kernels`; bit-exactness with torch assumes
//! the default one (no flush-to-zero / denormals-are-zero).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod dispatch;
mod scalar;
#[cfg(test)]
mod tests;

use std::{fmt, io, ops::Range};

use rayon::iter::Either;
use rayon::prelude::*;

use crate::error::{Error, Result};
use dispatch::{Supported, adamw_chunk, add_chunk, cast_chunk, sum_squares_block};
use scalar::AdamWConsts;

/// Elements per work item. A multiple of 64, so every chunk starts at the same address modulo 64
/// bytes as its slice does, for f32 and bf16 arrays alike.
const CHUNK_ELEMS: usize = 16 * 1024;

/// Elements per f64 partial of `sum_squares`. A constant (never derived from the thread count),
/// so the partials, and the order they are added in, are the same for any number of threads.
const SUM_SQUARES_BLOCK_ELEMS: usize = 16 * 1024;
// `sum_into_squares` squares each work item of the sum as one of `sum_squares`' blocks.
const _: () = assert!(SUM_SQUARES_BLOCK_ELEMS == CHUNK_ELEMS);

/// An instruction set the kernels can run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable scalar code, the reference every other path must match.
    Scalar,
    /// AVX2 + FMA (8 f32 lanes).
    Avx2,
    /// AVX-512F (16 f32 lanes), with AVX2 + FMA.
    Avx512,
}

impl Isa {
    const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The best instruction set this CPU supports: AVX-512 > AVX2 > scalar.
    pub fn detect() -> Isa {
        [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .find(|isa| isa.is_supported())
            .unwrap_or(Isa::Scalar)
    }

    /// Whether this CPU (and OS) can run this instruction set.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::Avx512 => avx2 && is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// The lowercase name: "scalar", "avx2" or "avx512".
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The instruction set called `name` (as [`Isa::name`] spells it, ASCII case ignored).
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(name))
    }

    /// Every instruction set this CPU supports, scalar first.
    pub fn all_supported() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }
}

/// A gradient (or any read-only input) in f32 or bf16 (raw bf16 bits as u16).
#[derive(Clone, Copy, Debug)]
pub enum GradSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> GradSlice<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GradSlice::F32(s) => s.len(),
            GradSlice::Bf16(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as f32 (bf16 widens exactly).
    fn at(self, i: usize) -> f32 {
        match self {
            GradSlice::F32(s) => s[i],
            GradSlice::Bf16(s) => scalar::bf16_to_f32(s[i]),
        }
    }

    /// The elements in `range`.
    fn range(self, range: Range<usize>) -> GradSlice<'a> {
        match self {
            GradSlice::F32(s) => GradSlice::F32(&s[range]),
            GradSlice::Bf16(s) => GradSlice::Bf16(&s[range]),
        }
    }

    /// Consecutive chunks of `chunk_elems` elements (the last one shorter), in parallel.
    fn par_chunks(self, chunk_elems: usize) -> impl IndexedParallelIterator<Item = GradSlice<'a>> {
        match self {
            GradSlice::F32(s) => Either::Left(s.par_chunks(chunk_elems).map(GradSlice::F32)),
            GradSlice::Bf16(s) => Either::Right(s.par_chunks(chunk_elems).map(GradSlice::Bf16)),
        }
    }
}

/// Hyper-parameters of one AdamW call (torch.optim.AdamW semantics, decoupled weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Decay of the first moment, in [0, 1).
    pub beta1: f64,
    /// Decay of the second moment, in [0, 1).
    pub beta2: f64,
    /// Added to the bias-corrected RMS of the gradient (>= 0).
    pub eps: f64,
    /// Decoupled weight decay (>= 0): the parameter is multiplied by `1 - lr * weight_decay`.
    pub weight_decay: f64,
    /// 1-based step count, for bias correction.
    pub step: u64,
    /// Multiplies the gradient before use; 1.0 = none (used for global-norm clipping).
    pub grad_scale: f64,
}

/// The kernels, bound to one instruction set and a pool of worker threads.
pub struct Kernels {
    isa: Supported,
    threads: usize,
    pool: rayon::ThreadPool,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels")
            .field("isa", &self.isa.isa())
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Kernels {
    /// Starts `threads` (>= 1) worker threads that run the kernels with `isa`, which this CPU
    /// must support.
    pub fn new(threads: usize, isa: Isa) -> Result<Kernels> {
        if threads == 0 {
            return Err(Error::InvalidArgument(
                "kernel thread count must be at least 1, got 0".into(),
            ));
        }
        let Some(supported) = Supported::new(isa) else {
            return Err(Error::IsaUnsupported {
                isa: isa.name().into(),
                best: Isa::detect().name().into(),
            });
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("slidedp-kernel-{i}"))
            .build()
            .map_err(|e| {
                Error::io(
                    format!("starting {threads} kernel threads"),
                    io::Error::other(e),
                )
            })?;
        Ok(Kernels {
            isa: supported,
            threads,
            pool,
        })
    }

    /// The instruction set the kernels run with.
    pub fn isa(&self) -> Isa {
        self.isa.isa()
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// `dst[i] = bf16(src[i])`, rounded to nearest even exactly as PyTorch does (NaN stays a quiet
    /// NaN). On AVX-512 the bulk of `dst` is written with non-temporal stores: it is meant for
    /// DMA staging, not to be read back by the CPU.
    pub fn cast_f32_to_bf16(&self, src: &[f32], dst: &mut [u16]) -> Result<()> {
        check_len("dst", src.len(), dst.len())?;
        let isa = self.isa;
        // Even small inputs run on the pool, so whichever thread calls, the same threads (with
        // the same floating-point environment) compute every call.
        self.pool.install(|| {
            src.par_chunks(CHUNK_ELEMS)
                .zip(dst.par_chunks_mut(CHUNK_ELEMS))
                .for_each(|(s, d)| cast_chunk(isa, s, d));
        });
        Ok(())
    }

    /// Runs `work` on the kernels' pool (its rayon calls use the pool's threads).
    pub(crate) fn install<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        self.pool.install(work)
    }

    /// One AdamW step over `param` with moments `exp_avg` and `exp_avg_sq`, all updated in
    /// place. With `bf16_out`, also writes bf16 of the updated parameters (same rounding as
    /// [`Kernels::cast_f32_to_bf16`], non-temporal stores on AVX-512).
    pub fn adamw(
        &self,
        hp: &AdamWStep,
        param: &mut [f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        grad: GradSlice<'_>,
        bf16_out: Option<&mut [u16]>,
    ) -> Result<()> {
        let consts = AdamWConsts::new(hp)?;
        let n = param.len();
        check_len("exp_avg", n, exp_avg.len())?;
        check_len("exp_avg_sq", n, exp_avg_sq.len())?;
        check_len("grad", n, grad.len())?;
        if let Some(out) = &bf16_out {
            check_len("bf16_out", n, out.len())?;
        }
        let isa = self.isa;
        let out_chunks = match bf16_out {
            Some(out) => Either::Left(out.par_chunks_mut(CHUNK_ELEMS).map(Some)),
            None => Either::Right((0..n.div_ceil(CHUNK_ELEMS)).into_par_iter().map(|_| None)),
        };
        self.pool.install(|| {
            param
                .par_chunks_mut(CHUNK_ELEMS)
                .zip(exp_avg.par_chunks_mut(CHUNK_ELEMS))
                .zip(exp_avg_sq.par_chunks_mut(CHUNK_ELEMS))
                .zip(grad.par_chunks(CHUNK_ELEMS))
                .zip(out_chunks)
                .for_each(|((((p, m), v), g), out)| adamw_chunk(isa, &consts, p, m, v, g, out));
        });
        Ok(())
    }

    /// `dst[i] = dst[i] + srcs[0][i] + srcs[1][i] + ...` (`accumulate`), else
    /// `srcs[0][i] + srcs[1][i] + ...` (no sources: 0), added left to right in f32 (bf16 inputs
    /// widen exactly). The first source is taken as it is, not added to 0: a sum of -0.0 stays
    /// -0.0, as torch's `a + b` keeps it.
    pub fn sum_into(
        &self,
        dst: &mut [f32],
        srcs: &[GradSlice<'_>],
        accumulate: bool,
    ) -> Result<()> {
        self.sum_chunks(dst, srcs, accumulate, false).map(|_| ())
    }

    /// [`Kernels::sum_into`], returning `Σ dst[i]²` of the sum exactly as
    /// [`Kernels::sum_squares`] of `dst` would (its blocks are the sum's work items, squared
    /// while they are in cache): one pass over `dst` instead of two.
    pub fn sum_into_squares(
        &self,
        dst: &mut [f32],
        srcs: &[GradSlice<'_>],
        accumulate: bool,
    ) -> Result<f64> {
        self.sum_chunks(dst, srcs, accumulate, true)
    }

    fn sum_chunks(
        &self,
        dst: &mut [f32],
        srcs: &[GradSlice<'_>],
        accumulate: bool,
        squares: bool,
    ) -> Result<f64> {
        for src in srcs {
            check_len("srcs", dst.len(), src.len())?;
        }
        let (first, rest) = match srcs.split_first() {
            Some((first, rest)) if !accumulate => (Some(*first), rest),
            _ => (None, srcs),
        };
        let isa = self.isa;
        let mut partials = Vec::with_capacity(dst.len().div_ceil(CHUNK_ELEMS));
        self.pool.install(|| {
            dst.par_chunks_mut(CHUNK_ELEMS)
                .enumerate()
                .map(|(c, chunk)| {
                    let range = c * CHUNK_ELEMS..c * CHUNK_ELEMS + chunk.len();
                    match first {
                        Some(src) => scalar::widen_into(chunk, src.range(range.clone())),
                        None if !accumulate => chunk.fill(0.0),
                        None => {}
                    }
                    for src in rest {
                        add_chunk(isa, chunk, src.range(range.clone()));
                    }
                    if squares {
                        sum_squares_block(isa, GradSlice::F32(chunk))
                    } else {
                        0.0
                    }
                })
                .collect_into_vec(&mut partials);
        });
        Ok(partials.iter().fold(0.0, |sum, partial| sum + partial))
    }

    /// `Σ x[i]²`, accumulated in f64 (each f32 square is exact in f64). Blocks of a fixed size
    /// are reduced to f64 partials, added in block order: the result does not depend on the
    /// thread count. Within a block the SIMD paths add in another order than scalar (relative
    /// difference ≤ 2·n·2⁻⁵³).
    pub fn sum_squares(&self, x: GradSlice<'_>) -> f64 {
        let isa = self.isa;
        let mut partials = Vec::with_capacity(x.len().div_ceil(SUM_SQUARES_BLOCK_ELEMS));
        self.pool.install(|| {
            x.par_chunks(SUM_SQUARES_BLOCK_ELEMS)
                .map(|block| sum_squares_block(isa, block))
                .collect_into_vec(&mut partials);
        });
        partials.iter().fold(0.0, |sum, partial| sum + partial)
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}
