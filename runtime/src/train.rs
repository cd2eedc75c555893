//! The training loop: data, micro-steps, AdamW scalars, validation, divergence checks, logs.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fusec_ir::interp::Tensor;
use fusec_ir::{DType, Graph};

use crate::schedule::LrSchedule;

use crate::data::DataLoader;
use crate::executor::Executor;
use crate::programs::Program;

/// Settings of a training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Sequences per micro-batch (B).
    pub batch: usize,
    /// Tokens per sequence (T).
    pub seq: usize,
    /// Optimizer steps of the whole run (a resumed run counts the steps before it too).
    pub steps: usize,
    /// Peak learning rate (constant with the default schedule).
    pub lr: f32,
    /// Warmup steps of the learning-rate schedule ([`LrSchedule`]; 0: none).
    pub warmup_steps: usize,
    /// Final learning rate of the cosine decay as a fraction of `lr` (1: no decay).
    pub lr_decay_to: f32,
    /// AdamW beta1 and beta2 (for the bias corrections computed here).
    pub betas: (f32, f32),
    /// Micro-steps accumulated per optimizer step.
    pub grad_accum: usize,
    /// Maximum global gradient norm, when clipping.
    pub grad_clip: Option<f32>,
    /// Compute the validation loss before every step that is a multiple of this, and after the
    /// last step, if set.
    pub val_every: Option<usize>,
    /// Validation batches per evaluation.
    pub val_batches: usize,
    /// Write one JSON object per step here: `step` (0-based), `loss`, `lr`, `tokens` (trained on
    /// up to and including this step), `ms`, `val_loss` (measured before the step, when
    /// validating then) and `grad_norm` (when clipping); after the last step
    /// `{"step":N,"val_loss":x}` when validating. `fusec plot` draws it.
    pub log_json: Option<PathBuf>,
    /// Stop when a step's loss exceeds this many times the first step's loss, if set.
    pub divergence_factor: Option<f64>,
    /// Steps already done (a resumed run): training runs steps `start_step..steps`, and the
    /// JSON log keeps its records of the steps before.
    pub start_step: usize,
    /// The first step's loss when it was done before (a resumed run): the divergence check's
    /// reference.
    pub first_loss: Option<f64>,
}

impl TrainConfig {
    /// `steps` steps of `batch` sequences of `seq` tokens at a constant `lr`, with llm.c's
    /// other settings: betas (0.9, 0.999), no accumulation, clipping, validation or log.
    pub fn new(batch: usize, seq: usize, steps: usize, lr: f32) -> TrainConfig {
        TrainConfig {
            batch,
            seq,
            steps,
            lr,
            warmup_steps: 0,
            lr_decay_to: 1.0,
            betas: (0.9, 0.999),
            grad_accum: 1,
            grad_clip: None,
            val_every: None,
            val_batches: 0,
            log_json: None,
            divergence_factor: None,
            start_step: 0,
            first_loss: None,
        }
    }

    /// The learning-rate schedule over the run's `steps`.
    pub fn schedule(&self) -> LrSchedule {
        LrSchedule { lr: self.lr, warmup: self.warmup_steps, total: self.steps, decay_to: self.lr_decay_to }
    }
}

/// One step's record.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLog {
    /// Step index (0-based).
    pub step: usize,
    /// Mean training loss over the step's micro-batches, before the update.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f32,
    /// Wall time of the step in milliseconds.
    pub ms: f64,
    /// Validation loss before this step, where computed.
    pub val_loss: Option<f64>,
    /// Global gradient norm, when clipping.
    pub grad_norm: Option<f64>,
}

/// Loads parameters into the executor (and their bf16 copies, where the step reads the copies
/// that AdamW writes) and zeroes optimizer state and gradient accumulators
/// ([`crate::params::set_param`]); [`crate::params::load_params`] does the same from a file or
/// the random initialization without host tensors.
pub fn init_state(ex: &mut dyn Executor, step_graph: &Graph, params: &HashMap<String, Tensor>) -> Result<(), String> {
    let inputs = crate::params::input_names(step_graph);
    for (name, _) in step_graph.params() {
        let t = params.get(name).ok_or_else(|| format!("no initial value for parameter `{name}`"))?;
        crate::params::set_param(ex, &inputs, name, &t.shape, &t.to_f32())?;
    }
    Ok(())
}

/// Sets a batch's tokens and targets.
fn set_batch(ex: &mut dyn Executor, loader: &DataLoader, index: usize, b: usize, t: usize) -> Result<(), String> {
    let (x, y) = loader.batch(index);
    ex.set("tokens", Tensor::from_i32(vec![b, t], &x))?;
    ex.set("targets", Tensor::from_i32(vec![b, t], &y))
}

/// Mean loss over the first `n` batches of `loader` (the Eval program).
pub fn eval_loss(ex: &mut dyn Executor, loader: &DataLoader, n: usize, b: usize, t: usize) -> Result<f64, String> {
    let mut sum = 0.0;
    for i in 0..n {
        set_batch(ex, loader, i, b, t)?;
        sum += ex.run(Program::Eval)?.loss.ok_or("Eval has no `loss` output")?;
    }
    Ok(sum / n as f64)
}

/// What a training run produced.
#[derive(Clone, Debug, Default)]
pub struct TrainOutcome {
    /// One record per step run here.
    pub logs: Vec<StepLog>,
    /// The validation loss after the last step, when validating.
    pub final_val: Option<f64>,
    /// Seconds spent in validation.
    pub val_secs: f64,
}

/// Trains for `cfg.steps` steps; `on_step` sees each record (progress display). Stops with an
/// error naming the step (1-based, as the progress shows it) when the loss or the gradient norm
/// is NaN or infinite, or when the loss exceeds `cfg.divergence_factor` times the first step's.
pub fn train(
    ex: &mut dyn Executor,
    cfg: &TrainConfig,
    train: &DataLoader,
    val: Option<&DataLoader>,
    mut on_step: impl FnMut(&StepLog),
) -> Result<Vec<StepLog>, String> {
    let run = train_with(ex, cfg, train, val, |_, r| {
        on_step(r);
        Ok(())
    })?;
    Ok(run.logs)
}

/// [`train`] from step `cfg.start_step`, where `after_step` also gets the executor after each
/// step (to save a checkpoint) and may stop the run with an error; ends with the validation loss
/// after the last step when validating.
pub fn train_with(
    ex: &mut dyn Executor,
    cfg: &TrainConfig,
    train: &DataLoader,
    val: Option<&DataLoader>,
    mut after_step: impl FnMut(&mut dyn Executor, &StepLog) -> Result<(), String>,
) -> Result<TrainOutcome, String> {
    let mut log_file = match &cfg.log_json {
        Some(p) => Some(open_log(p, cfg.start_step)?),
        None => None,
    };
    let (b, t, k) = (cfg.batch, cfg.seq, cfg.grad_accum.max(1));
    let schedule = cfg.schedule();
    let mut out = TrainOutcome::default();
    let validate = |ex: &mut dyn Executor, out: &mut TrainOutcome, v: &DataLoader| -> Result<f64, String> {
        let t0 = Instant::now();
        let loss = eval_loss(ex, v, cfg.val_batches, b, t);
        out.val_secs += t0.elapsed().as_secs_f64();
        loss
    };
    let mut first = cfg.first_loss;
    for step in cfg.start_step..cfg.steps {
        let val_loss = match (val, cfg.val_every) {
            (Some(v), Some(every)) if step % every == 0 => Some(validate(ex, &mut out, v)?),
            _ => None,
        };
        let t0 = Instant::now();
        let tstep = (step + 1) as f32;
        let lr = schedule.at(step);
        ex.set("dloss", Tensor::scalar(DType::F32, 1.0 / k as f64))?;
        ex.set("lr", Tensor::scalar(DType::F32, lr as f64))?;
        ex.set("bc1", Tensor::scalar(DType::F32, (1.0 - cfg.betas.0.powf(tstep)) as f64))?;
        ex.set("bc2", Tensor::scalar(DType::F32, (1.0 - cfg.betas.1.powf(tstep)) as f64))?;
        if let Some(c) = cfg.grad_clip {
            ex.set("grad_clip", Tensor::scalar(DType::F32, c as f64))?;
        }
        let mut loss = 0.0;
        let mut grad_norm = None;
        for micro in 0..k {
            set_batch(ex, train, step * k + micro, b, t)?;
            let program = if micro + 1 == k { Program::Step } else { Program::Grad };
            let out = ex.run(program)?;
            let l = out.loss.ok_or("the training graph has no `loss` output")?;
            if !l.is_finite() {
                return Err(format!("training diverged: loss is {l} at step {} (micro-step {})", step + 1, micro + 1));
            }
            loss += l / k as f64;
            grad_norm = out.grad_norm;
        }
        if let Some(n) = grad_norm.filter(|n| !n.is_finite()) {
            return Err(format!("training diverged: the gradient norm is {n} at step {}", step + 1));
        }
        if let (Some(f), Some(first)) = (cfg.divergence_factor, first) {
            if loss > f * first {
                return Err(format!(
                    "training diverged: loss {loss:.4} at step {} is more than {f}x the first step's {first:.4} \
                     (lower --lr, or --divergence-factor / --no-divergence-check)",
                    step + 1
                ));
            }
        }
        first.get_or_insert(loss);
        ex.zero_grads()?;
        let rec = StepLog { step, loss, lr, ms: t0.elapsed().as_secs_f64() * 1e3, val_loss, grad_norm };
        if let Some(f) = log_file.as_mut() {
            writeln!(f, "{}", json_line(&rec, (step + 1) * b * t * k)).map_err(|e| format!("writing the JSON log: {e}"))?;
        }
        after_step(ex, &rec)?;
        out.logs.push(rec);
    }
    if let (Some(v), Some(_)) = (val, cfg.val_every) {
        let loss = validate(ex, &mut out, v)?;
        if let Some(f) = log_file.as_mut() {
            writeln!(f, "{{\"step\":{},\"val_loss\":{}}}", cfg.steps, json_num(loss)).map_err(|e| format!("writing the JSON log: {e}"))?;
        }
        out.final_val = Some(loss);
    }
    Ok(out)
}

/// Opens the JSON log: a new file, or for a run resumed at step `start` the existing log with
/// only its records of the steps before `start` (the steps after them, logged before the run
/// stopped, are done again), to append to.
fn open_log(path: &Path, start: usize) -> Result<std::fs::File, String> {
    let named = |e: std::io::Error| format!("{}: {e}", path.display());
    if start == 0 {
        return std::fs::File::create(path).map_err(named);
    }
    let kept: String = match std::fs::read_to_string(path) {
        Ok(text) => text.lines().filter(|l| record_step(l).is_some_and(|s| s < start)).map(|l| format!("{l}\n")).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(named(e)),
    };
    crate::atomic::write_atomic(path, |f| f.write(kept.as_bytes())).map_err(|e| e.to_string())?;
    std::fs::OpenOptions::new().append(true).open(path).map_err(named)
}

/// The step of a JSON log record (`{"step":N,...}`).
fn record_step(line: &str) -> Option<usize> {
    line.strip_prefix("{\"step\":")?.split([',', '}']).next()?.parse().ok()
}

fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".into()
    }
}

/// A step's JSON record; `tokens`: the tokens trained on up to and including this step.
fn json_line(r: &StepLog, tokens: usize) -> String {
    let mut s = format!("{{\"step\":{},\"loss\":{},\"lr\":{},\"tokens\":{tokens},\"ms\":{:.3}", r.step, json_num(r.loss), r.lr, r.ms);
    if let Some(v) = r.val_loss {
        s += &format!(",\"val_loss\":{}", json_num(v));
    }
    if let Some(n) = r.grad_norm {
        s += &format!(",\"grad_norm\":{}", json_num(n));
    }
    s + "}"
}
