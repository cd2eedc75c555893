//! `fusec run FILE --target ...`: train (or evaluate) a GPT-2 graph and report where the time went.
//!
//! Everything that can be checked before the first step is checked before any large
//! allocation: the flags ([`args`]), the graph, the checkpoint's header against the graph, the
//! token files, and the memory plan against the host's or the GPU's free memory (in the
//! executors). The checkpoint is written right after the last step (and every `--save-every`
//! steps: [`resume`]), before the final validation, the sample and the summary, so a closed
//! standard output never loses it; the summary ends with where the wall time went
//! ([`summary`]).

mod args;
mod build;
mod ranks;
mod resume;
mod roof;
mod summary;
mod timeline;

pub use args::{RunArgs, Target};

use std::time::Instant;

use fusec_models::Gpt2Config;
use fusec_passes::optimizer::AdamWConfig;
use fusec_passes::pipeline::PipelineOptions;
use fusec_passes::recompute::Recompute;
use fusec_passes::zero::Shard;
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::corpus::markov_tokens;
use fusec_runtime::data::DataLoader;
use fusec_runtime::dist::launch_env::LaunchEnv;
use fusec_runtime::params::{prefetch, ParamSource};
use fusec_runtime::programs::RunPrograms;
use fusec_runtime::savedir;
use fusec_runtime::tokens::read_tokens;
use fusec_runtime::train::{eval_loss, train_with, TrainConfig};

use crate::report::{profile_json, profile_table, table, Progress};
use crate::{load_graph, CliResult};
use summary::{Phases, Summary};

/// Runs `fusec run`.
pub fn run(mut a: RunArgs) -> CliResult {
    let t_start = Instant::now();
    a.validate()?;
    let dist = LaunchEnv::from_process_env()?;
    match (&dist, a.ranks) {
        (None, Some(n)) => return ranks::launch(n, a.target),
        (Some(env), _) => ranks::become_rank(&mut a, env)?,
        (None, None) => {}
    }
    let world = dist.as_ref().map_or(1, |e| e.world_size);
    if a.zero == 1 && dist.is_none() {
        return Err("--zero 1 shards the AdamW state across the ranks of a data-parallel run: give --ranks N (or launch with torchrun)".into());
    }
    if a.target == Target::Cuda {
        // The driver's start-up (and the NVRTC workers') overlaps parsing, initialization and
        // compiling.
        fusec_runtime::cuda::start_driver();
        fusec_codegen_cuda::nvrtc::workers::prestart();
    }
    // Ranks on one host share its cores.
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = a.threads.unwrap_or(cores / world).max(1);
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
    if let Some(dir) = &a.resume {
        resume::check(&a, dir, &model, &savedir::read_meta(dir)?)?;
    }
    let (train_data, val_data, val_batches) = load_data(&a, &model, dist.as_ref())?;
    // Drawn (or read) on another thread while the programs compile.
    let params = a.resume.is_none().then(|| {
        let src = if a.init == "random" { ParamSource::Random(a.seed) } else { ParamSource::File(a.init.clone().into()) };
        prefetch(model, src)
    });

    let opts = PipelineOptions {
        // Without accumulation over micro-steps the gradients are transients of the step.
        adamw: AdamWConfig {
            weight_decay: a.weight_decay,
            clip: a.grad_clip.is_some(),
            fresh_grads: a.grad_accum <= 1,
            shard: dist.as_ref().filter(|_| a.zero == 1).map(|e| Shard { rank: e.rank, world: e.world_size }),
            ..AdamWConfig::default()
        },
        // The reference target runs the unfused programs: it is the oracle.
        no_fusion: a.target == Target::Ref,
        precision: a.precision,
        recompute: a.recompute.unwrap_or(Recompute::default_for(a.precision)),
        // One rank averages over itself: its `all_reduce`s would be identities that only cut
        // the fusions around them (the gradient norm's sums then run in other kernels, in
        // another order), so a one-rank run compiles the plain program and gives its bits
        // (ZeRO-1 still shards through the pass).
        data_parallel: dist.as_ref().is_some_and(|e| e.world_size > 1 || a.zero == 1),
        ..PipelineOptions::default()
    };
    let mut phases = Phases { init: t_start.elapsed().as_secs_f64(), ..Phases::default() };
    let t_compile = Instant::now();
    let run = RunPrograms::compile(&g, &opts, &RunPrograms::bindings(a.batch, a.seq), false)?;
    let t_build = Instant::now();
    let mut built = build::executor(&a, &run, threads, dist.as_ref())?;
    let ex = built.ex.as_mut();
    phases.compile = t_compile.elapsed().as_secs_f64();

    // Parameters go to the executor one tensor at a time, as f32, as the producer hands them
    // over: no host copy of the model.
    let t_init = Instant::now();
    let (start, first_loss) = match &a.resume {
        Some(dir) => {
            let meta = savedir::resume(dir, ex, run.step()?, &run.bind, &model)?;
            let (step, first) = resume::start(&meta, &a, dir, train_data.num_tokens())?;
            if a.trace.is_some() && a.steps < step + 2 {
                return Err(format!(
                    "--trace records the second step this run takes (the first is warm-up): resuming at step {step}, it needs --steps {} or more",
                    step + 2
                ));
            }
            errln!("resuming {} at step {step}", dir.display());
            (step, Some(first))
        }
        None => {
            let (_, times) = params.ok_or("internal: no parameters prepared")?.load(ex, run.step()?)?;
            built.summary.push(("parameters".into(), times.row()));
            (0, None)
        }
    };
    phases.init += t_init.elapsed().as_secs_f64();

    if a.steps == 0 {
        let loss = eval_loss(ex, &train_data, 1, a.batch, a.seq)?;
        outln!("step {start}: loss {loss:.6}")?;
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
        warmup_steps: a.warmup_steps,
        lr_decay_to: a.lr_decay_to,
        betas: (opts.adamw.beta1 as f32, opts.adamw.beta2 as f32),
        grad_accum: a.grad_accum,
        grad_clip: a.grad_clip,
        val_every: val_data.as_ref().map(|_| a.val_every),
        val_batches,
        log_json: a.log_json.clone(),
        divergence_factor: (!a.no_divergence_check).then_some(a.divergence_factor),
        start_step: start,
        first_loss,
    };
    let tokens_per_step = a.batch * a.seq * a.grad_accum * world;
    let mut progress = Progress::new(start, a.steps, tokens_per_step, !cfg.schedule().is_constant());
    let mut first_done = None;
    let mut first = first_loss;
    let t_train = Instant::now();
    let watchdog = dist.as_ref().map(|e| ranks::Watchdog::start(e.rank, ranks::timeout(&a)));
    let outcome = train_with(ex, &cfg, &train_data, val_data.as_ref(), |ex, r| {
        first_done.get_or_insert_with(|| t_start.elapsed());
        if let Some(w) = &watchdog {
            w.tick();
        }
        progress.step(r);
        let first = *first.get_or_insert(r.loss);
        let done = r.step + 1;
        // The last step is always saved, and right away: nothing after it can lose it.
        let due = done == a.steps || a.save_every.is_some_and(|n| done % n == 0);
        match (a.save.as_ref().filter(|_| due), opts.adamw.shard) {
            // Rank 0 (or a run of one process) writes.
            (Some(path), shard) if shard.is_none_or(|s| s.rank == 0) => {
                let t = Instant::now();
                let meta = resume::state_meta(&a, &model, done, first, train_data.num_tokens());
                resume::save(path, ex, &run, &model, &meta, shard)?;
                phases.saving += t.elapsed().as_secs_f64();
            }
            // With ZeRO-1 the other ranks send rank 0 the moments they hold.
            (Some(path), Some(shard)) if !args::saves_model_only(path) => ranks::serve_moments(ex, &run, shard)?,
            _ => {}
        }
        // A save is progress too.
        if let (Some(w), Some(env)) = (&watchdog, &dist) {
            w.tick();
            ranks::stall_if_asked(env.rank, done);
        }
        Ok(())
    })?;
    drop(watchdog);
    let rank_times = match &dist {
        Some(env) => Some(ranks::rank_times(ex, env, summary::steady_ms(&outcome.logs).unwrap_or(0.0))?),
        None => None,
    };
    phases.validation = outcome.val_secs;
    phases.train = t_train.elapsed().as_secs_f64() - outcome.val_secs - phases.saving;
    if let Some(v) = outcome.final_val {
        errln!("validation after step {}: loss {v:.6}", a.steps);
    }
    if let Some(path) = &a.save {
        errln!("saved {}", path.display());
    }
    // Rank 0 alone writes the trace (every rank gets the same path).
    if let Some(path) = a.trace.as_ref().filter(|_| dist.as_ref().is_none_or(|e| e.rank == 0)) {
        let compile = timeline::CompileTimes { zero: t_compile, passes: &run.pass_runs, build_start: t_build, build: &built.phases };
        let n = timeline::write(path, &a, threads, start + 2, &compile, ex.profile().as_ref())?;
        errln!("trace: {} ({n} launches; open in https://ui.perfetto.dev)", path.display());
    }
    if let Some(log) = &a.log_json {
        errln!("{}", crate::cmd_plot::plot_hint(log));
    }
    if a.sample > 0 {
        let t = Instant::now();
        let cuda = a.cuda_options(false);
        crate::sample::print_sample(ex, &model, a.target, threads, &cuda, a.sample, a.temperature, a.seed)?;
        phases.sample = t.elapsed().as_secs_f64();
    }
    let summary = Summary {
        args: &a,
        threads,
        outcome: &outcome,
        start,
        tokens_per_step,
        pass_runs: &run.pass_runs,
        first_done: first_done.unwrap_or_default(),
        phases: &phases,
        param_bytes: 4 * model.num_params() as u64,
        rank_times,
    };
    let mut rows = summary.rows(ex, &built.summary, t_start.elapsed().as_secs_f64());
    // After the summary's rows: a measurement's buffers stay out of its host memory peak.
    let timed = ex.profile().filter(|p| p.steps > 0);
    let roof = timed.filter(|_| a.profile || a.profile_json.is_some()).map(|p| roof::roof(&a, ex, &p));
    if let Some(r) = &roof {
        rows.push(("roofline".into(), r.as_ref().map_or_else(|e| format!("none: {e}"), |r| r.describe())));
    }
    out!("{}", table("summary", &rows))?;
    let limits = roof.as_ref().and_then(|r| r.as_ref().ok()).map(|r| r.limits);
    if let Some(p) = ex.profile() {
        if a.profile {
            out!("{}", profile_table(&p, p.steps as usize, limits.as_ref()))?;
        }
        if let Some(path) = &a.profile_json {
            std::fs::write(path, profile_json(&p, limits.as_ref())).map_err(|e| format!("{}: {e}", path.display()))?;
        }
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
fn load_data(a: &RunArgs, model: &Gpt2Config, dist: Option<&LaunchEnv>) -> Result<(DataLoader, Option<DataLoader>, usize), String> {
    let (rank, world) = dist.map_or((0, 1), |e| (e.rank, e.world_size));
    let slice = |tokens: Vec<u16>| DataLoader::for_rank(tokens, a.batch, a.seq, rank, world);
    let loader = |p: &std::path::PathBuf| -> Result<DataLoader, String> {
        let l = slice(read_tokens(p).map_err(|e| e.to_string())?).map_err(|e| format!("{}: {e}", p.display()))?;
        l.check_vocab(model.vocab).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(l)
    };
    let (train, val) = match &a.data {
        Some(p) => (loader(p)?, a.val.as_ref().map(loader).transpose()?),
        None => {
            errln!("no --data: training on the embedded corpus (a generated Markov chain over {} tokens)", model.vocab);
            let corpus = |seed| slice(markov_tokens(model.vocab, 200_000, 42, seed));
            (corpus(1)?, Some(corpus(2)?))
        }
    };
    let held = val.as_ref().map_or(usize::MAX, |v| v.batches());
    let val_batches = match a.val_batches {
        Some(n) if n > held => {
            return Err(format!("--val-batches {n} exceeds the {held} batches of B={} T={} the validation data holds", a.batch * world, a.seq))
        }
        Some(n) => n,
        None => held.clamp(1, 4),
    };
    Ok((train, val, val_batches))
}
