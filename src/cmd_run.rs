//! `fusec run FILE --target ...`: evaluate or train a graph.

use clap::{Args, ValueEnum};
use std::collections::HashMap;
use std::path::PathBuf;

use fusec_ir::interp::Precision;
use fusec_ir::{Bindings, Graph};
use fusec_models::Gpt2Config;
use fusec_passes::optimizer::AdamWConfig;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_runtime::checkpoint::{Checkpoint, LlmcConfig};
use fusec_runtime::corpus::markov_tokens;
use fusec_runtime::data::DataLoader;
use fusec_runtime::executor::{Executor, Program, RefExecutor};
use fusec_runtime::params::{checkpoint_from_params, params_from_checkpoint};
use fusec_runtime::tokens::read_tokens;
use fusec_runtime::train::{eval_loss, init_state, train, TrainConfig};

use crate::{load_graph, CliResult};

/// Where the graph runs.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Target {
    /// The reference interpreter (slow, obviously correct: the oracle).
    Ref,
}

/// Arguments of `fusec run`.
#[derive(Args)]
pub struct RunArgs {
    /// The `.graph` file (forward + loss, e.g. from `fusec export`).
    file: PathBuf,
    /// Where to run it.
    #[arg(long, value_enum, default_value = "ref")]
    target: Target,
    /// Initial parameters: an llm.c checkpoint file, or `random` (GPT-2 initialization).
    #[arg(long, default_value = "random")]
    init: String,
    /// Seed for `--init random`.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Training tokens (llm.c token file); default: the embedded generated corpus.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Validation tokens (llm.c token file).
    #[arg(long)]
    val: Option<PathBuf>,
    /// Compute the validation loss every N steps (needs --val).
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
    /// Write the parameters after training as an llm.c checkpoint.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Write one JSON object per step (step, loss, lr, ms, val_loss).
    #[arg(long)]
    log_json: Option<PathBuf>,
}

/// Runs `fusec run`.
pub fn run(a: RunArgs) -> CliResult {
    let g = load_graph(&a.file)?;
    let model = Gpt2Config::from_graph(&g).map_err(|e| format!("{}: {e}", a.file.display()))?;
    let llmc = LlmcConfig {
        max_seq: model.max_seq,
        vocab: model.vocab,
        padded_vocab: model.padded_vocab,
        layers: model.layers,
        heads: model.heads,
        channels: model.channels,
    };
    let ckpt = match a.init.as_str() {
        "random" => fusec_runtime::checkpoint::random_init(&llmc, a.seed),
        path => Checkpoint::read(path.as_ref()).map_err(|e| e.to_string())?,
    };
    let params = params_from_checkpoint(&g, &ckpt)?;
    if a.batch == 0 || a.seq == 0 || a.grad_accum == 0 {
        return Err("--batch, --seq and --grad-accum must be at least 1".into());
    }
    if a.seq > model.max_seq {
        return Err(format!("--seq {} exceeds the model's maximum sequence length {}", a.seq, model.max_seq));
    }
    let loader = |p: &PathBuf| -> Result<DataLoader, String> {
        let l = DataLoader::new(read_tokens(p).map_err(|e| e.to_string())?, a.batch, a.seq).map_err(|e| format!("{}: {e}", p.display()))?;
        l.check_vocab(model.vocab).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(l)
    };
    let (train_data, val_data) = match &a.data {
        Some(p) => (loader(p)?, a.val.as_ref().map(loader).transpose()?),
        None => {
            println!("no --data: training on the embedded corpus (a generated Markov chain over {} tokens)", model.vocab);
            let corpus = |seed| DataLoader::new(markov_tokens(model.vocab, 200_000, 42, seed), a.batch, a.seq);
            (corpus(1)?, Some(corpus(2)?))
        }
    };

    // The reference target runs the unfused programs: it is the oracle the fused ones are
    // checked against.
    let opts = PipelineOptions {
        adamw: AdamWConfig { weight_decay: a.weight_decay, clip: a.grad_clip.is_some(), ..AdamWConfig::default() },
        no_fusion: true,
        ..PipelineOptions::default()
    };
    let mut bind = Bindings::default();
    bind.set("B", a.batch as u64).set("T", a.seq as u64);
    let grad = compile(&g, "optimizer", Mode::Grad, &opts, &bind)?.graph;
    let step = compile(&g, "optimizer", Mode::Step, &opts, &bind)?.graph;
    let graphs: HashMap<Program, Graph> = [(Program::Eval, g.clone()), (Program::Grad, grad), (Program::Step, step.clone())].into();
    let mut ex = RefExecutor::new(graphs, bind, Precision::F32);
    init_state(&mut ex, &step, &params)?;

    if a.steps == 0 {
        let loss = eval_loss(&mut ex, &train_data, 1, a.batch, a.seq)?;
        println!("step 0: loss {loss:.6}");
        if let Some(v) = &val_data {
            println!("val loss {:.6}", eval_loss(&mut ex, v, a.val_batches, a.batch, a.seq)?);
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
    let tokens_per_step = (a.batch * a.seq * a.grad_accum) as f64;
    let logs = train(&mut ex, &cfg, &train_data, val_data.as_ref(), |r| {
        let val = r.val_loss.map(|v| format!("  val {v:.6}")).unwrap_or_default();
        println!("step {:>4}/{}: loss {:.6}{val}  {:.1} ms  {:.0} tok/s", r.step, a.steps, r.loss, r.ms, tokens_per_step / r.ms * 1e3);
    })?;
    let (first, last) = (logs.first().map(|l| l.loss), logs.last().map(|l| l.loss));
    println!("loss {:.6} -> {:.6} over {} steps", first.unwrap_or(f64::NAN), last.unwrap_or(f64::NAN), logs.len());
    if let Some(path) = &a.save {
        let mut now = HashMap::new();
        for (name, _) in g.params() {
            now.insert(name.to_string(), ex.get(name)?);
        }
        checkpoint_from_params(&llmc, &now)?.write(path).map_err(|e| e.to_string())?;
        println!("saved {}", path.display());
    }
    Ok(())
}
