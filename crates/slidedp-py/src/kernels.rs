//! `slidedp._native.Kernels`: the SIMD kernels over caller-owned CPU buffers.
//!
//! Buffers arrive as raw addresses of contiguous CPU tensors. The only caller is
//! `slidedp/kernels.py`, which checks device, dtype, contiguity and length and keeps the tensors
//! referenced for the whole call; here we check null, alignment and overlap before making slices.

use pyo3::prelude::*;
use slidedp_core::Error;
use slidedp_core::kernels::{AdamWStep, GradSlice, Isa, Kernels};

use crate::gate::{gate, to_py_err};

/// One buffer argument: address, element count, element size, and whether the kernel writes it.
#[derive(Clone, Copy)]
struct Buffer {
    address: usize,
    numel: usize,
    elem_bytes: usize,
    written: bool,
}

impl Buffer {
    fn end(&self) -> usize {
        self.address + self.numel * self.elem_bytes
    }
}

/// Rejects null or misaligned addresses and any written buffer that overlaps another buffer.
fn check(buffers: &[Buffer]) -> slidedp_core::Result<()> {
    for b in buffers {
        if b.numel > 0 && (b.address == 0 || b.address % b.elem_bytes != 0) {
            return Err(Error::InvalidArgument(format!(
                "buffer at {:#x} is null or not {}-byte aligned",
                b.address, b.elem_bytes
            )));
        }
    }
    for (i, a) in buffers.iter().enumerate() {
        for b in &buffers[i + 1..] {
            let overlap = a.address < b.end() && b.address < a.end() && a.numel > 0 && b.numel > 0;
            if overlap && (a.written || b.written) {
                return Err(Error::InvalidArgument(
                    "an output buffer overlaps another buffer".into(),
                ));
            }
        }
    }
    Ok(())
}

fn elem_bytes(dtype: &str) -> slidedp_core::Result<usize> {
    match dtype {
        "float32" => Ok(4),
        "bfloat16" => Ok(2),
        other => Err(Error::InvalidArgument(format!(
            "dtype must be float32 or bfloat16, got {other}"
        ))),
    }
}

/// # Safety
/// `b` passed [`check`] and describes memory that stays alive and unaliased by writers for `'a`.
unsafe fn read<'a>(b: Buffer) -> GradSlice<'a> {
    if b.numel == 0 {
        return if b.elem_bytes == 4 {
            GradSlice::F32(&[])
        } else {
            GradSlice::Bf16(&[])
        };
    }
    // SAFETY: non-null, aligned, live and not written concurrently (caller's contract).
    unsafe {
        if b.elem_bytes == 4 {
            GradSlice::F32(std::slice::from_raw_parts(b.address as *const f32, b.numel))
        } else {
            GradSlice::Bf16(std::slice::from_raw_parts(b.address as *const u16, b.numel))
        }
    }
}

/// # Safety
/// As for [`read`], and no other slice of this memory exists during `'a`.
unsafe fn write<'a, T>(b: Buffer) -> &'a mut [T] {
    if b.numel == 0 {
        return &mut [];
    }
    // SAFETY: non-null, aligned, live, exclusive (caller's contract; overlap was rejected).
    unsafe { std::slice::from_raw_parts_mut(b.address as *mut T, b.numel) }
}

fn f32_out(address: usize, numel: usize) -> Buffer {
    Buffer {
        address,
        numel,
        elem_bytes: 4,
        written: true,
    }
}

#[pyclass(frozen, name = "Kernels", module = "slidedp._native")]
pub struct PyKernels {
    pub(crate) inner: Kernels,
}

#[pymethods]
impl PyKernels {
    /// A kernel set on `threads` threads; `isa` forces a path ("scalar", "avx2", "avx512").
    #[new]
    #[pyo3(signature = (threads, isa=None))]
    fn new(py: Python<'_>, threads: usize, isa: Option<&str>) -> PyResult<Self> {
        let isa = match isa {
            None => Isa::detect(),
            Some(name) => Isa::parse(name).ok_or_else(|| {
                to_py_err(py, &Error::InvalidArgument(format!("unknown ISA '{name}'")))
            })?,
        };
        let inner = gate(py, || Kernels::new(threads, isa))?;
        Ok(Self { inner })
    }

    /// The best ISA path this CPU supports.
    #[staticmethod]
    fn detect_isa() -> &'static str {
        Isa::detect().name()
    }

    #[staticmethod]
    fn supported_isas() -> Vec<&'static str> {
        Isa::all_supported().into_iter().map(Isa::name).collect()
    }

    #[getter]
    fn isa(&self) -> &'static str {
        self.inner.isa().name()
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    fn cast_f32_to_bf16(
        &self,
        py: Python<'_>,
        src: usize,
        dst: usize,
        numel: usize,
    ) -> PyResult<()> {
        let src = Buffer {
            address: src,
            numel,
            elem_bytes: 4,
            written: false,
        };
        let dst = Buffer {
            address: dst,
            numel,
            elem_bytes: 2,
            written: true,
        };
        gate(py, || {
            check(&[src, dst])?;
            // SAFETY: checked above; the Python wrapper keeps both tensors alive for the call.
            let (GradSlice::F32(src), dst) = (unsafe { read(src) }, unsafe { write::<u16>(dst) })
            else {
                unreachable!("a 4-byte buffer is read as f32");
            };
            self.inner.cast_f32_to_bf16(src, dst)
        })
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (param, exp_avg, exp_avg_sq, grad, grad_dtype, numel, *, lr, beta1, beta2,
                        eps, weight_decay, step, grad_scale=1.0, bf16_out=None))]
    fn adamw(
        &self,
        py: Python<'_>,
        param: usize,
        exp_avg: usize,
        exp_avg_sq: usize,
        grad: usize,
        grad_dtype: &str,
        numel: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        step: u64,
        grad_scale: f64,
        bf16_out: Option<usize>,
    ) -> PyResult<()> {
        let hp = AdamWStep {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
            grad_scale,
        };
        gate(py, || {
            let grad = Buffer {
                address: grad,
                numel,
                elem_bytes: elem_bytes(grad_dtype)?,
                written: false,
            };
            let mut buffers = vec![
                f32_out(param, numel),
                f32_out(exp_avg, numel),
                f32_out(exp_avg_sq, numel),
                grad,
            ];
            if let Some(out) = bf16_out {
                buffers.push(Buffer {
                    address: out,
                    numel,
                    elem_bytes: 2,
                    written: true,
                });
            }
            check(&buffers)?;
            // SAFETY: checked above (disjoint written buffers); the wrapper keeps them alive.
            unsafe {
                self.inner.adamw(
                    &hp,
                    write(buffers[0]),
                    write(buffers[1]),
                    write(buffers[2]),
                    read(grad),
                    buffers.get(4).map(|&b| write::<u16>(b)),
                )
            }
        })
    }

    /// dst = (accumulate ? dst : 0) + Σ srcs, srcs given as (address, dtype) pairs.
    fn sum_into(
        &self,
        py: Python<'_>,
        dst: usize,
        srcs: Vec<(usize, String)>,
        numel: usize,
        accumulate: bool,
    ) -> PyResult<()> {
        gate(py, || {
            let mut buffers = vec![f32_out(dst, numel)];
            for (address, dtype) in &srcs {
                buffers.push(Buffer {
                    address: *address,
                    numel,
                    elem_bytes: elem_bytes(dtype)?,
                    written: false,
                });
            }
            check(&buffers)?;
            // SAFETY: checked above; the wrapper keeps every tensor alive for the call.
            let inputs: Vec<GradSlice<'_>> =
                buffers[1..].iter().map(|&b| unsafe { read(b) }).collect();
            // SAFETY: as above; `dst` overlaps no input.
            self.inner
                .sum_into(unsafe { write(buffers[0]) }, &inputs, accumulate)
        })
    }

    fn sum_squares(&self, py: Python<'_>, src: usize, dtype: &str, numel: usize) -> PyResult<f64> {
        gate(py, || {
            let src = Buffer {
                address: src,
                numel,
                elem_bytes: elem_bytes(dtype)?,
                written: false,
            };
            check(&[src])?;
            // SAFETY: checked above; the wrapper keeps the tensor alive for the call.
            Ok(self.inner.sum_squares(unsafe { read(src) }))
        })
    }
}
