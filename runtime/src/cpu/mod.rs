//! The CPU target: one arena from the memory plans, Cranelift-compiled fused kernels, GEMMs
//! through the `gemm` crate, native attention and embedding ops, per-launch timing.

mod arena;
pub(crate) mod launch;
pub mod ops;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fusec_codegen_cpu::gemm::gemm_f32;
use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::interp::Tensor;
use fusec_ir::DType;
use fusec_passes::memplan::MemPlan;

use crate::executor::{Executor, StepOutputs};
use crate::launches::{LaunchPlan, ProgramIo};
use crate::layout::SharedLayout;
use crate::profile::Profile;
use crate::programs::{Program, RunPrograms};
use arena::Arena;
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
}

/// Runs the programs of a training run on the CPU.
pub struct CpuExecutor {
    arena: Arena,
    layout: SharedLayout,
    programs: HashMap<Program, Compiled>,
    types: HashMap<String, (DType, Vec<usize>)>,
    threads: usize,
    /// Per-head score matrices of attention (`p` and `ds`), outside the memory plan: sized once
    /// for the largest attention.
    attn_scratch: Vec<f32>,
    /// Per-launch timings, when profiling.
    pub profile: Option<Profile>,
}

impl CpuExecutor {
    /// Plans memory for the programs (which must include `Step`), allocates the arena once
    /// and compiles every kernel.
    pub fn new(run: &RunPrograms, threads: usize, profile: bool) -> Result<(CpuExecutor, CpuBuild), String> {
        let t0 = Instant::now();
        let plan = LaunchPlan::new(run)?;
        if let Some(free) = arena::host_available_bytes().filter(|&free| plan.planned_bytes > free) {
            return Err(format!("{}; this host has {} available", plan.too_large(), crate::launches::mib(free)));
        }
        let arena = Arena::new(plan.planned_bytes)?;
        let mut kc = KernelCompiler::new()?;
        let mut programs = HashMap::new();
        for (p, launches, io) in &plan.programs {
            let launches = launch::translate(launches, &run.bind, &mut kc, arena.base()).map_err(|e| format!("{p:?} program: {e}"))?;
            programs.insert(*p, Compiled { launches, io: io.clone() });
        }
        let attn = programs
            .values()
            .flat_map(|c: &Compiled| &c.launches)
            .filter_map(|l| match &l.kind {
                Kind::Attention { attn, .. } => Some(2 * attn.dims.s * attn.dims.h * attn.dims.t * attn.dims.t),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let build =
            CpuBuild { compile_time: t0.elapsed(), kernels: kc.stats(), arena_bytes: arena.size() as u64, step_plan: plan.step_plan };
        let ex = CpuExecutor {
            arena,
            layout: plan.layout,
            programs,
            types: plan.tensors,
            threads: threads.max(1),
            attn_scratch: vec![0f32; attn],
            profile: profile.then(Profile::default),
        };
        Ok((ex, build))
    }

    /// Runs the launches of `program` whose name passes `keep`, calling `after(name)` after
    /// each (benchmarks time subsets such as the GEMMs alone; tests attribute allocations).
    pub fn run_traced(&mut self, program: Program, keep: impl Fn(&str) -> bool, mut after: impl FnMut(&str)) -> Result<(), String> {
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        for l in prog.launches.iter().filter(|l| keep(&l.name)) {
            // SAFETY: launches were built against this arena's plan.
            unsafe { self.exec(l) }?;
            after(&l.name);
        }
        Ok(())
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
        match &l.kind {
            Kind::Gemm(p) => {
                let spec = &p.spec;
                let yn = spec.y_len();
                let yv = f(p.y, yn);
                if let Some(acc) = p.acc.filter(|acc| *acc != p.y) {
                    yv.copy_from_slice(f(acc, yn));
                }
                let bias = p.bias.map(|o| &*f(o, spec.n));
                let pre = p.pre.map(|o| f(o, yn));
                gemm_f32(spec, f(p.a, spec.a_len()), f(p.b, spec.b_len()), bias, yv, pre, self.threads);
            }
            Kind::Kernel { k, ins, outs } => k.run(ins, outs, self.threads),
            Kind::Gather(g) => ops::gather(f(g.table, g.rows * g.cols), g.cols, self.slice::<i32>(g.idx, g.n), f(g.out, g.n * g.cols))?,
            Kind::ScatterAdd(s) => {
                ops::scatter_add(f(s.src, s.n * s.cols), s.cols, self.slice::<i32>(s.idx, s.n), f(s.out, s.rows * s.cols))?
            }
            Kind::Attention { stage, attn } => {
                let (dm, t) = (attn.dims, attn.at);
                let at = |o: u64| self.arena.base().add(o as usize) as *mut f32;
                let heads = dm.s * dm.h * dm.t * dm.t;
                let scratch = self.attn_scratch.as_ptr() as *mut f32;
                let ptrs = ops::AttnPtrs {
                    qkv: at(t.qkv),
                    out: at(t.out),
                    lse: at(t.lse),
                    dout: t.dout.map_or(std::ptr::null(), |o| at(o) as *const f32),
                    dqkv: t.dqkv.map_or(std::ptr::null_mut(), at),
                    p: scratch,
                    ds: scratch.add(heads),
                };
                ops::attention_stage(*stage, dm, attn.scale, ptrs)
            }
            Kind::Iota(it) => {
                let n: usize = it.shape.iter().product();
                let inner: usize = it.shape[it.axis + 1..].iter().product();
                let len = it.shape[it.axis];
                for i in 0..n {
                    let x = (i / inner) % len;
                    match it.dtype {
                        DType::I32 => self.slice::<i32>(it.out, n)[i] = x as i32,
                        _ => f(it.out, n)[i] = x as f32,
                    }
                }
            }
            Kind::Fill(fl) => match fl.dtype {
                DType::I32 => self.slice::<i32>(fl.out, fl.n).fill(fl.value as i32),
                _ => f(fl.out, fl.n).fill(fl.value as f32),
            },
        }
        Ok(())
    }
}

impl Executor for CpuExecutor {
    fn set(&mut self, name: &str, t: Tensor) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        if t.data.len() != n {
            return Err(format!("`{name}` holds {n} elements, got {}", t.data.len()));
        }
        // SAFETY: the named range is inside the arena and typed `dt`.
        unsafe {
            match dt {
                DType::I32 => self.slice::<i32>(off, n).iter_mut().zip(&t.data).for_each(|(d, s)| *d = *s as i32),
                _ => self.slice::<f32>(off, n).iter_mut().zip(&t.data).for_each(|(d, s)| *d = *s as f32),
            }
        }
        Ok(())
    }

    fn get(&self, name: &str) -> Result<Tensor, String> {
        let (off, dt, n) = self.place(name)?;
        let shape = self.types[name].1.clone();
        // SAFETY: as in `set`.
        let data = unsafe {
            match dt {
                DType::I32 => self.slice::<i32>(off, n).iter().map(|&x| x as f64).collect(),
                _ => self.slice::<f32>(off, n).iter().map(|&x| x as f64).collect(),
            }
        };
        Ok(Tensor { dtype: dt, shape, data })
    }

    fn set_f32(&mut self, name: &str, dtype: DType, _shape: &[usize], data: &[f32]) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        if dt != DType::F32 || dtype != DType::F32 {
            return Err(format!("`{name}` is {dt} here: the CPU target holds f32 tensors only (set as {dtype})"));
        }
        if data.len() != n {
            return Err(format!("`{name}` holds {n} elements, got {}", data.len()));
        }
        // SAFETY: the named range is inside the arena and typed f32.
        unsafe { self.slice::<f32>(off, n) }.copy_from_slice(data);
        Ok(())
    }

    fn get_f32(&self, name: &str, out: &mut Vec<f32>) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        if dt != DType::F32 {
            return Err(format!("`{name}` is {dt}, not a float tensor"));
        }
        out.clear();
        // SAFETY: as in `set_f32`.
        out.extend_from_slice(unsafe { self.slice::<f32>(off, n) });
        Ok(())
    }

    fn profile(&self) -> Option<Profile> {
        self.profile.clone()
    }

    fn output(&self, program: Program, name: &str) -> Result<Tensor, String> {
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let (off, dt, shape) = prog.io.outputs.get(name).ok_or_else(|| format!("{program:?} has no output `{name}`"))?;
        let n = shape.iter().product();
        // SAFETY: outputs live in the arena until the next run.
        let data = unsafe {
            match dt {
                DType::I32 => self.slice::<i32>(*off, n).iter().map(|&x| x as f64).collect(),
                _ => self.slice::<f32>(*off, n).iter().map(|&x| x as f64).collect(),
            }
        };
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
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let mut profile = self.profile.take();
        let timed = profile.as_mut().is_some_and(|p| p.begin(program));
        for (i, l) in prog.launches.iter().enumerate() {
            let t0 = timed.then(Instant::now);
            // SAFETY: launches were built against this arena's plan.
            let r = unsafe { self.exec(l) }.map_err(|e| format!("{} ({program:?} launch {i}): {e}", l.name));
            if let (Some(p), Some(t0)) = (profile.as_mut(), t0) {
                p.record(&l.name, l.bytes, l.flops, t0.elapsed());
            }
            if r.is_err() {
                self.profile = profile;
                return r.map(|_| StepOutputs::default());
            }
        }
        self.profile = profile;
        let mut out = StepOutputs::default();
        for (name, off, _) in &prog.io.scalars {
            // SAFETY: scalar outputs are inside the arena (f32).
            out.set(name, unsafe { self.slice::<f32>(*off, 1)[0] as f64 });
        }
        Ok(out)
    }
}
