//! cuBLASLt products with the bias and bias + GELU epilogues fused into the GEMM.
//!
//! `Op::Gemm` nodes with a bias (and GELU) and no accumulation run as one cuBLASLt call instead
//! of a cuBLAS product plus an epilogue kernel: `y = a b + bias` (`CUBLASLT_EPILOGUE_BIAS`) or
//! `pre = a b + bias, y = gelu(pre)` (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`, the tanh form GPT-2
//! uses). A plan (descriptor, layouts, the heuristic's first algorithm, or its first
//! [`CANDIDATES`] for bf16 plans when products are tuned) is made once per [`LtKey`] (shape,
//! epilogue, [`LtTypes`], accumulation) when the launch list is built; the bias and auxiliary
//! pointers are set at each call. Tuning (`tune.rs`) picks the algorithm a plan runs, and
//! also makes plans without an epilogue (`Epilogue::None`) for plain bf16 products whose
//! fastest algorithm is a cuBLASLt one.
//!
//! Two kinds of plans ([`LtTypes`]):
//! - f32 operands, bias and result on TF32 tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`);
//! - bf16 operands (`CUDA_R_16BF` A and B), f32 compute and scale, a bf16 or f32 result (C =
//!   D), a bf16 bias (`CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE`) and a bf16 pre-activation (the
//!   auxiliary output; its type is set only when it differs from D's, `EPILOGUE_AUX_DATA_TYPE`).
//!   The heuristic is told the pointers' alignment (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*`);
//!   the caller only asks for such plans with 16-byte aligned pointers and, with GELU, a
//!   result row stride that is a multiple of 8 elements (cuBLASLt's rule for the aux matrix).
//!
//! When cuBLASLt has no algorithm for a key, or rejects one of the bf16 attributes, the launch
//! falls back to cuBLAS + the epilogue kernel; so does everything without TF32 (`--no-tf32`
//! keeps the epilogue kernel, whose rounding order is the interpreter's, and opens no
//! cuBLASLt handle).

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::sys as lt;
use fusec_codegen_cuda::gemm::ColMajor;
use fusec_ir::DType;

/// What the epilogue adds to the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// The product alone (a plain bf16 product that tuning found faster on cuBLASLt).
    None,
    /// `+ bias[row]` (column-major rows: the row-major product's columns).
    Bias,
    /// `+ bias`, then GELU, with the pre-activation stored to the auxiliary buffer.
    GeluAuxBias,
}

/// The storage and compute types of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LtTypes {
    /// f32 operands, bias and result; TF32 tensor cores.
    Tf32,
    /// bf16 operands, bias and pre-activation; `out` (bf16 or f32) is the result's type; f32
    /// compute. `align`: the bytes every pointer of the call is aligned to (16 to 256).
    Bf16 { out: DType, align: u32 },
}

/// The bytes every one of `offsets` is aligned to (at most 256, the allocation's alignment):
/// the `align` of [`LtTypes::Bf16`].
pub(crate) fn alignment(offsets: impl IntoIterator<Item = u64>) -> u32 {
    offsets.into_iter().map(|o| 1u32 << o.trailing_zeros().min(8)).min().unwrap_or(256)
}

/// What a plan is made for: the call (cuBLAS's column-major terms), epilogue and types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LtKey {
    /// The product.
    pub call: ColMajor,
    /// What the epilogue adds.
    pub epilogue: Epilogue,
    /// Operand, result and compute types.
    pub types: LtTypes,
    /// `c += product` (beta = 1; f32 results only) instead of `c = product`.
    pub accumulate: bool,
}

/// How many algorithms a plan asks the heuristic for: the candidates tuning times.
const CANDIDATES: usize = 8;

/// One product's cuBLASLt plan: the heuristic's algorithms, best first, and the one it runs.
pub(crate) struct LtGemm {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    /// The heuristic's algorithms and their workspace bytes, in its order.
    pub algos: Vec<(lt::cublasLtMatmulAlgo_t, usize)>,
    /// The index in `algos` that [`LtGemm::run`] uses (0 unless tuning chose another).
    pub chosen: usize,
    /// What the plan was made for.
    pub key: LtKey,
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

/// A cuBLASLt handle (bound to the calling thread's context) after one heuristic query for a
/// typical bf16 product with the GELU epilogue, which pays the library's start-up (about 0.1 s)
/// ahead of the build's plans; `None` when the library is missing or refuses.
pub(crate) fn open_warm() -> Option<lt::cublasLtHandle_t> {
    // SAFETY: only tries to open the library.
    if !unsafe { lt::is_culib_present() } {
        return None;
    }
    let handle = cudarc::cublaslt::result::create_handle().ok()?;
    let call = ColMajor { trans_a: false, trans_b: false, m: 1024, n: 1024, k: 1024, lda: 1024, ldb: 1024, ldc: 1024 };
    let key = LtKey { call, epilogue: Epilogue::GeluAuxBias, types: LtTypes::Bf16 { out: DType::BF16, align: 256 }, accumulate: false };
    drop(LtGemm::new(handle, &key, 32 << 20, false));
    Some(handle)
}

impl LtGemm {
    /// The plan of `key`, using at most `max_workspace` bytes, with the heuristic's first
    /// algorithm, or its first [`CANDIDATES`] when `tuned` (for [`super::tune`] to time);
    /// `Ok(None)` when cuBLASLt has no algorithm for it (or, for bf16 plans, rejects one of
    /// their attributes).
    pub fn new(handle: lt::cublasLtHandle_t, key: &LtKey, max_workspace: usize, tuned: bool) -> Result<Option<LtGemm>, String> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        let (call, epilogue) = (&key.call, key.epilogue);
        let (f32, bf16) = (lt::cudaDataType::CUDA_R_32F, lt::cudaDataType::CUDA_R_16BF);
        let (compute, ab, cd) = match key.types {
            LtTypes::Tf32 => (lt::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32, f32, f32),
            LtTypes::Bf16 { out, .. } => (lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, bf16, if out == DType::BF16 { bf16 } else { f32 }),
        };
        // SAFETY: descriptors are created here, checked, and owned by the plan (freed on drop).
        unsafe {
            let mut desc = std::ptr::null_mut();
            ck(lt::cublasLtMatmulDescCreate(&mut desc, compute, f32), "descriptor")?;
            let mut plan =
                LtGemm { desc, a: std::ptr::null_mut(), b: std::ptr::null_mut(), c: std::ptr::null_mut(), algos: vec![], chosen: 0, key: *key };
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
            if let (LtTypes::Bf16 { .. }, Epilogue::Bias | Epilogue::GeluAuxBias) = (key.types, epilogue) {
                // The bias (and the pre-activation) keep the operands' type; a library that
                // does not know an attribute gets the epilogue kernel instead.
                if set(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bf16).is_err() {
                    return Ok(None);
                }
                if epilogue == Epilogue::GeluAuxBias
                    && cd != bf16
                    && set(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &bf16).is_err()
                {
                    return Ok(None);
                }
            }
            let (m, n, k) = (call.m as u64, call.n as u64, call.k as u64);
            let (ar, ac) = if call.trans_a { (k, m) } else { (m, k) };
            let (br, bc) = if call.trans_b { (n, k) } else { (k, n) };
            ck(lt::cublasLtMatrixLayoutCreate(&mut plan.a, ab, ar, ac, call.lda as i64), "layout")?;
            ck(lt::cublasLtMatrixLayoutCreate(&mut plan.b, ab, br, bc, call.ldb as i64), "layout")?;
            ck(lt::cublasLtMatrixLayoutCreate(&mut plan.c, cd, m, n, call.ldc as i64), "layout")?;
            let mut pref = std::ptr::null_mut();
            ck(lt::cublasLtMatmulPreferenceCreate(&mut pref), "preference")?;
            let ws = max_workspace as u64;
            let mut r = lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            );
            if let LtTypes::Bf16 { align, .. } = key.types {
                for attr in [
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ] {
                    if r == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                        // The attribute is a uint32_t.
                        r = lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, &align as *const u32 as *const c_void, 4);
                    }
                }
            }
            let mut found: [lt::cublasLtMatmulHeuristicResult_t; CANDIDATES] = std::mem::zeroed();
            let mut count = 0;
            let want = if tuned && matches!(key.types, LtTypes::Bf16 { .. }) { CANDIDATES } else { 1 };
            let h = lt::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                pref,
                want as i32,
                found.as_mut_ptr(),
                &mut count,
            );
            lt::cublasLtMatmulPreferenceDestroy(pref);
            ck(r, "preference")?;
            let ok = lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
            if h != ok {
                return Ok(None);
            }
            let found = &found[..(count.max(0) as usize).min(want)];
            plan.algos = found.iter().filter(|f| f.state == ok).map(|f| (f.algo, f.workspaceSize)).collect();
            Ok(Some(plan).filter(|p| !p.algos.is_empty()))
        }
    }

    /// `c = b_op a_op` (cuBLAS's A is `a` here) plus the epilogue, on `stream`.
    ///
    /// # Safety
    /// Device addresses of buffers of the planned shapes; `aux` for GELU; `workspace` holds at
    /// least the plan's bytes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        handle: lt::cublasLtHandle_t,
        a: u64,
        b: u64,
        c: u64,
        bias: u64,
        aux: u64,
        workspace: u64,
        stream: *mut c_void,
    ) -> Result<(), String> {
        use lt::cublasLtMatmulDescAttributes_t as A;
        if self.key.epilogue != Epilogue::None {
            set(self.desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &(bias as *const c_void))?;
        }
        if self.key.epilogue == Epilogue::GeluAuxBias {
            set(self.desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &(aux as *const c_void))?;
        }
        let (one, beta) = (1.0f32, if self.key.accumulate { 1.0f32 } else { 0.0 });
        let (algo, workspace_bytes) = &self.algos[self.chosen];
        ck(
            lt::cublasLtMatmul(
                handle,
                self.desc,
                &one as *const f32 as *const c_void,
                a as *const c_void,
                self.a,
                b as *const c_void,
                self.b,
                &beta as *const f32 as *const c_void,
                c as *const c_void,
                self.c,
                c as *mut c_void,
                self.c,
                algo,
                workspace as *mut c_void,
                *workspace_bytes,
                stream as lt::cudaStream_t,
            ),
            "matmul",
        )
    }
}

/// The plans of one build, one per [`LtKey`], and how many launches use them.
pub(crate) struct LtPlans {
    pub handle: lt::cublasLtHandle_t,
    /// Bytes of workspace a plan may use.
    pub workspace: usize,
    /// Plans keep the heuristic's first [`CANDIDATES`] algorithms, for tuning.
    tuned: bool,
    pub plans: Vec<LtGemm>,
    index: HashMap<LtKey, usize>,
    /// Launches that use a plan for their epilogue.
    pub launches: usize,
    /// Time spent making the plans (cuBLASLt's heuristic).
    pub planning: std::time::Duration,
}

impl LtPlans {
    /// No plans yet.
    pub fn new(handle: lt::cublasLtHandle_t, workspace: usize, tuned: bool) -> LtPlans {
        LtPlans { handle, workspace, tuned, plans: vec![], index: HashMap::new(), launches: 0, planning: std::time::Duration::ZERO }
    }

    /// The plan for one more epilogue launch of `key` (made at its first use); `None` when
    /// cuBLASLt has no algorithm for it.
    pub fn plan(&mut self, key: &LtKey) -> Result<Option<usize>, String> {
        let i = self.find(key)?;
        self.launches += i.is_some() as usize;
        Ok(i)
    }

    /// The plan of `key`, made at its first use; `None` when cuBLASLt has no algorithm for it.
    pub fn find(&mut self, key: &LtKey) -> Result<Option<usize>, String> {
        if let Some(&i) = self.index.get(key) {
            return Ok(Some(i));
        }
        let t0 = std::time::Instant::now();
        let plan = LtGemm::new(self.handle, key, self.workspace, self.tuned)?;
        self.planning += t0.elapsed();
        let Some(p) = plan else { return Ok(None) };
        self.plans.push(p);
        self.index.insert(*key, self.plans.len() - 1);
        Ok(Some(self.plans.len() - 1))
    }
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
