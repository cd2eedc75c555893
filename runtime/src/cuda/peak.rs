//! The GPU's roofline limits ([`crate::roofline`]), measured on the executor's stream and
//! cuBLAS handle (so in the run's math mode: TF32 tensor cores unless `--no-tf32`): the memory
//! bandwidth of a device-to-device copy of half a temporary buffer into its other half, and
//! the rate of a square product (n up to 8192) through `cublasGemmEx` (bf16 operands and
//! result, f32 accumulation, as the run's bf16 products) or `cublasSgemm` (f32). The buffer (at
//! most 1 GiB, less when less is free) is allocated for the measurement and freed after it;
//! times come from CUDA events around several repetitions after a warm-up.

use std::ffi::c_void;

use cudarc::cublas::sys as blas;
use cudarc::driver::sys;
use fusec_ir::DType;

use super::device::{ck, ckb};
use super::CudaExecutor;
use crate::roofline::Limits;

/// The most the measurement allocates.
const MAX_BYTES: u64 = 1 << 30;
/// Free memory left alone (other processes, the driver's own needs).
const MARGIN: u64 = 256 << 20;
/// Timed repetitions of each measurement.
const REPS: u32 = 10;

/// A temporary device buffer and two events; freed on drop.
struct Scratch {
    ptr: u64,
    events: [sys::CUevent; 2],
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: created by `CudaExecutor::measure` and no longer in use (the stream was
        // synchronized, or an error ended the measurement).
        unsafe {
            let _ = cudarc::driver::result::free_sync(self.ptr);
            for e in self.events {
                let _ = sys::cuEventDestroy_v2(e);
            }
        }
    }
}

impl CudaExecutor {
    /// Both limits for products of `operands` (bf16, or f32 in the handle's math mode).
    pub(crate) fn measure(&self, operands: DType) -> Result<Limits, String> {
        let d = &self.dev;
        d.bind()?;
        d.sync("before measuring the limits")?;
        let free = d.free_bytes()?;
        let bytes = MAX_BYTES.min(free.saturating_sub(MARGIN)) & !((1 << 20) - 1);
        if bytes < 64 << 20 {
            return Err(format!(
                "{:.0} MiB of GPU memory free, too little to measure the limits: give --peak-gbps and --peak-tflops",
                free as f64 / 1048576.0
            ));
        }
        let ev = || cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("event: {e:?}"));
        let (e0, e1) = (ev()?, ev()?);
        // SAFETY: a plain allocation, freed by `Scratch`'s drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes as usize) }.map_err(|e| {
            // SAFETY: unused events.
            unsafe {
                let _ = (sys::cuEventDestroy_v2(e0), sys::cuEventDestroy_v2(e1));
            }
            format!("allocating {} MiB to measure the limits: {e:?}", bytes >> 20)
        })?;
        let s = Scratch { ptr, events: [e0, e1] };
        // Small values (1/64 as bf16 pairs or f32): no infinities, no denormals.
        let (fill, width) = if operands == DType::BF16 { (0x3c80_3c80u32, 2u64) } else { (0x3c80_0000, 4) };
        // SAFETY: inside the buffer.
        unsafe { ck(sys::cuMemsetD32Async(ptr, fill, (bytes / 4) as usize, d.stream), "memset")? };

        let half = bytes / 2;
        // SAFETY: both halves lie inside the buffer.
        let copy = self.timed(&s, || unsafe { ck(sys::cuMemcpyDtoDAsync_v2(ptr + half, ptr, half as usize, d.stream), "copy") })?;
        let bytes_per_s = 2.0 * half as f64 * REPS as f64 / copy;

        let mut n: u64 = 8192;
        while 3 * n * n * width > bytes {
            n -= 1024;
        }
        let (a, b, c) = (ptr, ptr + n * n * width, ptr + 2 * n * n * width);
        let (ni, one, zero) = (n as i32, 1f32, 0f32);
        let nn = blas::cublasOperation_t::CUBLAS_OP_N;
        let gemm = || {
            // SAFETY: three n × n matrices inside the buffer; the handle works on the stream.
            unsafe {
                if operands == DType::BF16 {
                    let (t, al, be) =
                        (blas::cudaDataType::CUDA_R_16BF, &one as *const f32 as *const c_void, &zero as *const f32 as *const c_void);
                    let (compute, alg) = (blas::cublasComputeType_t::CUBLAS_COMPUTE_32F, blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT);
                    let (pa, pb, pc) = (a as *const c_void, b as *const c_void, c as *mut c_void);
                    ckb(
                        blas::cublasGemmEx(d.blas, nn, nn, ni, ni, ni, al, pa, t, ni, pb, t, ni, be, pc, t, ni, compute, alg),
                        "cublasGemmEx",
                    )
                } else {
                    let (pa, pb, pc) = (a as *const f32, b as *const f32, c as *mut f32);
                    ckb(blas::cublasSgemm_v2(d.blas, nn, nn, ni, ni, ni, &one, pa, ni, pb, ni, &zero, pc, ni), "cublasSgemm")
                }
            }
        };
        let secs = self.timed(&s, gemm)?;
        let flops_per_s = 2.0 * (n * n * n) as f64 * REPS as f64 / secs;
        drop(s);
        Ok(Limits { bytes_per_s, flops_per_s })
    }

    /// Seconds of [`REPS`] runs of `f` on the stream after one warm-up, by the scratch's events.
    fn timed(&self, s: &Scratch, f: impl Fn() -> Result<(), String>) -> Result<f64, String> {
        let stream = self.dev.stream;
        f()?;
        // SAFETY: events of this context recorded on its stream; waited for before reading.
        unsafe {
            ck(sys::cuEventRecord(s.events[0], stream), "event")?;
            for _ in 0..REPS {
                f()?;
            }
            ck(sys::cuEventRecord(s.events[1], stream), "event")?;
            self.dev.sync("measuring the limits")?;
            let ms = cudarc::driver::result::event::elapsed(s.events[0], s.events[1]).map_err(|e| format!("event: {e:?}"))?;
            Ok((ms as f64 / 1e3).max(1e-9))
        }
    }
}
