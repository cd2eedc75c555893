//! The CPU target: one arena from the memory plans, Cranelift-compiled fused kernels, GEMMs
//! through the `gemm` crate (f32) or bf16 dot products / widened operands (bf16), native
//! attention and embedding ops, per-launch timing. Storage is f32, bf16 or i32; the
//! instruction-set level ([`Isa`]) picks the native routines.

mod arena;
mod attention;
pub(crate) mod launch;
pub mod ops;
mod peak;
mod product;

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fusec_codegen_cpu::gemm::{bf16_bits, widen_bits};
use fusec_codegen_cpu::isa::Isa;
use fusec_codegen_cpu::{thread_spans, KernelCompiler};
use fusec_ir::interp::Tensor;
use fusec_ir::DType;
use fusec_passes::memplan::MemPlan;

use crate::dist::star::HostCollective;
use crate::executor::{CommTimes, Executor, StepOutputs};
use crate::launches::{CollectivePart, LaunchPlan, ProgramIo};
use crate::layout::SharedLayout;
use crate::profile::{Profile, Timed};
use crate::programs::{Program, RunPrograms};
use crate::roofline::Limits;
use arena::Arena;
use attention::AttnScratch;
use launch::{Kind, Launch};

/// One compiled program: its launches and where its outputs land.
struct Compiled {
    launches: Vec<Launch>,
    io: ProgramIo,
}

/// What compiling the programs for the CPU produced, for the run summary.
pub struct CpuBuild {
    /// Time spent in memory planning, launch building and Cranelift.
    pub compile_time: Duration,
    /// Kernels compiled and cache hits (identical kernels compile once).
    pub kernels: (usize, usize),
    /// Bytes of the one allocation.
    pub arena_bytes: u64,
    /// The Step program's plan (for the summary).
    pub step_plan: MemPlan,
    /// The instruction-set level of the kernels and bf16 products.
    pub isa: Isa,
    /// Attention's score matrices outside the allocation: bytes, how many layers keep their
    /// probabilities for the backward (`launch::keep_scores`), and the bytes they may take.
    pub attention: (u64, usize, u64),
}

/// Runs the programs of a training run on the CPU.
pub struct CpuExecutor {
    arena: Arena,
    layout: SharedLayout,
    programs: HashMap<Program, Compiled>,
    types: HashMap<String, (DType, Vec<usize>)>,
    threads: usize,
    isa: Isa,
    /// Attention's per-head score matrices, outside the memory plan: sized once for the largest
    /// attention.
    attn: AttnScratch,
    /// Per-launch timings, when profiling.
    pub profile: Option<Profile>,
    /// The other ranks of a data-parallel run (`None`: one rank, `all_reduce` is a copy).
    collective: Option<Mutex<Box<dyn HostCollective>>>,
    /// The Step runs' collectives, timed in a data-parallel run (the first run left out): they
    /// hold the executor thread, so all of it is exposed.
    comm: CommTimes,
    step_runs: u32,
}

impl CpuExecutor {
    /// Plans memory for the programs (which must include `Step`), allocates the arena once
    /// and compiles every kernel, at the selected instruction-set level
    /// ([`fusec_codegen_cpu::isa::selected`]: an error names a bad `FUSEC_CPU_ISA`, as
    /// [`fusec_codegen_cpu::gemm::tiles_per_core`] does a bad `FUSEC_GEMM_TILES_PER_CORE`).
    pub fn new(run: &RunPrograms, threads: usize, profile: bool) -> Result<(CpuExecutor, CpuBuild), String> {
        fusec_codegen_cpu::gemm::tiles_per_core()?;
        Self::with_isa(run, threads, profile, fusec_codegen_cpu::isa::selected()?)
    }

    /// [`CpuExecutor::new`] at level `isa` (tests run every level the host supports).
    pub fn with_isa(run: &RunPrograms, threads: usize, profile: bool, isa: Isa) -> Result<(CpuExecutor, CpuBuild), String> {
        let t0 = Instant::now();
        let plan = LaunchPlan::new(run)?;
        if let Some(free) = arena::host_available_bytes().filter(|&free| plan.planned_bytes > free) {
            return Err(format!("{}; this host has {} available", plan.too_large(), crate::launches::mib(free)));
        }
        let arena = Arena::new(plan.planned_bytes)?;
        let mut kc = KernelCompiler::for_isa(isa)?;
        let mut programs = HashMap::new();
        for (p, launches, io) in &plan.programs {
            let launches = launch::translate(launches, &run.bind, &mut kc, arena.base()).map_err(|e| format!("{p:?} program: {e}"))?;
            programs.insert(*p, Compiled { launches, io: io.clone() });
        }
        let attn = AttnScratch::new(programs.values().flat_map(|c: &Compiled| &c.launches).filter_map(|l| match &l.kind {
            Kind::Attention { attn, keep, .. } => Some((attn, *keep)),
            _ => None,
        }));
        let (scores, kept) = attn.size();
        let build = CpuBuild {
            compile_time: t0.elapsed(),
            kernels: kc.stats(),
            arena_bytes: arena.size() as u64,
            step_plan: plan.step_plan,
            isa,
            attention: (scores, kept, launch::keep_budget()),
        };
        let ex = CpuExecutor {
            arena,
            layout: plan.layout,
            programs,
            types: plan.tensors,
            threads: threads.max(1),
            isa,
            attn,
            profile: profile.then(Profile::default),
            collective: None,
            comm: CommTimes::default(),
            step_runs: 0,
        };
        Ok((ex, build))
    }

    /// Makes this executor one rank of a data-parallel run: `all_reduce` launches go through `c`.
    pub fn set_collective(&mut self, c: Box<dyn HostCollective>) {
        self.collective = Some(Mutex::new(c));
    }

    /// Runs the launches of `program` whose name passes `keep`, calling `after(name)` after
    /// each (benchmarks time subsets such as the GEMMs alone; tests attribute allocations).
    pub fn run_traced(
        &mut self,
        program: Program,
        keep: impl Fn(&str) -> bool + Send,
        mut after: impl FnMut(&str) + Send,
    ) -> Result<(), String> {
        self.on_pool(move |ex| {
            let prog = ex.compiled(program)?;
            for l in prog.launches.iter().filter(|l| keep(&l.name)) {
                // SAFETY: launches were built against this arena's plan.
                unsafe { ex.exec(l) }?;
                after(&l.name);
            }
            Ok(())
        })
    }

    /// Runs `f` on the pool of `threads` from one of its own threads: the launches' parallel
    /// loops (kernels, products, attention) then all start on the pool the last one used,
    /// without handing the work across threads or waking a second pool for each launch.
    fn on_pool<R: Send>(&mut self, f: impl FnOnce(&mut CpuExecutor) -> R + Send) -> R {
        let on_pool = rayon::current_thread_index().is_some() && rayon::current_num_threads() == self.threads;
        if self.threads <= 1 || on_pool {
            return f(self);
        }
        let pool = fusec_codegen_cpu::thread_pool(self.threads);
        let lent = Lent(self);
        pool.install(move || {
            let lent = lent;
            f(lent.0)
        })
    }

    /// The compiled `program`, or an error naming it.
    fn compiled(&self, program: Program) -> Result<&Compiled, String> {
        self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))
    }

    /// Each launch of `program`, in order: its name and static FLOPs (benchmarks time them one
    /// at a time with [`CpuExecutor::run_launch`]).
    pub fn launch_flops(&self, program: Program) -> Vec<(String, u64)> {
        self.programs.get(&program).map_or(vec![], |p| p.launches.iter().map(|l| (l.name.clone(), l.flops)).collect())
    }

    /// Runs launch `i` of `program` alone, on whatever its operands hold (a benchmark's timing
    /// of one product; what it writes is left for the next run to overwrite).
    pub fn run_launch(&mut self, program: Program, i: usize) -> Result<(), String> {
        self.on_pool(|ex| {
            let prog = ex.compiled(program)?;
            let l = prog.launches.get(i).ok_or_else(|| format!("program {program:?} has no launch {i}"))?;
            // SAFETY: launches were built against this arena's plan.
            unsafe { ex.exec(l) }
        })
    }

    /// Static FLOPs of one run of `program`, split into (GEMM launches, the rest).
    pub fn flops(&self, program: Program) -> (u64, u64) {
        let mut f = (0, 0);
        if let Some(p) = self.programs.get(&program) {
            for l in &p.launches {
                if matches!(l.kind, Kind::Gemm(_)) {
                    f.0 += l.flops;
                } else {
                    f.1 += l.flops;
                }
            }
        }
        f
    }

    fn place(&self, name: &str) -> Result<(u64, DType, usize), String> {
        let (off, _) = self.layout.named.get(name).ok_or_else(|| format!("no tensor named `{name}`"))?;
        let (dt, shape) = &self.types[name];
        Ok((*off, *dt, shape.iter().product()))
    }

    /// A typed view of `n` elements at byte offset `off`.
    ///
    /// # Safety
    /// The range must lie inside the arena and hold `T`s.
    unsafe fn slice<T>(&self, off: u64, n: usize) -> &'static mut [T] {
        std::slice::from_raw_parts_mut(self.arena.base().add(off as usize) as *mut T, n)
    }

    unsafe fn exec(&self, l: &Launch) -> Result<(), String> {
        let f = |off: u64, n: usize| self.slice::<f32>(off, n);
        let base = self.arena.base();
        match &l.kind {
            Kind::Gemm(p) => product::run(base, p, self.isa, self.threads),
            Kind::Kernel { k, ins, outs } => k.run(ins, outs, self.threads),
            Kind::Gather(g) => ops::gather(f(g.table, g.rows * g.cols), g.cols, self.slice::<i32>(g.idx, g.n), f(g.out, g.n * g.cols))?,
            Kind::ScatterAdd(s) => {
                ops::scatter_add(f(s.src, s.n * s.cols), s.cols, self.slice::<i32>(s.idx, s.n), f(s.out, s.rows * s.cols))?
            }
            Kind::Attention { stages, attn, keep } => self.attn.run(base, stages, attn, *keep),
            Kind::Iota(it) => {
                let n: usize = it.shape.iter().product();
                let inner: usize = it.shape[it.axis + 1..].iter().product();
                let len = it.shape[it.axis];
                self.fill_with(it.out, it.dtype, n, |i| ((i / inner) % len) as f64);
            }
            Kind::Fill(fl) => self.fill_with(fl.out, fl.dtype, fl.n, |_| fl.value),
            Kind::Collective(parts) => self.collective(parts)?,
        }
        Ok(())
    }

    /// One collective over `parts`, laid end to end as f32 (bf16 widened and rounded back):
    /// their mean over the ranks, or each from its owner; without a collective (one rank) a
    /// copy from each `x` to its `y`.
    ///
    /// # Safety
    /// Every range must lie inside the arena.
    unsafe fn collective(&self, parts: &[CollectivePart]) -> Result<(), String> {
        let Some(mut c) = self.locked()? else {
            for p in parts.iter().filter(|p| p.x != p.y) {
                let bytes = p.n * p.dtype.size_bytes();
                std::ptr::copy_nonoverlapping(self.arena.base().add(p.x as usize), self.arena.base().add(p.y as usize), bytes);
            }
            return Ok(());
        };
        let mut flat: Vec<f32> = Vec::with_capacity(parts.iter().map(|p| p.n).sum());
        for p in parts {
            match p.dtype {
                DType::BF16 => flat.extend(self.slice::<u16>(p.x, p.n).iter().map(|&b| widen_bits(b))),
                _ => flat.extend_from_slice(self.slice::<f32>(p.x, p.n)),
            }
        }
        let owners: Option<Vec<(usize, usize)>> = parts.iter().map(|p| p.owner.map(|o| (p.n, o))).collect();
        match owners {
            Some(segments) => c.from_owners(&mut flat, &segments)?,
            None => c.all_reduce_mean(&mut flat)?,
        }
        let mut at = 0;
        for p in parts {
            let vals = &flat[at..at + p.n];
            match p.dtype {
                DType::BF16 => self.slice::<u16>(p.y, p.n).iter_mut().zip(vals).for_each(|(b, &v)| *b = bf16_bits(v)),
                _ => self.slice::<f32>(p.y, p.n).copy_from_slice(vals),
            }
            at += p.n;
        }
        Ok(())
    }

    /// The collective of a data-parallel run, locked; `None` on one rank.
    fn locked(&self) -> Result<Option<MutexGuard<'_, Box<dyn HostCollective>>>, String> {
        self.collective.as_ref().map(|c| c.lock().map_err(|_| "the collective was poisoned by an earlier panic".to_string())).transpose()
    }

    /// Writes `value(i)` to element `i` of the `n` elements of type `dt` at `off` (rounded to
    /// the type: i32 truncates as the launch plan's values are integers there).
    ///
    /// # Safety
    /// The range must lie inside the arena.
    unsafe fn fill_with(&self, off: u64, dt: DType, n: usize, value: impl Fn(usize) -> f64) {
        match dt {
            DType::I32 => self.slice::<i32>(off, n).iter_mut().enumerate().for_each(|(i, d)| *d = value(i) as i32),
            DType::BF16 => self.slice::<u16>(off, n).iter_mut().enumerate().for_each(|(i, d)| *d = bf16_bits(value(i) as f32)),
            _ => self.slice::<f32>(off, n).iter_mut().enumerate().for_each(|(i, d)| *d = value(i) as f32),
        }
    }

    /// The `n` elements of type `dt` at `off`, as f64.
    ///
    /// # Safety
    /// The range must lie inside the arena.
    unsafe fn read(&self, off: u64, dt: DType, n: usize) -> Vec<f64> {
        match dt {
            DType::I32 => self.slice::<i32>(off, n).iter().map(|&x| x as f64).collect(),
            DType::BF16 => self.slice::<u16>(off, n).iter().map(|&x| widen_bits(x) as f64).collect(),
            _ => self.slice::<f32>(off, n).iter().map(|&x| x as f64).collect(),
        }
    }
}

impl Executor for CpuExecutor {
    fn set(&mut self, name: &str, t: Tensor) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        if t.data.len() != n {
            return Err(format!("`{name}` holds {n} elements, got {}", t.data.len()));
        }
        // SAFETY: the named range is inside the arena and typed `dt`.
        unsafe { self.fill_with(off, dt, n, |i| t.data[i]) };
        Ok(())
    }

    fn get(&self, name: &str) -> Result<Tensor, String> {
        let (off, dt, n) = self.place(name)?;
        let shape = self.types[name].1.clone();
        // SAFETY: as in `set`.
        let data = unsafe { self.read(off, dt, n) };
        Ok(Tensor { dtype: dt, shape, data })
    }

    fn set_f32(&mut self, name: &str, dtype: DType, _shape: &[usize], data: &[f32]) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        if dt != dtype || !matches!(dt, DType::F32 | DType::BF16) {
            return Err(format!("`{name}` is {dt} here, set as {dtype}"));
        }
        if data.len() != n {
            return Err(format!("`{name}` holds {n} elements, got {}", data.len()));
        }
        // SAFETY: the named range is inside the arena and of type `dt`.
        match dt {
            // f32 to f64 and back is exact: `fill_with` rounds once, to bf16.
            DType::BF16 => unsafe { self.fill_with(off, dt, n, |i| data[i] as f64) },
            _ => unsafe { self.slice::<f32>(off, n) }.copy_from_slice(data),
        }
        Ok(())
    }

    fn get_f32(&self, name: &str, out: &mut Vec<f32>) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        out.clear();
        // SAFETY: as in `set_f32`.
        match dt {
            DType::F32 => out.extend_from_slice(unsafe { self.slice::<f32>(off, n) }),
            DType::BF16 => out.extend(unsafe { self.slice::<u16>(off, n) }.iter().map(|&x| widen_bits(x))),
            _ => return Err(format!("`{name}` is {dt}, not a float tensor")),
        }
        Ok(())
    }

    fn profile(&self) -> Option<Profile> {
        self.profile.clone()
    }

    fn comm_times(&self) -> Option<Result<CommTimes, String>> {
        self.collective.is_some().then_some(Ok(self.comm))
    }

    fn all_reduce_host(&mut self, values: &mut [f32]) -> Result<(), String> {
        self.locked()?.map_or(Ok(()), |mut c| c.all_reduce_mean(values))
    }

    fn from_owner_host(&mut self, values: &mut [f32], owner: usize) -> Result<(), String> {
        self.locked()?.map_or(Ok(()), |mut c| c.from_owners(values, &[(values.len(), owner)]))
    }

    fn roof_key(&self, operands: DType) -> Option<String> {
        Some(format!("cpu {} · {} threads · {} · {operands} products", peak::cpu_model(), self.threads, self.isa.name()))
    }

    fn measure_limits(&mut self, operands: DType) -> Result<Limits, String> {
        peak::measure(operands, self.isa, self.threads)
    }

    fn output(&self, program: Program, name: &str) -> Result<Tensor, String> {
        let prog = self.compiled(program)?;
        let (off, dt, shape) = prog.io.outputs.get(name).ok_or_else(|| format!("{program:?} has no output `{name}`"))?;
        let n = shape.iter().product();
        // SAFETY: outputs live in the arena until the next run.
        let data = unsafe { self.read(*off, *dt, n) };
        Ok(Tensor { dtype: *dt, shape: shape.clone(), data })
    }

    fn set_zeros(&mut self, name: &str, _dtype: DType, _shape: Vec<usize>) -> Result<(), String> {
        let (off, bytes) = *self.layout.named.get(name).ok_or_else(|| format!("no tensor named `{name}`"))?;
        // SAFETY: the named range is inside the arena.
        unsafe { std::ptr::write_bytes(self.arena.base().add(off as usize), 0, bytes as usize) };
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<(), String> {
        let (off, bytes) = self.layout.grads;
        // SAFETY: the gradient region is inside the arena: one memset.
        unsafe { std::ptr::write_bytes(self.arena.base().add(off as usize), 0, bytes as usize) };
        Ok(())
    }

    fn run(&mut self, program: Program) -> Result<StepOutputs, String> {
        self.on_pool(|ex| ex.run_launches(program))
    }
}

/// The executor lent to a pool thread for one call of [`CpuExecutor::on_pool`].
struct Lent<'a>(&'a mut CpuExecutor);

// SAFETY: `install` blocks the lending thread until the closure returns, so one thread at a time
// uses the executor; its raw pointers address its own arena and launch tables (no
// thread-affine state: the arena is plain memory, the collective a socket behind a mutex).
unsafe impl Send for Lent<'_> {}

impl CpuExecutor {
    /// [`Executor::run`]'s launches, on the calling thread's pool.
    fn run_launches(&mut self, program: Program) -> Result<StepOutputs, String> {
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let mut profile = self.profile.take();
        let timed = profile.as_mut().is_some_and(|p| p.begin(program));
        let mut first = None;
        // A traced step also records where each thread spent each launch.
        let traced = timed && profile.as_ref().is_some_and(|p| p.tracing_now());
        let time_comm = program == Program::Step && self.collective.is_some();
        let mut comm_ms = 0.0;
        for (i, l) in prog.launches.iter().enumerate() {
            if traced {
                thread_spans::start();
            }
            let t_comm = (time_comm && matches!(l.kind, Kind::Collective(_))).then(Instant::now);
            let t0 = timed.then(Instant::now);
            // SAFETY: launches were built against this arena's plan.
            let r = unsafe { self.exec(l) }.map_err(|e| format!("{} ({program:?} launch {i}): {e}", l.name));
            comm_ms += t_comm.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
            if let (Some(p), Some(t0)) = (profile.as_mut(), t0) {
                let dur = t0.elapsed();
                let threads = if traced { thread_spans::take(t0) } else { vec![] };
                let start = t0 - *first.get_or_insert(t0);
                p.record(Timed { name: &l.name, bytes: l.bytes, flops: l.flops, ops: &l.ops, start, dur, threads: &threads });
            }
            if r.is_err() {
                self.profile = profile;
                return r.map(|_| StepOutputs::default());
            }
        }
        self.profile = profile;
        if time_comm {
            self.step_runs += 1;
            if self.step_runs > 1 {
                self.comm.steps += 1;
                self.comm.busy_ms += comm_ms;
                self.comm.exposed_ms += comm_ms;
            }
        }
        let mut out = StepOutputs::default();
        for (name, off, _) in &prog.io.scalars {
            // SAFETY: scalar outputs are inside the arena (f32).
            out.set(name, unsafe { self.slice::<f32>(*off, 1)[0] as f64 });
        }
        Ok(out)
    }
}
