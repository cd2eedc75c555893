//! `fusec run FILE --target ...`: train (or evaluate) a GPT-2 graph and report where the time went.

use clap::{Args, ValueEnum};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use fusec_models::Gpt2Config;
use fusec_passes::amp::Precision;
use fusec_passes::optimizer::AdamWConfig;
use fusec_passes::pipeline::{PassRun, PipelineOptions};
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::corpus::markov_tokens;
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::cuda::{CudaExecutor, CudaOptions};
use fusec_runtime::data::DataLoader;
use fusec_runtime::executor::{Executor, RefExecutor};
use fusec_runtime::params::{checkpoint_from_params, params_from_checkpoint};
use fusec_runtime::programs::RunPrograms;
use fusec_runtime::tokens::read_tokens;
use fusec_runtime::train::{eval_loss, init_state, train, TrainConfig};

use crate::cmd_dump::precision_parser;
use crate::report::{mib, profile_json, profile_table, table, Progress};
use crate::{load_graph, CliResult};

/// Where the graph runs.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Target {
    /// The reference interpreter on the unfused programs (slow, obviously correct: the oracle).
    Ref,
    /// Cranelift-compiled fused kernels and AVX-512 GEMMs on this CPU.
    Cpu,
    /// NVRTC-compiled fused kernels and cuBLAS on an NVIDIA GPU, replayed as a CUDA graph.
    Cuda,
}

/// Arguments of `fusec run`.
#[derive(Args)]
pub struct RunArgs {
    /// The `.graph` file (forward + loss, e.g. from `fusec export`).
    file: PathBuf,
    /// Where to run it.
    #[arg(long, value_enum, default_value = "cpu")]
    target: Target,
    /// Initial parameters: an llm.c checkpoint file, or `random` (GPT-2 initialization).
    #[arg(long, default_value = "random")]
    init: String,
    /// Seed for `--init random` and sampling.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Training tokens (llm.c token file); default: the embedded generated corpus.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Validation tokens (llm.c token file).
    #[arg(long)]
    val: Option<PathBuf>,
    /// Compute the validation loss every N steps (needs --val, or the embedded corpus).
    #[arg(long, default_value_t = 10)]
    val_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 4)]
    val_batches: usize,
    /// Batch size B.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Sequence length T.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Training steps; 0 evaluates the loss of the first batch.
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Micro-steps accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    grad_clip: Option<f32>,
    /// Mixed precision: `bf16` casts matmul operands to bf16 (fp32 master weights, statistics,
    /// softmax and loss); `--target cuda` or `ref`.
    #[arg(long, default_value = "fp32", value_parser = precision_parser())]
    precision: Precision,
    /// Exact fp32 matmuls on CUDA (default: TF32 tensor cores, as PyTorch allows).
    #[arg(long)]
    no_tf32: bool,
    /// Attention on CUDA through score matrices, cuBLAS and softmax kernels instead of the
    /// flash kernels (which need TF32 and sm_80+).
    #[arg(long)]
    no_flash_attention: bool,
    /// On CUDA, run bias and GELU epilogues as a kernel after each cuBLAS product instead of
    /// inside cuBLASLt calls.
    #[arg(long)]
    no_cublaslt: bool,
    /// Launch kernels one by one instead of replaying the step as a CUDA graph.
    #[arg(long)]
    no_cuda_graph: bool,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Time every launch and print a per-kernel table at the end (`cpu` and `cuda` targets).
    #[arg(long)]
    profile: bool,
    /// Write the per-kernel profile as JSON.
    #[arg(long)]
    profile_json: Option<PathBuf>,
    /// Print each CUDA module's compile or disk-cache time (hits and misses) after the build.
    #[arg(long)]
    timings: bool,
    /// Generate this many tokens at the end (GPT-2 BPE text, or token ids for other vocabularies).
    #[arg(long, default_value_t = 0)]
    sample: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Write the parameters after training as an llm.c checkpoint.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Write one JSON object per step (step, loss, lr, ms, val_loss).
    #[arg(long)]
    log_json: Option<PathBuf>,
}

/// Runs `fusec run`.
pub fn run(a: RunArgs) -> CliResult {
    let t_start = Instant::now();
    if a.target == Target::Cuda {
        // The driver's start-up overlaps parsing, initialization and compiling.
        fusec_runtime::cuda::start_driver();
    }
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().map_err(|e| format!("thread pool: {e}"))?;
    let g = load_graph(&a.file)?;
    let model = Gpt2Config::from_graph(&g).map_err(|e| format!("{}: {e}", a.file.display()))?;
    if a.batch == 0 || a.seq == 0 || a.grad_accum == 0 {
        return Err("--batch, --seq and --grad-accum must be at least 1".into());
    }
    if a.precision == Precision::Bf16 && a.target == Target::Cpu {
        return Err("--precision bf16 needs --target cuda or --target ref (the CPU target's products are fp32)".into());
    }
    if a.seq > model.max_seq {
        return Err(format!("--seq {} exceeds the model's maximum sequence length {}", a.seq, model.max_seq));
    }
    let ckpt = match a.init.as_str() {
        "random" => fusec_runtime::checkpoint::random_init(&model, a.seed),
        path => Checkpoint::read(path.as_ref()).map_err(|e| e.to_string())?,
    };
    let params = params_from_checkpoint(&g, &ckpt)?;
    let (train_data, val_data) = load_data(&a, &model)?;

    let opts = PipelineOptions {
        adamw: AdamWConfig { weight_decay: a.weight_decay, clip: a.grad_clip.is_some(), ..AdamWConfig::default() },
        // The reference target runs the unfused programs: it is the oracle.
        no_fusion: a.target == Target::Ref,
        precision: a.precision,
        ..PipelineOptions::default()
    };
    let t_compile = Instant::now();
    let run = RunPrograms::compile(&g, &opts, &RunPrograms::bindings(a.batch, a.seq), a.sample > 0)?;
    let mut summary: Vec<(String, String)> = vec![];
    let mut profiling = false;
    let mut cuda: Option<u64> = None;
    let mut ex: Box<dyn Executor> = match a.target {
        Target::Ref => Box::new(RefExecutor::new(&run, fusec_ir::interp::Precision::F32)),
        Target::Cpu => {
            let (ex, build) = CpuExecutor::new(&run, threads, a.profile || a.profile_json.is_some())?;
            profiling = ex.profile.is_some();
            let plan = &build.step_plan;
            summary.push((
                "kernels".into(),
                format!("{} compiled, {} cache hits (identical kernels compile once)", build.kernels.0, build.kernels.1),
            ));
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
            Box::new(ex)
        }
        Target::Cuda => {
            let cuda_opts = CudaOptions {
                profile: a.profile || a.profile_json.is_some(),
                tf32: !a.no_tf32,
                flash: !a.no_flash_attention,
                lt_epilogues: !a.no_cublaslt,
                graphs: !a.no_cuda_graph,
            };
            let (ex, build) = CudaExecutor::new(&run, &cuda_opts)?;
            profiling = ex.profile.is_some();
            let k = &build.kernels;
            summary.push((
                "device".into(),
                format!(
                    "{} (NVRTC {}.{}){}",
                    build.device,
                    build.nvrtc.0,
                    build.nvrtc.1,
                    if a.no_tf32 { ", exact fp32" } else { ", TF32" }
                ),
            ));
            summary.push((
                "kernels".into(),
                format!("{} launches from {} modules: {} compiled, {} from the disk cache", k.kernels, k.modules, k.compiled, k.disk_hits),
            ));
            if a.timings {
                println!("CUDA modules, slowest first ({} compiled, {} from the disk cache):", k.compiled, k.disk_hits);
                for (name, cached, t) in &build.modules {
                    println!("  {name:<40} {:<10} {:>8.1} ms", if *cached { "disk cache" } else { "NVRTC" }, t.as_secs_f64() * 1e3);
                }
            }
            let phases: Vec<String> = build.phases.iter().map(|(n, d)| format!("{n} {:.0} ms", d.as_secs_f64() * 1e3)).collect();
            summary.push(("gpu build".into(), format!("{:.0} ms: {}", build.compile_time.as_secs_f64() * 1e3, phases.join(" · "))));
            summary.push(("attention".into(), build.attention.clone()));
            summary.push(("products".into(), format!("{} with bias/GELU inside cuBLASLt", build.lt_epilogues)));
            summary.push((
                "memory".into(),
                format!("one device allocation of {} (scratch {})", mib(build.device_bytes), mib(build.scratch_bytes)),
            ));
            cuda = Some(build.device_bytes);
            Box::new(ex)
        }
    };
    let compile_ms = t_compile.elapsed().as_secs_f64() * 1e3;
    let step_graph = run.step()?;
    init_state(ex.as_mut(), step_graph, &params)?;

    if a.steps == 0 {
        let loss = eval_loss(ex.as_mut(), &train_data, 1, a.batch, a.seq)?;
        println!("step 0: loss {loss:.6}");
        if let Some(v) = &val_data {
            println!("val loss {:.6}", eval_loss(ex.as_mut(), v, a.val_batches, a.batch, a.seq)?);
        }
        return Ok(());
    }
    let cfg = TrainConfig {
        batch: a.batch,
        seq: a.seq,
        steps: a.steps,
        lr: a.lr,
        betas: (opts.adamw.beta1 as f32, opts.adamw.beta2 as f32),
        grad_accum: a.grad_accum,
        grad_clip: a.grad_clip,
        val_every: val_data.as_ref().map(|_| a.val_every.max(1)),
        val_batches: a.val_batches,
        log_json: a.log_json.clone(),
    };
    let tokens_per_step = a.batch * a.seq * a.grad_accum;
    let mut progress = Progress::new(a.steps, tokens_per_step);
    let mut first_done = None;
    let logs = train(ex.as_mut(), &cfg, &train_data, val_data.as_ref(), |r| {
        first_done.get_or_insert_with(|| t_start.elapsed());
        progress.step(r)
    })?;

    let (first, last) = (logs[0].loss, logs[logs.len() - 1].loss);
    let steady: Vec<f64> = logs.iter().skip(1).map(|l| l.ms).collect();
    let ms = if steady.is_empty() { logs[0].ms } else { steady.iter().sum::<f64>() / steady.len() as f64 };
    let val = logs.iter().rev().find_map(|l| l.val_loss).map(|v| format!(" (last val {v:.4})")).unwrap_or_default();
    let mut rows = vec![
        ("target".to_string(), format!("{:?}, {threads} thread(s), B={} T={}", a.target, a.batch, a.seq).to_lowercase()),
        ("loss".into(), format!("{first:.4} → {last:.4} over {} steps{val}", logs.len())),
        ("step time".into(), format!("{ms:.1} ms/step (first step {:.1} ms)", logs[0].ms)),
        ("throughput".into(), format!("{:.0} tok/s", tokens_per_step as f64 / ms * 1e3)),
        ("compile".into(), format!("{compile_ms:.1} ms: {}", pass_times(&run.pass_runs))),
        (
            "first step".into(),
            format!(
                "compile + first step {:.2} s; done {:.2} s after start",
                (compile_ms + logs[0].ms) / 1e3,
                first_done.unwrap_or_default().as_secs_f64()
            ),
        ),
    ];
    rows.extend(summary);
    if let (Some(_), Some(peak)) = (cuda, ex.peak_device_bytes()) {
        rows.push(("peak memory".into(), format!("{} on the device", mib(peak))));
    }
    rows.push(("wall time".into(), format!("{:.1} s (training {:.1} s)", t_start.elapsed().as_secs_f64(), progress.elapsed())));
    print!("{}", table("summary", &rows));
    if profiling {
        if let Some(p) = ex.profile() {
            if a.profile {
                print!("{}", profile_table(&p, logs.len()));
            }
            if let Some(path) = &a.profile_json {
                std::fs::write(path, profile_json(&p)).map_err(|e| format!("{}: {e}", path.display()))?;
            }
        }
    }
    if a.sample > 0 {
        crate::sample::print_sample(ex.as_mut(), &model, a.batch, a.seq, a.sample, a.temperature, a.seed)?;
    }
    if let Some(path) = &a.save {
        let mut now = HashMap::new();
        for (name, _) in g.params() {
            now.insert(name.to_string(), ex.get(name)?);
        }
        checkpoint_from_params(&model, &now)?.write(path).map_err(|e| e.to_string())?;
        println!("saved {}", path.display());
    }
    Ok(())
}

/// Training and validation data: the given token files, or the embedded corpus.
fn load_data(a: &RunArgs, model: &Gpt2Config) -> Result<(DataLoader, Option<DataLoader>), String> {
    let loader = |p: &PathBuf| -> Result<DataLoader, String> {
        let l = DataLoader::new(read_tokens(p).map_err(|e| e.to_string())?, a.batch, a.seq).map_err(|e| format!("{}: {e}", p.display()))?;
        l.check_vocab(model.vocab).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(l)
    };
    Ok(match &a.data {
        Some(p) => (loader(p)?, a.val.as_ref().map(loader).transpose()?),
        None => {
            println!("no --data: training on the embedded corpus (a generated Markov chain over {} tokens)", model.vocab);
            let corpus = |seed| DataLoader::new(markov_tokens(model.vocab, 200_000, 42, seed), a.batch, a.seq);
            (corpus(1)?, Some(corpus(2)?))
        }
    })
}

fn pass_times(runs: &[PassRun]) -> String {
    runs.iter().map(|r| format!("{} {:.1}", r.name, r.time.as_secs_f64() * 1e3)).collect::<Vec<_>>().join(" · ")
}
