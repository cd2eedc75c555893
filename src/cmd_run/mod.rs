//! `fusec run FILE --target ...`: train (or evaluate) a GPT-2 graph and report where the time went.
//!
//! Everything that can be checked before the first step is checked before any large
//! allocation: the flags ([`args`]), the graph, the checkpoint's header against the graph, the
//! token files, and the memory plan against the host's or the GPU's free memory (in the
//! executors). The checkpoint is written right after training, before the summary and the
//! sample, so a closed standard output never loses it.

mod args;
mod build;

pub use args::RunArgs;
use args::Target;

use std::collections::HashMap;
use std::time::Instant;

use fusec_models::Gpt2Config;
use fusec_passes::optimizer::AdamWConfig;
use fusec_passes::pipeline::{PassRun, PipelineOptions};
use fusec_passes::recompute::Recompute;
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::corpus::markov_tokens;
use fusec_runtime::data::DataLoader;
use fusec_runtime::params::{checkpoint_from_params, params_from_checkpoint};
use fusec_runtime::programs::RunPrograms;
use fusec_runtime::tokens::read_tokens;
use fusec_runtime::train::{eval_loss, init_state, train, TrainConfig};

use crate::report::{profile_json, profile_table, table, Progress};
use crate::{load_graph, CliResult};

/// Runs `fusec run`.
pub fn run(a: RunArgs) -> CliResult {
    let t_start = Instant::now();
    a.validate()?;
    if a.target == Target::Cuda {
        // The driver's start-up (and the NVRTC workers') overlaps parsing, initialization and
        // compiling.
        fusec_runtime::cuda::start_driver();
        fusec_codegen_cuda::nvrtc::workers::prestart();
    }
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().map_err(|e| format!("thread pool: {e}"))?;
    let g = load_graph(&a.file)?;
    let model = Gpt2Config::from_graph(&g).map_err(|e| format!("{}: {e}", a.file.display()))?;
    if a.seq > model.max_seq {
        return Err(format!("--seq {} exceeds the model's maximum sequence length {}", a.seq, model.max_seq));
    }
    if a.init != "random" {
        let header = Checkpoint::read_header(a.init.as_ref()).map_err(|e| e.to_string())?;
        check_same_config(&a.init, &header, &model)?;
    }
    let (train_data, val_data, val_batches) = load_data(&a, &model)?;

    let opts = PipelineOptions {
        // Without accumulation over micro-steps the gradients are transients of the step.
        adamw: AdamWConfig {
            weight_decay: a.weight_decay,
            clip: a.grad_clip.is_some(),
            fresh_grads: a.grad_accum <= 1,
            ..AdamWConfig::default()
        },
        // The reference target runs the unfused programs: it is the oracle.
        no_fusion: a.target == Target::Ref,
        precision: a.precision,
        recompute: a.recompute.unwrap_or(Recompute::default_for(a.precision)),
        ..PipelineOptions::default()
    };
    let t_compile = Instant::now();
    let run = RunPrograms::compile(&g, &opts, &RunPrograms::bindings(a.batch, a.seq), a.sample > 0)?;
    let mut built = build::executor(&a, &run, threads)?;
    let ex = built.ex.as_mut();
    let compile_ms = t_compile.elapsed().as_secs_f64() * 1e3;

    let ckpt = match a.init.as_str() {
        "random" => fusec_runtime::checkpoint::random_init(&model, a.seed)?,
        path => Checkpoint::read(path.as_ref()).map_err(|e| e.to_string())?,
    };
    init_state(ex, run.step()?, &params_from_checkpoint(&g, &ckpt)?)?;
    drop(ckpt);

    if a.steps == 0 {
        let loss = eval_loss(ex, &train_data, 1, a.batch, a.seq)?;
        outln!("step 0: loss {loss:.6}")?;
        if let Some(v) = &val_data {
            outln!("val loss {:.6}", eval_loss(ex, v, val_batches, a.batch, a.seq)?)?;
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
        val_every: val_data.as_ref().map(|_| a.val_every),
        val_batches,
        log_json: a.log_json.clone(),
        divergence_factor: (!a.no_divergence_check).then_some(a.divergence_factor),
    };
    let tokens_per_step = a.batch * a.seq * a.grad_accum;
    let mut progress = Progress::new(a.steps, tokens_per_step);
    let mut first_done = None;
    let logs = train(ex, &cfg, &train_data, val_data.as_ref(), |r| {
        first_done.get_or_insert_with(|| t_start.elapsed());
        progress.step(r)
    })?;
    // Saved first: nothing printed below can lose it.
    if let Some(path) = &a.save {
        let mut now = HashMap::new();
        for (name, _) in g.params() {
            now.insert(name.to_string(), ex.get(name)?);
        }
        checkpoint_from_params(&model, &now)?.write(path).map_err(|e| e.to_string())?;
        errln!("saved {}", path.display());
    }

    let (first, last) = (logs[0].loss, logs[logs.len() - 1].loss);
    let steady: Vec<f64> = logs.iter().skip(1).map(|l| l.ms).collect();
    let ms = if steady.is_empty() { logs[0].ms } else { steady.iter().sum::<f64>() / steady.len() as f64 };
    let val = logs.iter().rev().find_map(|l| l.val_loss).map(|v| format!(" (last val {v:.4})")).unwrap_or_default();
    let mut rows = vec![
        ("target".to_string(), format!("{}, {threads} thread(s), B={} T={}", a.target_name(), a.batch, a.seq)),
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
    rows.append(&mut built.summary);
    if let (Some(alloc), Some(peak)) = (ex.allocated_device_bytes(), ex.peak_device_bytes()) {
        let (alloc, peak) = (crate::report::mib(alloc), crate::report::mib(peak));
        let what =
            format!("{alloc} allocated by fusec (plan, scratch, cuBLAS workspace); {peak} in use on the device (CUDA context included)");
        rows.push(("peak memory".into(), what));
    }
    rows.push(("wall time".into(), format!("{:.1} s (training {:.1} s)", t_start.elapsed().as_secs_f64(), progress.elapsed())));
    out!("{}", table("summary", &rows))?;
    if let Some(p) = ex.profile() {
        if a.profile {
            out!("{}", profile_table(&p, p.steps as usize))?;
        }
        if let Some(path) = &a.profile_json {
            std::fs::write(path, profile_json(&p)).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    if a.sample > 0 {
        crate::sample::print_sample(ex, &model, a.batch, a.seq, a.sample, a.temperature, a.seed)?;
    }
    Ok(())
}

/// Refuses a checkpoint whose header differs from the graph's config in any field (tensor
/// shapes alone do not see `num_heads`, nor `vocab_size` below the padding).
fn check_same_config(path: &str, ckpt: &Gpt2Config, graph: &Gpt2Config) -> Result<(), String> {
    let fields = [
        ("max_seq_len", ckpt.max_seq, graph.max_seq),
        ("vocab_size", ckpt.vocab, graph.vocab),
        ("padded_vocab_size", ckpt.padded_vocab, graph.padded_vocab),
        ("num_layers", ckpt.layers, graph.layers),
        ("num_heads", ckpt.heads, graph.heads),
        ("channels", ckpt.channels, graph.channels),
    ];
    let diff: Vec<String> =
        fields.iter().filter(|(_, c, g)| c != g).map(|(n, c, g)| format!("{n} {c} in the checkpoint, {g} in the graph")).collect();
    if diff.is_empty() {
        Ok(())
    } else {
        Err(format!("{path}: the checkpoint does not fit the graph: {}", diff.join("; ")))
    }
}

/// Training and validation data (the given token files, or the embedded corpus) and the
/// validation batches per evaluation; refuses more than the validation data holds.
fn load_data(a: &RunArgs, model: &Gpt2Config) -> Result<(DataLoader, Option<DataLoader>, usize), String> {
    let loader = |p: &std::path::PathBuf| -> Result<DataLoader, String> {
        let l = DataLoader::new(read_tokens(p).map_err(|e| e.to_string())?, a.batch, a.seq).map_err(|e| format!("{}: {e}", p.display()))?;
        l.check_vocab(model.vocab).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(l)
    };
    let (train, val) = match &a.data {
        Some(p) => (loader(p)?, a.val.as_ref().map(loader).transpose()?),
        None => {
            errln!("no --data: training on the embedded corpus (a generated Markov chain over {} tokens)", model.vocab);
            let corpus = |seed| DataLoader::new(markov_tokens(model.vocab, 200_000, 42, seed), a.batch, a.seq);
            (corpus(1)?, Some(corpus(2)?))
        }
    };
    let held = val.as_ref().map_or(usize::MAX, |v| v.batches());
    let val_batches = match a.val_batches {
        Some(n) if n > held => {
            return Err(format!("--val-batches {n} exceeds the {held} batches of B={} T={} the validation data holds", a.batch, a.seq))
        }
        Some(n) => n,
        None => held.clamp(1, 4),
    };
    Ok((train, val, val_batches))
}

fn pass_times(runs: &[PassRun]) -> String {
    runs.iter().map(|r| format!("{} {:.1}", r.name, r.time.as_secs_f64() * 1e3)).collect::<Vec<_>>().join(" · ")
}
