//! The training loop: data, micro-steps, AdamW scalars, validation, divergence checks, logs.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use fusec_ir::interp::Tensor;
use fusec_ir::{DType, Graph};

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
    /// Optimizer steps.
    pub steps: usize,
    /// Learning rate (constant).
    pub lr: f32,
    /// AdamW beta1 and beta2 (for the bias corrections computed here).
    pub betas: (f32, f32),
    /// Micro-steps accumulated per optimizer step.
    pub grad_accum: usize,
    /// Maximum global gradient norm, when clipping.
    pub grad_clip: Option<f32>,
    /// Compute the validation loss before every step that is a multiple of this, if set.
    pub val_every: Option<usize>,
    /// Validation batches per evaluation.
    pub val_batches: usize,
    /// Write one JSON object per step here.
    pub log_json: Option<PathBuf>,
    /// Stop when a step's loss exceeds this many times the first step's loss, if set.
    pub divergence_factor: Option<f64>,
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
            betas: (0.9, 0.999),
            grad_accum: 1,
            grad_clip: None,
            val_every: None,
            val_batches: 0,
            log_json: None,
            divergence_factor: None,
        }
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
/// that AdamW writes) and zeroes optimizer state and gradient accumulators. The only way to set
/// parameters for training: a copy left stale would train on other weights.
pub fn init_state(ex: &mut dyn Executor, step_graph: &Graph, params: &HashMap<String, Tensor>) -> Result<(), String> {
    let inputs: std::collections::HashSet<&str> = step_graph.inputs().into_iter().map(|(n, _)| n).collect();
    for (name, _) in step_graph.params() {
        let t = params.get(name).ok_or_else(|| format!("no initial value for parameter `{name}`"))?;
        ex.set(name, t.clone())?;
        let copy = format!("{}{name}", fusec_passes::amp::COPY_PREFIX);
        if inputs.contains(copy.as_str()) {
            let data = t.data.iter().map(|&x| fusec_ir::interp::round_to(DType::BF16, x)).collect();
            ex.set(&copy, Tensor { dtype: DType::BF16, shape: t.shape.clone(), data })?;
        }
        let shape = t.shape.clone();
        for prefix in ["m.", "v.", "grad."] {
            let state = format!("{prefix}{name}");
            // A step without accumulation has no `grad.P` (the gradients are its transients).
            if prefix != "grad." || inputs.contains(state.as_str()) {
                ex.set_zeros(&state, DType::F32, shape.clone())?;
            }
        }
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
    let mut log_file = match &cfg.log_json {
        Some(p) => Some(std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => None,
    };
    let (b, t, k) = (cfg.batch, cfg.seq, cfg.grad_accum.max(1));
    let mut logs = vec![];
    for step in 0..cfg.steps {
        let val_loss = match (val, cfg.val_every) {
            (Some(v), Some(every)) if step % every == 0 => Some(eval_loss(ex, v, cfg.val_batches, b, t)?),
            _ => None,
        };
        let t0 = Instant::now();
        let tstep = (step + 1) as f32;
        ex.set("dloss", Tensor::scalar(DType::F32, 1.0 / k as f64))?;
        ex.set("lr", Tensor::scalar(DType::F32, cfg.lr as f64))?;
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
        if let (Some(f), Some(first)) = (cfg.divergence_factor, logs.first().map(|l: &StepLog| l.loss)) {
            if loss > f * first {
                return Err(format!(
                    "training diverged: loss {loss:.4} at step {} is more than {f}x the first step's {first:.4} \
                     (lower --lr, or --divergence-factor / --no-divergence-check)",
                    step + 1
                ));
            }
        }
        ex.zero_grads()?;
        let rec = StepLog { step, loss, lr: cfg.lr, ms: t0.elapsed().as_secs_f64() * 1e3, val_loss, grad_norm };
        if let Some(f) = log_file.as_mut() {
            writeln!(f, "{}", json_line(&rec)).map_err(|e| format!("writing the JSON log: {e}"))?;
        }
        on_step(&rec);
        logs.push(rec);
    }
    Ok(logs)
}

fn json_line(r: &StepLog) -> String {
    let num = |x: f64| {
        if x.is_finite() {
            format!("{x}")
        } else {
            "null".into()
        }
    };
    let mut s = format!("{{\"step\":{},\"loss\":{},\"lr\":{},\"ms\":{:.3}", r.step, num(r.loss), r.lr, r.ms);
    if let Some(v) = r.val_loss {
        s += &format!(",\"val_loss\":{}", num(v));
    }
    if let Some(n) = r.grad_norm {
        s += &format!(",\"grad_norm\":{}", num(n));
    }
    s + "}"
}
