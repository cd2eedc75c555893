//! The CUDA target: one device allocation from the launch plan (shared by the programs as on
//! the CPU, via [`crate::layout::SharedLayout`]), NVRTC-compiled fused kernels, cuBLAS
//! products in f32 or bf16 (bias / GELU epilogues inside cuBLASLt calls with TF32, `lt`;
//! the paths a product can take are in `launch`'s docs), flash attention
//! (TF32, sm_80+) or the score-matrix attention stages, hand-written gather / scatter-add, all
//! launched in order on one stream; per-launch CUDA-event timing when profiling. The driver,
//! context and cuBLAS can be opened in the background ([`start_driver`]) while the passes run
//! and, when NVML names the GPUs' architecture (`nvml.rs`), while NVRTC compiles the kernels
//! ([`CudaExecutor::new`]).
//!
//! The allocation is laid out as `[persistent | arena | scratch | static | cuBLAS workspace]`:
//! the Step program's parameters, gradients, Adam state and inputs, then the largest program's
//! arena, then scratch shared by every launch (column partials, attention score matrices or
//! flash attention's row sums, a GEMM epilogue's temporary), then pointer tables, then the workspace handed to cuBLAS (so it
//! never allocates on its own).
//!
//! Without profiling, each program is captured into a CUDA graph on its first run and replayed
//! afterwards (one launch per step instead of hundreds; [`CudaOptions::graphs`] off launches
//! one by one). Profiling every step launches one by one; a profile that times only a traced
//! step ([`Profile::tracing`]) launches that step one by one and replays graphs otherwise.
//! Every address, kernel argument and table is fixed when the executor is built, so a replay
//! is exactly the launches it recorded.
//!
//! Everything that can be missing on a machine (the driver, cuBLAS, NVRTC, a GPU) is checked
//! before it is used; [`CudaExecutor::new`] returns an `Err` saying what is missing and never
//! panics. Launches are asynchronous: an error inside a kernel surfaces at the end of the
//! program; `FUSEC_CUDA_SYNC=1` waits after every launch so the error names it.

mod attention;
mod batch;
mod device;
mod executor;
mod kernels;
mod launch;
mod lt;
mod collectives;
mod comm_timing;
mod nvml;
mod peak;
mod summary;
mod tune;

use summary::attention_summary;
pub use summary::{CudaBuild, CudaOptions, KernelStats};
pub use tune::Tuning;

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::cublas::sys as blas;
use cudarc::driver::sys;
use fusec_ir::interp::Tensor;
use fusec_codegen_cuda::flash;
use fusec_codegen_cuda::gemm::Batched;
use fusec_ir::DType;
use fusec_passes::memplan::ALIGN;

use crate::dist::nccl::NcclRank;
use crate::launches::{LaunchPlan, ProgramIo};
use crate::layout::SharedLayout;
use crate::profile::Profile;
use crate::programs::{Program, RunPrograms};
pub(crate) use device::guard;
pub use device::{check_libraries, start_driver};
use device::{ck, ckb, sm, Device};
use kernels::{Functions, Modules, Sources};
use launch::{Addr, Arg, Builder, Launch, Loaded, Native, Step, ERR_WORDS};

/// Bytes given to cuBLAS as its workspace (NVIDIA's recommendation for Hopper).
const CUBLAS_WORKSPACE: u64 = 32 << 20;

/// One compiled program.
struct Compiled {
    launches: Vec<Launch>,
    io: ProgramIo,
}

/// Runs the programs of a training run on a GPU.
pub struct CudaExecutor {
    layout: SharedLayout,
    programs: HashMap<Program, Compiled>,
    types: HashMap<String, (DType, Vec<usize>)>,
    scratch_base: u64,
    static_base: u64,
    sync_each: bool,
    use_graphs: bool,
    graphs: HashMap<Program, sys::CUgraphExec>,
    events: Vec<(sys::CUevent, sys::CUevent)>,
    peak: u64,
    /// Per-launch timings (CUDA events), when profiling.
    pub profile: Option<Profile>,
    /// cuBLASLt plans of the launches (dropped before the device).
    lt_plans: Vec<lt::LtGemm>,
    /// `fusec_round_bf16`: the bf16 weight copies, rounded on the device.
    round_bf16: sys::CUfunction,
    /// Whether f32 products run on TF32 tensor cores (the handle's math mode).
    tf32: bool,
    /// The other ranks of a data-parallel run (`None`: one rank, `all_reduce` is a copy);
    /// dropped before the device.
    nccl: Option<NcclRank>,
    /// The stream the collectives run on beside the backward (with `nccl`).
    side: Option<collectives::SideStream>,
    /// How long the Step program's collectives take, and how much of it is exposed (with `nccl`).
    comm: Option<comm_timing::CommTiming>,
    dev: Device,
}

impl CudaExecutor {
    /// Plans memory for the programs (which must include `Step`), compiles every kernel (NVRTC,
    /// in parallel, through the disk cache), opens GPU 0 and allocates the one device buffer,
    /// as `opts` says.
    ///
    /// When NVML names the architecture of every GPU (`nvml.rs`), the plan, the code and NVRTC
    /// come first, while the driver opens on its own thread ([`start_driver`]); then the device
    /// (whose errors still come first), the free-memory check, and the driver's architecture
    /// checked against NVML's: where they differ, the modules compile again for the driver's.
    /// Otherwise the device opens first and its architecture decides, as before NVML.
    pub fn new(run: &RunPrograms, opts: &CudaOptions) -> Result<(CudaExecutor, CudaBuild), String> {
        let t0 = Instant::now();
        let mut phases = vec![];
        let mut lap = t0;
        let mut phase = |name: &'static str| {
            phases.push((name, lap.elapsed()));
            lap = Instant::now();
        };
        let fits = |dev: &Device, plan: &LaunchPlan| -> Result<(), String> {
            let free = dev.free_bytes()?;
            if plan.planned_bytes.saturating_add(CUBLAS_WORKSPACE) > free {
                return Err(format!("{}; the GPU has {} free", plan.too_large(), crate::launches::mib(free)));
            }
            Ok(())
        };
        let predicted = nvml::compute_capability();
        phase("NVML");
        let (mut dev, plan, src, mut mods) = match predicted {
            Some(arch) => {
                let built = plan_and_compile(run, opts, arch, |_| Ok(()), &mut phase);
                let dev = Device::open(opts.tf32)?;
                let (plan, src, mods) = built?;
                fits(&dev, &plan)?;
                phase("waited for both");
                (dev, plan, src, mods)
            }
            None => {
                let dev = Device::open(opts.tf32)?;
                phase("waited for both");
                let (plan, src, mods) = plan_and_compile(run, opts, dev.arch, |plan| fits(&dev, plan), &mut phase)?;
                (dev, plan, src, mods)
            }
        };
        let arch = match predicted {
            Some(a) if a == dev.arch => format!("arch {} from NVML, before the driver was up", dev.sm()),
            Some(a) => format!("arch {} from the driver; NVML said {}: compiled again", dev.sm(), sm(a)),
            None => format!("arch {} from the driver (none from NVML)", dev.sm()),
        };
        if mods.arch != dev.arch {
            mods = Modules::new(&src, dev.arch, opts)?;
            mods.compile();
            phase("nvrtc again");
        }
        let Functions { kernels: funcs, native: nf, flash: flash_funcs } = mods.load(&src, &mut dev)?;
        phase("module load");
        let native = Native {
            gather: nf[0],
            scatter: [nf[1], nf[2], nf[3], nf[4], nf[5]],
            attn_softmax: nf[6],
            attn_probs: nf[7],
            attn_dscores: nf[8],
            iota_f32: nf[9],
            iota_i32: nf[10],
            gemm_epilogue: nf[11],
            gemm_epilogue_mixed: nf[12],
            sum_rows: nf[14],
            flash: flash_funcs,
            flash_arch: mods.compiler.arch().to_string(),
        };

        let lt = dev.lt.filter(|_| opts.lt_epilogues).map(|h| lt::LtPlans::new(h, CUBLAS_WORKSPACE as usize, opts.tune_products));
        let mut b = Builder { native: &native, words: vec![None; ERR_WORDS], scratch: 0, lt };
        let mut programs = HashMap::new();
        for (p, launches, io) in &plan.programs {
            let lookup = |i: usize| src.of_launch.get(&(*p, i)).map(|&s| Loaded { src: src.kernels[s].clone(), funcs: funcs[s].clone() });
            let launches = b.translate(launches, &lookup).map_err(|e| format!("{p:?} program: {e}"))?;
            programs.insert(*p, Compiled { launches, io: io.clone() });
        }
        let column_sums = programs.values().flat_map(|c| &c.launches).filter(|l| l.name == attention::COLSUM_LAUNCH).count();

        let planning = b.lt.as_ref().map_or(Duration::ZERO, |lt| lt.planning);
        phase("launch lists");
        let tuning = match b.lt.as_mut().filter(|_| opts.tune_products) {
            Some(lt) => {
                let mut lists: Vec<&mut Vec<Launch>> = programs.values_mut().map(|c| &mut c.launches).collect();
                let t = tune::tune(&mut lists, lt, &dev)?;
                phase("product tuning");
                t
            }
            None => tune::Tuning::default(),
        };
        let (lt_plans, lt_launches) = b.lt.take().map_or((vec![], 0), |lt| (lt.plans, lt.launches));
        let align = |x: u64| x.div_ceil(ALIGN) * ALIGN;
        let scratch_base = align(plan.planned_bytes);
        let static_base = scratch_base + align(b.scratch);
        let total = static_base + align(b.words.len() as u64 * 8);
        dev.allocate(total, CUBLAS_WORKSPACE)?;
        let words: Vec<u64> = b.words.iter().map(|w| w.map_or(0, |a| resolve(dev.base, scratch_base, static_base, a))).collect();
        dev.upload(dev.base + static_base, &words)?;
        phase("alloc");
        // The cuBLASLt plans were made among the launch lists: shown as a phase of their own.
        if let Some(i) = phases.iter().position(|p| p.0 == "launch lists") {
            phases[i].1 = phases[i].1.saturating_sub(planning);
            phases.insert(i + 1, ("cuBLASLt plans", planning));
        }

        let used = dev.used_bytes();
        let max_launches = programs.values().map(|c| c.launches.len()).max().unwrap_or(0);
        let mut events = vec![];
        if opts.profile {
            for _ in 0..max_launches {
                let ev =
                    || cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("event: {e:?}"));
                events.push((ev()?, ev()?));
            }
        }
        let build = CudaBuild {
            compile_time: t0.elapsed(),
            opened: dev.open_times,
            phases,
            arch,
            modules: std::mem::take(&mut mods.compiler.times),
            kernels: KernelStats {
                kernels: src.of_launch.len(),
                modules: mods.items.len(),
                compiled: mods.compiler.compiled,
                in_workers: mods.compiler.in_workers,
                disk_hits: mods.compiler.disk_hits,
            },
            device: format!("{} ({})", dev.name, dev.sm()),
            nvrtc: mods.compiler.nvrtc_version(),
            device_bytes: dev.size,
            scratch_bytes: b.scratch,
            step_plan: plan.step_plan,
            lt_epilogues: lt_launches,
            attention: attention_summary(&src.attention, &mods.flash)
                + if mods.flash.iter().any(|&(d, dt)| dt == DType::BF16 && flash::bf16::wgmma(d, mods.compiler.arch())) {
                    "; on Hopper warpgroup MMAs (wgmma)"
                } else {
                    ""
                }
                + if column_sums > 0 { "; the qkv bias gradient summed by the backward kernels" } else { "" },
            column_sums,
            tuning,
        };
        let sync_each = std::env::var_os("FUSEC_CUDA_SYNC").is_some_and(|v| v != "0");
        let ex = CudaExecutor {
            layout: plan.layout,
            programs,
            types: plan.tensors,
            scratch_base,
            static_base,
            sync_each,
            use_graphs: opts.graphs,
            graphs: HashMap::new(),
            events,
            peak: used,
            profile: opts.profile.then(Profile::default),
            lt_plans,
            round_bf16: nf[13],
            tf32: opts.tf32,
            nccl: None,
            side: None,
            comm: None,
            dev,
        };
        Ok((ex, build))
    }

    /// The most GPU memory seen in use (every process), sampled after the build and after each
    /// profiled run.
    pub fn peak_device_bytes(&self) -> u64 {
        self.peak
    }

    /// The device addresses of a pointer-array product's `A`, `B` and `C` tables, `batch`
    /// pointers each, one after the other from `at`.
    fn pointer_arrays(&self, at: Addr, batch: i32) -> [u64; 3] {
        let (base, n) = (self.addr(at), batch as u64 * 8);
        [base, base + n, base + 2 * n]
    }

    fn addr(&self, a: Addr) -> u64 {
        resolve(self.dev.base, self.scratch_base, self.static_base, a)
    }

    fn place(&self, name: &str) -> Result<(u64, DType, usize), String> {
        let (off, _) = self.layout.named.get(name).ok_or_else(|| format!("no tensor named `{name}`"))?;
        let (dt, shape) = &self.types[name];
        Ok((*off, *dt, shape.iter().product()))
    }

    fn read(&self, off: u64, dt: DType, shape: Vec<usize>) -> Result<Tensor, String> {
        let n: usize = shape.iter().product();
        let data = match dt {
            DType::I32 => {
                let mut v = vec![0i32; n];
                self.dev.download(&mut v, self.dev.base + off)?;
                v.into_iter().map(|x| x as f64).collect()
            }
            DType::F32 => {
                let mut v = vec![0f32; n];
                self.dev.download(&mut v, self.dev.base + off)?;
                v.into_iter().map(|x| x as f64).collect()
            }
            DType::BF16 => {
                let mut v = vec![0u16; n];
                self.dev.download(&mut v, self.dev.base + off)?;
                v.into_iter().map(|x| f32::from_bits((x as u32) << 16) as f64).collect()
            }
            d => return Err(format!("reading {d} tensors from the GPU is not supported")),
        };
        Ok(Tensor { dtype: dt, shape, data })
    }

    /// Runs one step on the stream.
    ///
    /// # Safety
    /// The step's addresses were built against this allocation's layout.
    unsafe fn exec(&self, st: &Step) -> Result<(), String> {
        let d = &self.dev;
        let op = |t: bool| if t { blas::cublasOperation_t::CUBLAS_OP_T } else { blas::cublasOperation_t::CUBLAS_OP_N };
        let one = 1f32;
        match st {
            Step::Gemm { g, a, b, c, beta, ab: DType::F32, out: DType::F32 } => {
                let k = &g.call;
                // cuBLAS's A is the row-major product's `b`, its B is `a`.
                let (pa, pb, pc) = (self.addr(*b) as *const f32, self.addr(*a) as *const f32, self.addr(*c) as *mut f32);
                let (ta, tb) = (op(k.trans_a), op(k.trans_b));
                let r = if g.batch == 1 {
                    blas::cublasSgemm_v2(d.blas, ta, tb, k.m, k.n, k.k, &one, pa, k.lda, pb, k.ldb, beta, pc, k.ldc)
                } else {
                    blas::cublasSgemmStridedBatched(
                        d.blas, ta, tb, k.m, k.n, k.k, &one, pa, k.lda, g.stride_a, pb, k.ldb, g.stride_b, beta, pc, k.ldc, g.stride_c,
                        g.batch,
                    )
                };
                ckb(r, "cuBLAS sgemm")
            }
            Step::Gemm { g, a, b, c, beta, ab, out } => {
                if *ab != DType::BF16 {
                    return Err(format!("internal: a cuBLAS product of {ab} operands with a {out} result"));
                }
                // cuBLAS's A is the row-major product's `b`, its B is `a`.
                gemm_bf16(d, g, self.addr(*b), self.addr(*a), self.addr(*c), *out, *beta)
            }
            Step::GemmLt { plan, a, b, c, bias, aux } => {
                let handle = d.lt.ok_or("internal: a cuBLASLt launch without a cuBLASLt handle")?;
                let workspace = d.base + d.size - CUBLAS_WORKSPACE;
                // cuBLAS's A is the row-major product's `b`, its B is `a`.
                let (pa, pb) = (self.addr(*b), self.addr(*a));
                self.lt_plans[*plan].run(
                    handle,
                    pa,
                    pb,
                    self.addr(*c),
                    self.addr(*bias),
                    self.addr(*aux),
                    workspace,
                    d.stream as *mut c_void,
                )
            }
            Step::GemmArrays { call: k, arrays, batch } => {
                let [pa, pb, pc] = self.pointer_arrays(*arrays, *batch);
                let zero = 0f32;
                let r = blas::cublasSgemmBatched(
                    d.blas,
                    op(k.trans_a),
                    op(k.trans_b),
                    k.m,
                    k.n,
                    k.k,
                    &one,
                    pa as *const *const f32,
                    k.lda,
                    pb as *const *const f32,
                    k.ldb,
                    &zero,
                    pc as *const *mut f32,
                    k.ldc,
                    *batch,
                );
                ckb(r, "cuBLAS batched sgemm")
            }
            Step::GemmBatched { call: k, arrays, batch, out, beta } => {
                let [pa, pb, pc] = self.pointer_arrays(*arrays, *batch);
                let bf16 = blas::cudaDataType::CUDA_R_16BF;
                let ct = if *out == DType::BF16 { bf16 } else { blas::cudaDataType::CUDA_R_32F };
                let (al, be) = (&one as *const f32 as *const c_void, beta as *const f32 as *const c_void);
                let r = blas::cublasGemmBatchedEx(
                    d.blas,
                    op(k.trans_a),
                    op(k.trans_b),
                    k.m,
                    k.n,
                    k.k,
                    al,
                    pa as *const *const c_void,
                    bf16,
                    k.lda,
                    pb as *const *const c_void,
                    bf16,
                    k.ldb,
                    be,
                    pc as *const *mut c_void,
                    ct,
                    k.ldc,
                    *batch,
                    blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                );
                ckb(r, "cuBLAS batched bf16 product")
            }
            Step::Kernel { f, grid, block, shared, args } => {
                let mut vals: Vec<u64> = args
                    .iter()
                    .map(|a| match *a {
                        Arg::Ptr(p) => self.addr(p),
                        Arg::I32(v) => v as u32 as u64,
                        Arg::I64(v) => v as u64,
                        Arg::F32(v) => v.to_bits() as u64,
                    })
                    .collect();
                let mut params: Vec<*mut c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
                d.launch(*f, *grid, *block, *shared, &mut params)
            }
            Step::Fill32 { dst, bits, n } => ck(sys::cuMemsetD32Async(self.addr(*dst), *bits, *n, d.stream), "memset"),
            Step::Copy { dst, src, bytes } => {
                ck(sys::cuMemcpyDtoDAsync_v2(self.addr(*dst), self.addr(*src), *bytes as usize, d.stream), "copy")
            }
            Step::Collective { parts } => self.collective(parts, d.stream),
        }
    }

    /// Records the launches of `program` into a CUDA graph (nothing runs yet).
    fn capture(&self, program: Program) -> Result<sys::CUgraphExec, String> {
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let stream = self.dev.stream;
        // SAFETY: capture on our own stream; the steps were built against this allocation.
        unsafe {
            ck(sys::cuStreamBeginCapture_v2(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "CUDA graph capture")?;
            let mut res = Ok(());
            let mut pending = vec![];
            for (i, l) in prog.launches.iter().enumerate() {
                if let Err(e) = self.launch(program, i, l, &mut pending, true) {
                    res = Err(format!("{} ({program:?} launch {i}, capturing a CUDA graph; --no-cuda-graph runs without): {e}", l.name));
                    break;
                }
            }
            // The side stream joins the step's stream before the capture ends.
            res = res.and_then(|_| self.join_side(program, &mut pending));
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            let end = ck(sys::cuStreamEndCapture(stream, &mut graph), "CUDA graph capture");
            res?;
            end?;
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            let r = ck(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "CUDA graph instantiation");
            let _ = sys::cuGraphDestroy(graph);
            r.map(|_| exec)
        }
    }

    /// The error word of gather / scatter-add, cleared.
    fn take_index_error(&self) -> Result<(), String> {
        let mut e = [0i32; 4];
        self.dev.download(&mut e, self.dev.base + self.static_base)?;
        if e[0] != 0 {
            self.dev.upload(self.dev.base + self.static_base, &[0u64; ERR_WORDS])?;
            return Err(format!("gather/scatter_add: index {} at position {} is outside the table", e[1], e[2]));
        }
        Ok(())
    }
}

/// The memory plan (then `fits`), the code and the modules for `arch`, compiled: a phase each.
fn plan_and_compile<'r>(
    run: &'r RunPrograms,
    opts: &CudaOptions,
    arch: (i32, i32),
    fits: impl FnOnce(&LaunchPlan) -> Result<(), String>,
    phase: &mut impl FnMut(&'static str),
) -> Result<(LaunchPlan<'r>, Sources, Modules), String> {
    let plan = LaunchPlan::new(run)?;
    fits(&plan)?;
    phase("memplan");
    let src = Sources::new(&plan, run)?;
    let mut mods = Modules::new(&src, arch, opts)?;
    phase("codegen");
    mods.compile();
    phase("nvrtc");
    Ok((plan, src, mods))
}

/// A cuBLAS product of bf16 operands (`cublasGemmEx`, strided-batched past one batch): f32
/// compute, an `out` (f32 or bf16) result, `c = A_op B_op + beta c` in cuBLAS's column-major
/// terms (`a` is cuBLAS's A).
///
/// # Safety
/// Device addresses of buffers of `g`'s shape.
pub(crate) unsafe fn gemm_bf16(d: &Device, g: &Batched, a: u64, b: u64, c: u64, out: DType, beta: f32) -> Result<(), String> {
    let op = |t: bool| if t { blas::cublasOperation_t::CUBLAS_OP_T } else { blas::cublasOperation_t::CUBLAS_OP_N };
    let bf16 = blas::cudaDataType::CUDA_R_16BF;
    let ct = match out {
        DType::BF16 => bf16,
        DType::F32 => blas::cudaDataType::CUDA_R_32F,
        d => return Err(format!("internal: a cuBLAS product with {d} data")),
    };
    let k = &g.call;
    let (pa, pb, pc) = (a as *const c_void, b as *const c_void, c as *mut c_void);
    let (compute, alg) = (blas::cublasComputeType_t::CUBLAS_COMPUTE_32F, blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT);
    let one = 1f32;
    let (al, be) = (&one as *const f32 as *const c_void, &beta as *const f32 as *const c_void);
    let (ta, tb) = (op(k.trans_a), op(k.trans_b));
    let r = if g.batch == 1 {
        blas::cublasGemmEx(d.blas, ta, tb, k.m, k.n, k.k, al, pa, bf16, k.lda, pb, bf16, k.ldb, be, pc, ct, k.ldc, compute, alg)
    } else {
        blas::cublasGemmStridedBatchedEx(
            d.blas, ta, tb, k.m, k.n, k.k, al, pa, bf16, k.lda, g.stride_a, pb, bf16, k.ldb, g.stride_b, be, pc, ct, k.ldc, g.stride_c,
            g.batch, compute, alg,
        )
    };
    ckb(r, "cuBLAS bf16 product")
}

fn resolve(base: u64, scratch: u64, stat: u64, a: Addr) -> u64 {
    match a {
        Addr::Plan(o) => base + o,
        Addr::Scratch(o) => base + scratch + o,
        Addr::Static(o) => base + stat + o,
    }
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        for e in self.graphs.values() {
            // SAFETY: instantiated in `capture`; the stream is idle after the last run.
            unsafe {
                let _ = sys::cuGraphExecDestroy(*e);
            }
        }
        for (a, b) in &self.events {
            // SAFETY: created in `new`, no longer recorded.
            unsafe {
                let _ = sys::cuEventDestroy_v2(*a);
                let _ = sys::cuEventDestroy_v2(*b);
            }
        }
    }
}
