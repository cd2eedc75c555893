//! cuBLASLt products (TF32 mode): every single (non-batched) product, with the bias and
//! bias + GELU epilogues fused in and accumulation through `C`, and algorithms tuned per shape.
//!
//! - `y = a b` and `y = acc + a b` (beta 1, `C` the accumulator, `D` the result);
//! - `y = a b + bias` (`CUBLASLT_EPILOGUE_BIAS`) and `pre = a b + bias, y = gelu(pre)`
//!   (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`, the tanh form GPT-2 uses), replacing a cuBLAS product
//!   plus an epilogue kernel.
//!
//! One plan per (shape, epilogue, accumulation): descriptor, layouts and up to
//! [`CANDIDATES`] algorithms from cuBLASLt's heuristic. [`LtGemm::tune`] times each candidate on
//! the plan's first launch at build time and keeps the fastest (the heuristic's first pick is
//! often not: weight-gradient products with a long `k` and a small output need split-k); the
//! choice is cached on disk beside the NVRTC cache, keyed by GPU, cuBLASLt version and plan.
//! Pointers are set per call. No algorithm, a bias with accumulation, a batched product, or
//! `--no-tf32` / `--no-cublaslt` → cuBLAS and the epilogue kernel (exact mode keeps the
//! interpreter's rounding order).

use std::ffi::c_void;
use std::path::PathBuf;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys as drv;
use fusec_codegen_cuda::gemm::ColMajor;
use sha2::{Digest, Sha256};

/// Algorithms asked of the heuristic per plan.
pub(crate) const CANDIDATES: usize = 8;

/// What the epilogue adds to the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// Nothing.
    None,
    /// `+ bias[row]` (column-major rows: the row-major product's columns).
    Bias,
    /// `+ bias`, then GELU, with the pre-activation stored to the auxiliary buffer.
    GeluAuxBias,
}

/// A plan's operands (device addresses); cuBLAS's `A` is the row-major product's `b`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LtArgs {
    pub a: u64,
    pub b: u64,
    /// Read when `beta` is 1.
    pub c: u64,
    pub d: u64,
    pub beta: f32,
    pub bias: u64,
    pub aux: u64,
}

/// One product's cuBLASLt plan.
pub(crate) struct LtGemm {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    /// Heuristic's algorithms and their workspace bytes, best guess first.
    candidates: Vec<(lt::cublasLtMatmulAlgo_t, usize)>,
    chosen: usize,
    epilogue: Epilogue,
    /// What identifies the plan in the tuning cache.
    ident: String,
}

fn ck(r: lt::cublasStatus_t, what: &str) -> Result<(), String> {
    if r == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuBLASLt {what}: {r:?}"))
    }
}

/// Sets a descriptor attribute to `v`.
unsafe fn set<T>(desc: lt::cublasLtMatmulDesc_t, attr: lt::cublasLtMatmulDescAttributes_t, v: &T) -> Result<(), String> {
    ck(lt::cublasLtMatmulDescSetAttribute(desc, attr, v as *const T as *const c_void, std::mem::size_of::<T>()), "set attribute")
}

impl LtGemm {
    /// The plan of `call` (cuBLAS's column-major terms) with `epilogue` on TF32 tensor cores,
    /// using at most `max_workspace` bytes; `Ok(None)` when cuBLASLt has no algorithm for it.
    pub fn new(
        handle: lt::cublasLtHandle_t,
        call: &ColMajor,
        epilogue: Epilogue,
        accumulate: bool,
        max_workspace: usize,
    ) -> Result<Option<LtGemm>, String> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        let f32 = lt::cudaDataType::CUDA_R_32F;
        // SAFETY: descriptors are created here, checked, and owned by the plan (freed on drop).
        unsafe {
            let mut desc = std::ptr::null_mut();
            ck(lt::cublasLtMatmulDescCreate(&mut desc, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32, f32), "descriptor")?;
            let mut plan = LtGemm {
                desc,
                a: std::ptr::null_mut(),
                b: std::ptr::null_mut(),
                c: std::ptr::null_mut(),
                candidates: vec![],
                chosen: 0,
                epilogue,
                ident: format!("{call:?} {epilogue:?} accumulate {accumulate}"),
            };
            set(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &(call.trans_a as i32))?;
            set(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &(call.trans_b as i32))?;
            let e = match epilogue {
                Epilogue::None => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
                Epilogue::Bias => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                Epilogue::GeluAuxBias => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            };
            set(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &e)?;
            if epilogue == Epilogue::GeluAuxBias {
                set(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(call.ldc as i64))?;
            }
            let (m, n, k) = (call.m as u64, call.n as u64, call.k as u64);
            let (ar, ac) = if call.trans_a { (k, m) } else { (m, k) };
            let (br, bc) = if call.trans_b { (n, k) } else { (k, n) };
            ck(lt::cublasLtMatrixLayoutCreate(&mut plan.a, f32, ar, ac, call.lda as i64), "layout")?;
            ck(lt::cublasLtMatrixLayoutCreate(&mut plan.b, f32, br, bc, call.ldb as i64), "layout")?;
            ck(lt::cublasLtMatrixLayoutCreate(&mut plan.c, f32, m, n, call.ldc as i64), "layout")?;
            let mut pref = std::ptr::null_mut();
            ck(lt::cublasLtMatmulPreferenceCreate(&mut pref), "preference")?;
            let ws = max_workspace as u64;
            let r = lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            );
            let mut found: Vec<lt::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); CANDIDATES];
            let mut count = 0;
            let h = lt::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                pref,
                CANDIDATES as i32,
                found.as_mut_ptr(),
                &mut count,
            );
            lt::cublasLtMatmulPreferenceDestroy(pref);
            ck(r, "workspace preference")?;
            if h != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Ok(None);
            }
            plan.candidates = found
                .iter()
                .take(count.max(0) as usize)
                .filter(|f| f.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|f| (f.algo, f.workspaceSize))
                .collect();
            Ok((!plan.candidates.is_empty()).then_some(plan))
        }
    }

    /// `d = beta c + b_op a_op` (cuBLAS's A is `args.a`) plus the epilogue, on `stream`.
    ///
    /// # Safety
    /// Device addresses of buffers of the planned shapes; `bias` and `aux` as the epilogue
    /// needs; `workspace` holds at least the `max_workspace` bytes the plan was made for.
    pub unsafe fn run(&self, handle: lt::cublasLtHandle_t, x: &LtArgs, workspace: u64, stream: *mut c_void) -> Result<(), String> {
        self.run_with(handle, self.chosen, x, workspace, stream)
    }

    unsafe fn run_with(&self, handle: lt::cublasLtHandle_t, i: usize, x: &LtArgs, workspace: u64, stream: *mut c_void) -> Result<(), String> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        if self.epilogue != Epilogue::None {
            set(self.desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &(x.bias as *const c_void))?;
        }
        if self.epilogue == Epilogue::GeluAuxBias {
            set(self.desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &(x.aux as *const c_void))?;
        }
        let one = 1.0f32;
        let (algo, ws) = &self.candidates[i];
        ck(
            lt::cublasLtMatmul(
                handle,
                self.desc,
                &one as *const f32 as *const c_void,
                x.a as *const c_void,
                self.a,
                x.b as *const c_void,
                self.b,
                &x.beta as *const f32 as *const c_void,
                x.c as *const c_void,
                self.c,
                x.d as *mut c_void,
                self.c,
                algo,
                workspace as *mut c_void,
                *ws,
                stream as lt::cudaStream_t,
            ),
            "matmul",
        )
    }

    /// Picks the fastest candidate on `x` (timed with CUDA events: one warm-up, then three
    /// runs each), or the cached choice for this GPU; returns whether it was timed here.
    ///
    /// # Safety
    /// As [`LtGemm::run`]; the buffers' contents may be overwritten (called before training
    /// state is loaded).
    pub unsafe fn tune(&mut self, handle: lt::cublasLtHandle_t, x: &LtArgs, workspace: u64, stream: *mut c_void, gpu: &str) -> Result<bool, String> {
        if self.candidates.len() < 2 {
            return Ok(false);
        }
        let path = cache_path(gpu, &self.ident);
        if let Some(i) = path.as_ref().and_then(|p| std::fs::read(p).ok()).and_then(|b| self.position_of(&b)) {
            self.chosen = i;
            return Ok(false);
        }
        let ev = || cudarc::driver::result::event::create(drv::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("event: {e:?}"));
        let (start, stop) = (ev()?, ev()?);
        let mut best = (f32::INFINITY, 0);
        for i in 0..self.candidates.len() {
            if self.run_with(handle, i, x, workspace, stream).is_err() {
                continue;
            }
            let s = stream as drv::CUstream;
            let timed = (|| -> Result<f32, String> {
                cudarc::driver::result::event::record(start, s).map_err(|e| format!("event: {e:?}"))?;
                for _ in 0..3 {
                    self.run_with(handle, i, x, workspace, stream)?;
                }
                cudarc::driver::result::event::record(stop, s).map_err(|e| format!("event: {e:?}"))?;
                drv::cuEventSynchronize(stop).result().map_err(|e| format!("event: {e:?}"))?;
                cudarc::driver::result::event::elapsed(start, stop).map_err(|e| format!("event: {e:?}"))
            })();
            if let Ok(ms) = timed {
                if ms < best.0 {
                    best = (ms, i);
                }
            }
        }
        let _ = cudarc::driver::result::event::destroy(start);
        let _ = cudarc::driver::result::event::destroy(stop);
        self.chosen = best.1;
        if let Some(p) = path {
            let bytes: Vec<u8> = self.candidates[best.1].0.data.iter().flat_map(|w| w.to_le_bytes()).collect();
            let _ = std::fs::create_dir_all(p.parent().expect("a folder")).and_then(|_| std::fs::write(&p, bytes));
        }
        Ok(true)
    }

    /// The candidate whose algorithm has these cached bytes.
    fn position_of(&self, bytes: &[u8]) -> Option<usize> {
        let words: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        self.candidates.iter().position(|(a, _)| a.data[..] == words[..])
    }
}

/// The tuning cache file of a plan on `gpu`: `lt-<sha256>.bin` beside the NVRTC cache.
fn cache_path(gpu: &str, ident: &str) -> Option<PathBuf> {
    let dir = fusec_codegen_cuda::nvrtc::cache_dir()?;
    // SAFETY: a plain query of the loaded library.
    let version = unsafe { lt::cublasLtGetVersion() };
    let mut h = Sha256::new();
    for part in [env!("CARGO_PKG_VERSION"), gpu, &version.to_string(), ident] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Some(dir.join(format!("lt-{hex}.bin")))
}

impl Drop for LtGemm {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once (null ones are skipped).
        unsafe {
            for l in [self.a, self.b, self.c] {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}
