//! CPU training-step benchmark: ms/step, tok/s, achieved GFLOP/s and the share of the step spent
//! outside GEMMs, for the `small` config (B=8, T=256) and the 124M shape (B=4, T=64). In the same
//! process, the step's GEMM launches alone give the ceiling the step is compared with, and each
//! product run alone (best of three) the best single-product rate that the products' rate within
//! the step is compared with.
//!
//! `cargo run --release -p fusec-benches --bin train_step -- [--steps N] [--threads N]
//! [--config small|124m] [--precision LIST]`
//!
//! `--precision` lists variants (comma-separated, default `fp32`): `fp32`, `bf16` or
//! `bf16+residual`, each optionally `:RECOMPUTE` (`none`, `gelu`, `gelu+layernorm`; default: the
//! CLI's for the precision) and `@LEVEL` to force an instruction-set level (`bf16@avx2`: bf16
//! products on operands widened while packing; `bf16@avx512bf16`: the dot products; default:
//! the host's). Each variant has its own executor; the variants' steps alternate (one step of each per round, `--steps` rounds) so that a busy host slows them
//! alike, and each variant's median is printed with its ratio to the first.

use std::time::Instant;

use clap::Parser;
use fusec_benches::{arg_error, positive};
use fusec_codegen_cpu::isa::Isa;
use fusec_ir::interp::Tensor;
use fusec_ir::rng::Rng;
use fusec_ir::{DType, Graph};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::amp::Precision;
use fusec_passes::pipeline::PipelineOptions;
use fusec_passes::recompute::Recompute;
use fusec_runtime::checkpoint::random_init;
use fusec_runtime::cpu::{CpuBuild, CpuExecutor};
use fusec_runtime::executor::Executor;
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::programs::{Program, RunPrograms};
use fusec_runtime::train::init_state;

/// The command line (see the module docs).
#[derive(Parser)]
#[command(about = "CPU training-step benchmark: ms/step, tok/s, GFLOP/s and the share of the step outside GEMMs, \
                   against the step's GEMMs alone and the best single product")]
struct Args {
    /// Timed steps per variant (one step of each variant per round); medians are reported
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = positive)]
    steps: usize,
    /// Threads of the executors and of rayon's pool [default: the host's cores]
    #[arg(long, value_name = "N", value_parser = positive)]
    threads: Option<usize>,
    /// Only this shape: `small` (B=8, T=256) or `124m` (GPT-2 124M, B=4, T=64) [default: both]
    #[arg(long, value_parser = ["small", "124m"])]
    config: Option<String>,
    /// Variants, comma-separated, each `PREC[:RECOMPUTE][@LEVEL]`: PREC `fp32`, `bf16` or
    /// `bf16+residual`; RECOMPUTE `none`, `gelu` or `gelu+layernorm` (default: the CLI's for PREC);
    /// LEVEL an instruction-set level (`avx2`, `avx512`, `avx512bf16`, ...; default: the host's)
    #[arg(long, value_name = "LIST", default_value = "fp32")]
    precision: String,
}

struct Case {
    name: &'static str,
    cfg: Gpt2Config,
    b: usize,
    t: usize,
}

/// One executor to time: a precision at an instruction-set level.
struct Variant {
    name: String,
    ex: CpuExecutor,
    build: CpuBuild,
    compile_ms: f64,
}

/// Loads random parameters and a random batch, with the step's runtime scalars.
fn prepare(ex: &mut dyn Executor, fwd: &Graph, step: &Graph, case: &Case) {
    let c = &case.cfg;
    let l = *c;
    init_state(ex, step, &params_from_checkpoint(fwd, &random_init(&l, 1).unwrap()).unwrap()).unwrap();
    let mut rng = Rng::new(2);
    let toks: Vec<i32> = (0..case.b * case.t).map(|_| rng.below(c.vocab as u64) as i32).collect();
    ex.set("tokens", Tensor::from_i32(vec![case.b, case.t], &toks)).unwrap();
    ex.set("targets", Tensor::from_i32(vec![case.b, case.t], &toks)).unwrap();
    for (n, v) in [("dloss", 1.0), ("lr", 1e-4), ("bc1", 0.1), ("bc2", 0.001)] {
        ex.set(n, Tensor::scalar(DType::F32, v)).unwrap();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `PREC[:RECOMPUTE][@LEVEL]` as `(precision, recompute, level)`.
fn parse_variant(s: &str) -> Result<(Precision, Recompute, Isa), String> {
    let (rest, isa) = s.split_once('@').map_or((s, None), |(p, i)| (p, Some(i)));
    let (p, rc) = rest.split_once(':').map_or((rest, None), |(p, r)| (p, Some(r)));
    let precision: Precision = p.parse().map_err(|e| format!("`{s}`: {e}"))?;
    let recompute = rc.map_or(Ok(Recompute::default_for(precision)), |r| r.parse().map_err(|e| format!("`{s}`: {e}")))?;
    let levels = || Isa::ALL.map(Isa::name).join(", ");
    let isa = isa.map_or_else(|| Ok(fusec_codegen_cpu::isa::current()), |i| {
        Isa::parse(i).map_err(|_| format!("`{s}`: unknown instruction-set level `{i}`; expected one of: {}", levels()))
    })?;
    Ok((precision, recompute, isa))
}

/// Compiles and loads one variant of `case`: `spec` as `--precision` names it, and as parsed.
fn variant(spec: &str, (precision, recompute, isa): (Precision, Recompute, Isa), case: &Case, fwd: &Graph, threads: usize) -> Variant {
    let t0 = Instant::now();
    let opts = PipelineOptions { precision, recompute, ..PipelineOptions::default() };
    let run = RunPrograms::compile(fwd, &opts, &RunPrograms::bindings(case.b, case.t), false).unwrap();
    let (mut ex, build) = CpuExecutor::with_isa(&run, threads, false, isa).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
    prepare(&mut ex, fwd, run.step().unwrap(), case);
    Variant { name: format!("{}:{}@{}", precision.name(), Recompute::NAMES[recompute as usize], isa.name()), ex, build, compile_ms }
}

/// Milliseconds of one run of the Step program's launches that pass `keep`.
fn time_once(ex: &mut CpuExecutor, keep: &(dyn Fn(&str) -> bool + Sync)) -> f64 {
    let t = Instant::now();
    ex.run_traced(Program::Step, keep, |_| {}).unwrap();
    t.elapsed().as_secs_f64() * 1e3
}

fn is_gemm(n: &str) -> bool {
    n.starts_with("gemm") || n == "matmul"
}

/// A layer product: a GEMM launch other than attention's stages, whose FLOP counts are the whole
/// `T × T` products, of which the causal blocks compute about 60%.
fn is_layer_product(n: &str) -> bool {
    is_gemm(n) && !n.starts_with("gemm_attn")
}

/// Seconds of each launch of one step, in launch order (every launch timed).
fn launch_times(ex: &mut CpuExecutor) -> Vec<f64> {
    let mut times = vec![];
    let mut t = Instant::now();
    ex.run_traced(Program::Step, |_: &str| true, |_: &str| {
        times.push(t.elapsed().as_secs_f64());
        t = Instant::now();
    })
    .unwrap();
    times
}

/// The best rate of any one layer product of the step run alone (best of three runs each, after
/// one to warm it): GFLOP/s and the launch's name.
fn best_single_product(ex: &mut CpuExecutor) -> (f64, String) {
    let mut best = (0.0, String::new());
    for (i, (name, flops)) in ex.launch_flops(Program::Step).into_iter().enumerate() {
        if !is_layer_product(&name) || flops == 0 {
            continue;
        }
        ex.run_launch(Program::Step, i).unwrap();
        let secs = (0..3)
            .map(|_| {
                let t = Instant::now();
                ex.run_launch(Program::Step, i).unwrap();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        let rate = flops as f64 / secs / 1e9;
        if rate > best.0 {
            best = (rate, format!("{name} #{i}"));
        }
    }
    best
}

fn report(case: &Case, v: &mut Variant, step_ms: f64, first_ms: f64, steps: usize) {
    let gemm_ms = median((0..steps).map(|_| time_once(&mut v.ex, &is_gemm)).collect());
    // Per launch, its median time over `steps` timed steps.
    let runs: Vec<Vec<f64>> = (0..steps).map(|_| launch_times(&mut v.ex)).collect();
    let launches: Vec<(String, u64)> = v.ex.launch_flops(Program::Step);
    let per_launch: Vec<f64> = (0..launches.len()).map(|i| median(runs.iter().map(|r| r[i]).collect())).collect();
    // Seconds within the step of the launches whose name passes `keep`.
    let secs = |keep: fn(&str) -> bool| -> f64 { per_launch.iter().zip(&launches).filter(|(_, (n, _))| keep(n)).map(|(t, _)| t).sum() };
    let share = 1.0 - secs(is_gemm) / per_launch.iter().sum::<f64>();
    let (gemm_flops, other_flops) = v.ex.flops(Program::Step);
    let (best, best_name) = best_single_product(&mut v.ex);
    let layer_flops: u64 = launches.iter().filter(|(n, _)| is_layer_product(n)).map(|(_, f)| f).sum();
    let in_step_rate = layer_flops as f64 / secs(is_layer_product) / 1e9;
    let tokens = (case.b * case.t) as f64;
    println!(
        "\n[{} {}] L={} C={} Vp={} B={} T={}: compile {:.0} ms ({} kernels, {} cache hits), arena {:.1} MiB",
        case.name,
        v.name,
        case.cfg.layers,
        case.cfg.channels,
        case.cfg.padded_vocab,
        case.b,
        case.t,
        v.compile_ms,
        v.build.kernels.0,
        v.build.kernels.1,
        v.build.arena_bytes as f64 / 1048576.0
    );
    println!(
        "  step                {step_ms:9.1} ms   {:9.0} tok/s   {:6.1} GFLOP/s   ({:.2}x the first variant's median)",
        tokens / step_ms * 1e3,
        (gemm_flops + other_flops) as f64 / step_ms / 1e6,
        step_ms / first_ms
    );
    println!(
        "  GEMMs alone         {gemm_ms:9.1} ms   (the ceiling: {:.1} GFLOP/s)   step / ceiling = {:.2}",
        gemm_flops as f64 / gemm_ms / 1e6,
        step_ms / gemm_ms
    );
    println!(
        "  layer products in the step {in_step_rate:6.1} GFLOP/s = {:.0}% of the best one alone ({best:.1} GFLOP/s, `{best_name}`)",
        100.0 * in_step_rate / best
    );
    println!("  outside GEMM launches {:6.1}% of the step (every launch timed within the same steps)", 100.0 * share);
}

fn main() {
    let args = Args::parse();
    let steps = args.steps;
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let specs = args.precision;
    let parsed: Result<Vec<_>, _> = specs.split(',').map(|s| parse_variant(s).map(|v| (s, v))).collect();
    let parsed = parsed.unwrap_or_else(|e| arg_error("--precision", e));
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let only = args.config;
    let cases = [
        Case { name: "small", cfg: Gpt2Config::preset("small").unwrap(), b: 8, t: 256 },
        Case { name: "124m", cfg: Gpt2Config::preset("d12").unwrap(), b: 4, t: 64 },
    ];
    println!("fusec CPU training step, {threads} thread(s), median of {steps} steps, variants alternating: {specs}");
    for case in cases.iter().filter(|c| only.as_deref().is_none_or(|o| o == c.name)) {
        let fwd = build_gpt2(&case.cfg, case.name);
        let mut vs: Vec<Variant> = parsed.iter().map(|&(s, v)| variant(s, v, case, &fwd, threads)).collect();
        for v in vs.iter_mut() {
            time_once(&mut v.ex, &|_| true); // warm-up
        }
        let mut samples = vec![vec![]; vs.len()];
        for _ in 0..steps {
            for (v, s) in vs.iter_mut().zip(samples.iter_mut()) {
                s.push(time_once(&mut v.ex, &|_| true));
            }
        }
        let medians: Vec<f64> = samples.into_iter().map(median).collect();
        for (v, &m) in vs.iter_mut().zip(&medians) {
            report(case, v, m, medians[0], steps);
        }
    }
}
