//! The CPU target: one arena from the memory plans, Cranelift-compiled fused kernels, GEMMs
//! through the `gemm` crate, native attention and embedding ops, per-launch timing.

pub(crate) mod launch;
pub(crate) mod layout;
pub mod ops;
pub mod profile;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fusec_codegen_cpu::gemm::gemm_f32;
use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::interp::Tensor;
use fusec_ir::{Bindings, DType, Graph};
use fusec_passes::memplan::{memplan, MemPlan, MemplanOptions};

use crate::executor::{Executor, Program, StepOutputs};
use launch::{Kind, Launch};
use layout::{Arena, SharedLayout};
use profile::Profile;

/// One compiled program: its launches and where its scalar outputs land.
struct Compiled {
    launches: Vec<Launch>,
    scalars: Vec<(String, u64, DType)>,
    outputs: HashMap<String, (u64, DType, Vec<usize>)>,
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
    /// Plans memory for the scheduled programs (which must include `Step`), allocates the arena
    /// once and compiles every kernel.
    pub fn new(
        graphs: &HashMap<Program, Graph>,
        bind: &Bindings,
        threads: usize,
        profile: bool,
    ) -> Result<(CpuExecutor, CpuBuild), String> {
        let t0 = Instant::now();
        let step = graphs.get(&Program::Step).ok_or("the CPU target needs the Step program")?;
        let mut plans = HashMap::new();
        for (p, g) in graphs {
            plans.insert(*p, memplan(g, bind, &MemplanOptions::default()).map_err(|e| format!("memory plan of {p:?}: {e}"))?);
        }
        let layout = SharedLayout::new(step, &plans[&Program::Step]);
        let arena_max = plans.values().map(|p| p.arena_bytes).max().unwrap_or(0);
        let arena = Arena::new(layout.persistent_bytes + arena_max)?;
        let mut kc = KernelCompiler::new()?;
        let mut programs = HashMap::new();
        let mut types = HashMap::new();
        for (p, g) in graphs {
            let plan = &plans[p];
            let launches = launch::launches(g, plan, &layout, bind, &mut kc, arena.base()).map_err(|e| format!("{p:?} program: {e}"))?;
            let mut scalars = vec![];
            let mut outputs = HashMap::new();
            for (name, v) in &g.outputs {
                let (off, ty) = (layout.offset(g, plan, *v)?, g.ty(*v));
                if ty.shape.rank() == 0 {
                    scalars.push((name.clone(), off, ty.dtype));
                }
                outputs.insert(name.clone(), (off, ty.dtype, ty.shape.eval(bind)?.into_iter().map(|d| d as usize).collect()));
            }
            for (name, v) in g.params().into_iter().chain(g.inputs()) {
                types.insert(name.to_string(), (g.ty(v).dtype, g.ty(v).shape.eval(bind)?.into_iter().map(|d| d as usize).collect()));
            }
            programs.insert(*p, Compiled { launches, scalars, outputs });
        }
        let build = CpuBuild {
            compile_time: t0.elapsed(),
            kernels: kc.stats(),
            arena_bytes: arena.size() as u64,
            step_plan: plans.remove(&Program::Step).expect("checked above"),
        };
        let profile = profile.then(Profile::default);
        let attn = programs
            .values()
            .flat_map(|c: &Compiled| &c.launches)
            .filter_map(|l| match &l.kind {
                Kind::Attention { dm, .. } => Some(2 * dm.s * dm.h * dm.t * dm.t),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let attn_scratch = vec![0f32; attn];
        Ok((CpuExecutor { arena, layout, programs, types, threads: threads.max(1), attn_scratch, profile }, build))
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
                if matches!(l.kind, Kind::Gemm { .. }) {
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
            Kind::Gemm { spec, a, b, bias, acc, y, pre } => {
                let yn = spec.y_len();
                let yv = f(*y, yn);
                if let Some(acc) = acc.filter(|acc| acc != y) {
                    yv.copy_from_slice(f(acc, yn));
                }
                let bias = bias.map(|o| &*f(o, spec.n));
                let pre = pre.map(|o| f(o, yn));
                gemm_f32(spec, f(*a, spec.a_len()), f(*b, spec.b_len()), bias, yv, pre, self.threads);
            }
            Kind::Kernel { k, ins, outs } => k.run(ins, outs, self.threads),
            Kind::Gather { table, rows, cols, idx, n, out } => {
                ops::gather(f(*table, rows * cols), *cols, self.slice::<i32>(*idx, *n), f(*out, n * cols))?
            }
            Kind::ScatterAdd { src, cols, idx, n, out, rows } => {
                ops::scatter_add(f(*src, n * cols), *cols, self.slice::<i32>(*idx, *n), f(*out, rows * cols))?
            }
            Kind::Attention { stage, dm, scale, t } => {
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
                ops::attention_stage(*stage, *dm, *scale, ptrs)
            }
            Kind::Iota { shape, axis, dtype, out } => {
                let n: usize = shape.iter().product();
                let inner: usize = shape[axis + 1..].iter().product();
                let len = shape[*axis];
                for i in 0..n {
                    let x = (i / inner) % len;
                    match dtype {
                        DType::I32 => self.slice::<i32>(*out, n)[i] = x as i32,
                        _ => f(*out, n)[i] = x as f32,
                    }
                }
            }
            Kind::Fill { value, dtype, n, out } => match dtype {
                DType::I32 => self.slice::<i32>(*out, *n).fill(*value as i32),
                _ => f(*out, *n).fill(*value as f32),
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

    fn profile(&self) -> Option<Profile> {
        self.profile.clone()
    }

    fn output(&self, program: Program, name: &str) -> Result<Tensor, String> {
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let (off, dt, shape) = prog.outputs.get(name).ok_or_else(|| format!("{program:?} has no output `{name}`"))?;
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
        for (i, l) in prog.launches.iter().enumerate() {
            let t0 = profile.is_some().then(Instant::now);
            // SAFETY: launches were built against this arena's plan.
            let r = unsafe { self.exec(l) }.map_err(|e| format!("{} ({program:?} launch {i}): {e}", l.name));
            if let (Some(p), Some(t0)) = (profile.as_mut(), t0) {
                p.record(program, i, l, t0.elapsed());
            }
            if r.is_err() {
                self.profile = profile;
                return r.map(|_| StepOutputs::default());
            }
        }
        self.profile = profile;
        let mut out = StepOutputs::default();
        for (name, off, _) in &prog.scalars {
            // SAFETY: scalar outputs are inside the arena (f32).
            out.set(name, unsafe { self.slice::<f32>(*off, 1)[0] as f64 });
        }
        Ok(out)
    }
}
