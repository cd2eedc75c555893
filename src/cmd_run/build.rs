//! Building the executor of `fusec run` for its target, and the summary rows that describe the
//! build (kernels, device, memory).

use std::time::{Duration, Instant};

use fusec_runtime::dist::launch_env::LaunchEnv;
use fusec_runtime::dist::star::TcpStar;

use fusec_codegen_cpu::gemm;
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::cuda::CudaExecutor;
use fusec_runtime::executor::{Executor, RefExecutor};
use fusec_runtime::profile::Profile;
use fusec_runtime::programs::RunPrograms;

use super::args::{RunArgs, Target};
use crate::report::mib;

/// An executor and the summary rows of its build.
pub struct Built {
    /// The executor.
    pub ex: Box<dyn Executor>,
    /// Summary rows: (label, value).
    pub summary: Vec<(String, String)>,
    /// The build's phases, one after the other from its start (the `--trace` compile track).
    pub phases: Vec<(String, Duration)>,
}

/// The profile the executor keeps: every step after the warm-up (`--profile`, `--profile-json`),
/// and with `--trace` the first of them recorded in order (or that step alone), else none.
fn profile(a: &RunArgs) -> Option<Profile> {
    let every = a.profile || a.profile_json.is_some();
    match &a.trace {
        Some(_) => Some(Profile::tracing(every)),
        None => every.then(Profile::default),
    }
}

/// Builds the executor for `a.target` (memory planning, code generation, the one allocation,
/// refused with both numbers when it does not fit the free memory); in a data-parallel run
/// (`dist`), connected to the other ranks.
pub fn executor(a: &RunArgs, run: &RunPrograms, threads: usize, dist: Option<&LaunchEnv>) -> Result<Built, String> {
    let profile = profile(a);
    let mut summary: Vec<(String, String)> = vec![];
    let mut phases = vec![];
    let ex: Box<dyn Executor> = match a.target {
        Target::Ref => Box::new(RefExecutor::new(run, fusec_ir::interp::Rounding::F32)),
        Target::Cpu => {
            let (mut ex, build) = CpuExecutor::new(run, threads, profile.is_some())?;
            ex.profile = profile;
            phases.push(("memory plans, launch lists, Cranelift".to_string(), build.compile_time));
            if let Some(env) = dist {
                let t = Instant::now();
                ex.set_collective(Box::new(TcpStar::connect(env, super::ranks::timeout(a))?));
                phases.push(("rendezvous".to_string(), t.elapsed()));
                summary.push(("ranks".into(), ranks_row(env, run, "through rank 0 over TCP")?));
            }
            summary.push(("cpu isa".into(), build.isa.describe()));
            let (tiles, per_core) = (gemm::min_tiles(), gemm::tiles_per_core()?);
            let env = gemm::TILES_ENV;
            summary.push(("products".into(), format!("cut into at least {tiles} tiles each ({per_core} a core; {env}=1..16 sets it)")));
            let plan = &build.step_plan;
            let (compiled, hits) = build.kernels;
            summary.push(("kernels".into(), format!("{compiled} compiled, {hits} cache hits (identical kernels compile once)")));
            summary.push((
                "memory".into(),
                format!(
                    "one allocation of {} (persistent {}, activations {}; lower bound {}, naive {})",
                    mib(build.arena_bytes),
                    mib(plan.persistent_bytes),
                    mib(build.arena_bytes - plan.persistent_bytes),
                    mib(plan.peak_live_bytes),
                    mib(plan.naive_bytes)
                ),
            ));
            let (bytes, kept, budget) = build.attention;
            if bytes > 0 {
                let why = match kept {
                    0 => "score matrices; the backward recomputes the probabilities".to_string(),
                    n => format!(
                        "score matrices and {n} layers' probabilities kept for the backward (at most {}; FUSEC_CPU_KEEP_SCORES_MIB sets it)",
                        mib(budget)
                    ),
                };
                summary.push(("attention".into(), format!("{} outside the allocation: {why}", mib(bytes))));
            }
            Box::new(ex)
        }
        Target::Cuda => {
            let (mut ex, build) = CudaExecutor::new(run, &a.cuda_options(profile.is_some()))?;
            ex.profile = profile;
            phases = build.phases.iter().map(|(n, d)| (n.to_string(), *d)).collect();
            if let Some(env) = dist {
                let t = Instant::now();
                ex.join_ranks(env, super::ranks::timeout(a), !a.no_comm_overlap)?;
                phases.push(("rendezvous, NCCL".to_string(), t.elapsed()));
                let how = if a.no_comm_overlap { "by NCCL on the step's stream" } else { "by NCCL on a second stream, beside the backward" };
                summary.push(("ranks".into(), ranks_row(env, run, how)?));
            }
            let k = &build.kernels;
            let math = if a.no_tf32 { ", exact fp32" } else { ", TF32" };
            summary.push(("device".into(), format!("{} (NVRTC {}.{}){math}", build.device, build.nvrtc.0, build.nvrtc.1)));
            summary.push((
                "kernels".into(),
                format!(
                    "{} launches from {} modules: {} compiled ({} in worker processes), {} from the disk cache",
                    k.kernels, k.modules, k.compiled, k.in_workers, k.disk_hits
                ),
            ));
            if a.timings {
                outln!("CUDA modules, slowest first ({} compiled, {} from the disk cache):", k.compiled, k.disk_hits)?;
                for (name, cached, t) in &build.modules {
                    outln!("  {name:<40} {:<10} {:>8.1} ms", if *cached { "disk cache" } else { "NVRTC" }, t.as_secs_f64() * 1e3)?;
                }
            }
            let all = build.opened.iter().chain(&build.phases);
            let times: Vec<String> = all.map(|(n, d)| format!("{n} {:.0} ms", d.as_secs_f64() * 1e3)).collect();
            let ms = build.compile_time.as_secs_f64() * 1e3;
            summary.push(("gpu build".into(), format!("{ms:.0} ms: {}; {}", times.join(" · "), build.arch)));
            summary.push(("attention".into(), build.attention.clone()));
            summary.push(("products".into(), products_row(&build)));
            summary.push((
                "memory".into(),
                format!(
                    "one device allocation of {} (persistent {}, activations {}, scratch {})",
                    mib(build.device_bytes),
                    mib(build.step_plan.persistent_bytes),
                    mib(build.step_plan.arena_bytes),
                    mib(build.scratch_bytes)
                ),
            ));
            Box::new(ex)
        }
    };
    Ok(Built { ex, summary, phases })
}

/// The summary row of a data-parallel run: ranks, and what each step averages across them.
fn ranks_row(env: &LaunchEnv, run: &RunPrograms, how: &str) -> Result<String, String> {
    let step = run.step()?;
    let reduces: Vec<_> = step.nodes.iter().filter(|n| n.op == fusec_ir::Op::AllReduce).collect();
    let bytes = reduces.iter().flat_map(|n| &n.inputs).map(|v| step.ty(*v).bytes(&run.bind)).sum::<Result<usize, String>>()?;
    let moments: Vec<_> = step.inputs().into_iter().filter(|(n, _)| n.starts_with("m.")).collect();
    let moment_bytes = moments.iter().map(|(_, v)| step.ty(*v).bytes(&run.bind)).sum::<Result<usize, String>>()?;
    let params = step.params().len();
    let state = if moments.len() < params {
        format!("; ZeRO-1: AdamW state of {} of the {params} parameters here ({})", moments.len(), mib(2 * moment_bytes as u64))
    } else {
        String::new()
    };
    Ok(format!(
        "{} (this is rank {}); each step averages {} in {} all-reduces {how}{state}",
        env.world_size,
        env.rank,
        mib(bytes as u64),
        reduces.len()
    ))
}

/// The summary's `products` row: cuBLASLt epilogues and what tuning chose.
fn products_row(build: &fusec_runtime::cuda::CudaBuild) -> String {
    let mut row = format!("{} with bias/GELU inside cuBLASLt", build.lt_epilogues);
    let t = &build.tuning;
    if t.products > 0 {
        let (d, c) = (t.default_us / 1e3, t.chosen_us / 1e3);
        row += &format!(
            "; {} bf16 shapes tuned ({} timed, {} from the cache) in {:.0} ms: their launches {d:.1} → {c:.1} ms ({:.2}× faster) against cuBLAS's choices",
            t.products,
            t.products - t.cached,
            t.cached,
            t.time.as_secs_f64() * 1e3,
            if c > 0.0 { d / c } else { 1.0 }
        );
    }
    if let Some(n) = &t.note {
        row += &format!("; tuning: {n}");
    }
    row
}
