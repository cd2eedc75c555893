//! CPU training-step benchmark: ms/step, tok/s, achieved GFLOP/s and the share of the step spent
//! outside GEMMs, for the `small` config (B=8, T=256) and the 124M shape (B=4, T=64). In the same
//! process, the step's GEMM launches alone give the ceiling the step is compared with.
//!
//! `cargo run --release -p fusec-benches --bin train_step -- [--steps N] [--threads N] [--config small|124m]`

use std::time::Instant;

use fusec_ir::interp::Tensor;
use fusec_ir::rng::Rng;
use fusec_ir::{DType, Graph};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::random_init;
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::executor::Executor;
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::programs::{Program, RunPrograms};
use fusec_runtime::train::init_state;

struct Case {
    name: &'static str,
    cfg: Gpt2Config,
    b: usize,
    t: usize,
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
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

fn main() {
    let steps: usize = arg("--steps").and_then(|s| s.parse().ok()).unwrap_or(5);
    let threads: usize =
        arg("--threads").and_then(|s| s.parse().ok()).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let only = arg("--config");
    let cases = [
        Case { name: "small", cfg: Gpt2Config::preset("small").unwrap(), b: 8, t: 256 },
        Case { name: "124m", cfg: Gpt2Config::preset("d12").unwrap(), b: 4, t: 64 },
    ];
    println!("fusec CPU training step, {threads} thread(s), median of {steps} steps");
    for case in cases.iter().filter(|c| only.as_deref().is_none_or(|o| o == c.name)) {
        let fwd = build_gpt2(&case.cfg, case.name);
        let t0 = Instant::now();
        let bind = RunPrograms::bindings(case.b, case.t);
        let run = RunPrograms::compile(&fwd, &PipelineOptions::default(), &bind, false).unwrap();
        let (mut ex, build) = CpuExecutor::new(&run, threads, false).unwrap();
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        prepare(&mut ex, &fwd, run.step().unwrap(), case);
        let time = |ex: &mut CpuExecutor, keep: &dyn Fn(&str) -> bool| {
            ex.run_traced(Program::Step, keep, |_| {}).unwrap(); // warm-up
            median(
                (0..steps)
                    .map(|_| {
                        let t = Instant::now();
                        ex.run_traced(Program::Step, keep, |_| {}).unwrap();
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .collect(),
            )
        };
        let is_gemm = |n: &str| n.starts_with("gemm") || n == "matmul";
        let step_ms = time(&mut ex, &|_| true);
        let gemm_ms = time(&mut ex, &is_gemm);
        // The share outside GEMMs from the same steps: every launch timed, split by kind.
        let share = median(
            (0..steps)
                .map(|_| {
                    let (mut gemm, mut other) = (0.0, 0.0);
                    let mut t = Instant::now();
                    ex.run_traced(
                        Program::Step,
                        |_: &str| true,
                        |name: &str| {
                            let dt = t.elapsed().as_secs_f64();
                            if is_gemm(name) {
                                gemm += dt
                            } else {
                                other += dt
                            }
                            t = Instant::now();
                        },
                    )
                    .unwrap();
                    other / (gemm + other)
                })
                .collect(),
        );
        let (gemm_flops, other_flops) = ex.flops(Program::Step);
        let tokens = (case.b * case.t) as f64;
        println!(
            "\n[{}] L={} C={} Vp={} B={} T={}: compile {compile_ms:.0} ms ({} kernels, {} cache hits), arena {:.1} MiB",
            case.name,
            case.cfg.layers,
            case.cfg.channels,
            case.cfg.padded_vocab,
            case.b,
            case.t,
            build.kernels.0,
            build.kernels.1,
            build.arena_bytes as f64 / 1048576.0
        );
        println!(
            "  step                {step_ms:9.1} ms   {:9.0} tok/s   {:6.1} GFLOP/s",
            tokens / step_ms * 1e3,
            (gemm_flops + other_flops) as f64 / step_ms / 1e6
        );
        println!(
            "  GEMMs alone         {gemm_ms:9.1} ms   (the ceiling: {:.1} GFLOP/s)   step / ceiling = {:.2}",
            gemm_flops as f64 / gemm_ms / 1e6,
            step_ms / gemm_ms
        );
        println!("  outside GEMM launches {:6.1}% of the step (every launch timed within the same steps)", 100.0 * share);
    }
}
