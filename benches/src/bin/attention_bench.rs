//! fusec's causal flash attention on bf16 storage, timed per kernel through the CUDA runtime:
//! forward, `dq` and `dk/dv` on GPT-2 shapes (124M: B=16 H=12 T=1024 d=64; 1.5B: B=8 H=25
//! T=1024 d=64; d128: B=8 H=12 T=1024 d=128), each the median of CUDA-event timings of the
//! launches (`--profile`'s) over `--iters` runs after a warm-up. TFLOP/s counts causal work:
//! forward 2·B·H·T²·d, backward 2.5 times that. `benches/attention_sdpa.py --fusec FILE` puts
//! PyTorch SDPA's flash and cuDNN backends beside these numbers, in the same device call.
//!
//! `attention_bench [--iters N] [--shape NAME] [--json FILE] [--variant SPEC]...`: each
//! `--variant` is a `FUSEC_FLASH_BF16` tile configuration (`default` for the built-in one; see
//! `fusec_codegen_cuda::flash::bf16`), timed in turn.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use clap::Parser;
use fusec_benches::{arg_error, positive};
use fusec_ir::rng::Rng;
use fusec_models::bf16_attention_graph;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_runtime::cuda::{CudaExecutor, CudaOptions};
use fusec_runtime::executor::Executor;
use fusec_runtime::programs::{Program, RunPrograms};

/// Name, batch, heads, length, head size (the same list as `attention_sdpa.py`).
const SHAPES: [(&str, usize, usize, usize, usize); 3] = [("124M", 16, 12, 1024, 64), ("1.5B", 8, 25, 1024, 64), ("d128", 8, 12, 1024, 128)];
/// The profile's names of the three launches.
const KERNELS: [&str; 3] = ["flash_attention", "flash_attention_grad_q", "flash_attention_grad_kv"];

/// The command line (see the module docs).
#[derive(Parser)]
#[command(about = "fusec's causal flash attention on bf16 storage (CUDA): forward, dq and dk/dv per launch on GPT-2 shapes")]
struct Args {
    /// Timed runs per shape (after one warm-up); each launch's median is reported
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = positive)]
    iters: usize,
    /// Only this shape (repeatable): 124M (B=16 H=12 d=64), 1.5B (B=8 H=25 d=64), d128 (B=8 H=12 d=128) [default: all]
    #[arg(long, value_name = "NAME", value_parser = ["124M", "1.5B", "d128"])]
    shape: Vec<String>,
    /// Also write one JSON line per shape and variant to FILE (`attention_sdpa.py --fusec FILE` reads it)
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// A `FUSEC_FLASH_BF16` tile configuration to time (repeatable, timed in turn; `default`: the built-in one)
    #[arg(long, value_name = "SPEC", default_value = "default")]
    variant: Vec<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms per launch of each of [`KERNELS`] over `iters` runs of one shape.
fn time_shape(b: usize, h: usize, t: usize, d: usize, iters: usize) -> Result<[f64; 3], String> {
    let g = bf16_attention_graph(h, d);
    let bind = RunPrograms::bindings(b, t);
    let opts = PipelineOptions::default();
    let step = compile(&g, "schedule", Mode::Forward, &opts, &bind)?.graph;
    let run = RunPrograms { graphs: HashMap::from([(Program::Step, step)]), bind: bind.clone(), opts, pass_runs: vec![] };
    let (mut gpu, build) = CudaExecutor::new(&run, &CudaOptions { profile: true, ..CudaOptions::default() })?;
    eprintln!("  {} ({}), attention: {}", build.device, t, build.attention);
    let mut feeds = fusec_ir::interp::random_feeds(&g, &bind, &mut Rng::new(5), 1)?;
    feeds.get_mut("qkv").expect("qkv").data.iter_mut().for_each(|x| *x *= 2.0);
    for (name, v) in feeds {
        gpu.set(&name, v)?;
    }
    gpu.run(Program::Step)?; // warm-up (not profiled)
    let total = |gpu: &CudaExecutor, k: &str| {
        let p = gpu.profile.as_ref().expect("profiling");
        p.rows().iter().find(|(n, _)| *n == k).map_or(0.0, |(_, s)| s.total.as_secs_f64() * 1e3)
    };
    let mut per: [Vec<f64>; 3] = Default::default();
    for _ in 0..iters {
        let before: Vec<f64> = KERNELS.iter().map(|k| total(&gpu, k)).collect();
        gpu.run(Program::Step)?;
        for (i, k) in KERNELS.iter().enumerate() {
            per[i].push(total(&gpu, k) - before[i]);
        }
    }
    Ok(per.map(median))
}

fn main() {
    let args = Args::parse();
    let (iters, only, variants) = (args.iters, args.shape, args.variant);
    let mut json = args.json.map(|p| std::fs::File::create(&p).unwrap_or_else(|e| arg_error("--json", format!("{}: {e}", p.display()))));
    println!(
        "{:6} {:36} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "shape", "variant", "fwd ms", "TFLOP/s", "dq ms", "dkv ms", "TFLOP/s", "fwd+bwd"
    );
    for variant in &variants {
        // The tile configuration is read when the module's source is generated.
        if variant == "default" {
            std::env::remove_var("FUSEC_FLASH_BF16");
        } else {
            std::env::set_var("FUSEC_FLASH_BF16", variant);
        }
        for (name, b, h, t, d) in SHAPES.into_iter().filter(|s| only.is_empty() || only.iter().any(|o| o == s.0)) {
            let [fwd, dq, dkv] = match time_shape(b, h, t, d, iters) {
                Ok(x) => x,
                Err(e) => {
                    println!("{name:6} {variant:36} failed: {e}");
                    continue;
                }
            };
            let flops = 2.0 * (b * h * t * t * d) as f64;
            let (tf, tb) = (flops / fwd / 1e9, 2.5 * flops / (dq + dkv) / 1e9);
            println!("{name:6} {variant:36} {fwd:8.3} {tf:8.0} {dq:8.3} {dkv:8.3} {tb:8.0} {:8.3}", fwd + dq + dkv);
            if let Some(f) = json.as_mut() {
                let line =
                    format!("{{\"shape\": \"{name}\", \"variant\": \"{variant}\", \"fwd_ms\": {fwd}, \"dq_ms\": {dq}, \"dkv_ms\": {dkv}}}");
                writeln!(f, "{line}").expect("--json write");
            }
        }
    }
}
