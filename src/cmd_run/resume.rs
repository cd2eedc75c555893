//! `--save` and `--resume`: what a checkpoint folder's state records about the run (its
//! scalars), the checks a resumed run makes against them, and writing a save.
//!
//! The scalars: the step reached, the first step's loss (the divergence check's reference), the
//! data position, the seed, and the settings of the run. A resumed run must keep the model,
//! `--precision`, `--batch`, `--seq` and `--grad-accum` (else it is refused, naming the flag);
//! any other setting that changes the numbers (`--lr`, the schedule, `--steps` when the
//! learning rate decays, `--weight-decay`, `--grad-clip`, the target, the training data) may
//! change, with a note that the run no longer continues the saved one exactly.

use std::path::Path;

use fusec_models::Gpt2Config;
use fusec_passes::recompute::Recompute;
use fusec_passes::zero::Shard;
use fusec_runtime::atomic::write_atomic;
use fusec_runtime::checkpoint::write_params;
use fusec_runtime::executor::Executor;
use fusec_runtime::programs::RunPrograms;
use fusec_runtime::savedir;
use fusec_runtime::state::Meta;

use super::args::{saves_model_only, RunArgs};

/// The model's sizes as the state records them (llm.c's header names).
fn model_fields(m: &Gpt2Config) -> [(&'static str, usize); 6] {
    [
        ("max_seq_len", m.max_seq),
        ("vocab_size", m.vocab),
        ("padded_vocab_size", m.padded_vocab),
        ("num_layers", m.layers),
        ("num_heads", m.heads),
        ("channels", m.channels),
    ]
}

/// Settings a resumed run must keep: (state key, flag, value in this run).
fn fixed_settings(a: &RunArgs) -> [(&'static str, &'static str, String); 5] {
    [
        ("precision", "--precision", a.precision.name().to_string()),
        ("batch", "--batch", a.batch.to_string()),
        ("seq", "--seq", a.seq.to_string()),
        ("grad_accum", "--grad-accum", a.grad_accum.to_string()),
        // The global batch and its slices: a rank count set by `ranks::become_rank`.
        ("ranks", "--ranks", a.ranks.unwrap_or(1).to_string()),
    ]
}

/// Settings that change the numbers but may change on resume: (state key, flag, value).
fn other_settings(a: &RunArgs) -> Vec<(&'static str, &'static str, String)> {
    let recompute = a.recompute.unwrap_or(Recompute::default_for(a.precision));
    let mut v = vec![
        ("lr", "--lr", a.lr.to_string()),
        ("warmup_steps", "--warmup-steps", a.warmup_steps.to_string()),
        ("lr_decay_to", "--lr-decay-to", a.lr_decay_to.to_string()),
        ("weight_decay", "--weight-decay", a.weight_decay.to_string()),
        ("grad_clip", "--grad-clip", a.grad_clip.map_or("none".into(), |c| c.to_string())),
        ("target", "--target", a.target_name().to_string()),
        ("recompute", "--recompute", Recompute::NAMES[recompute as usize].to_string()),
    ];
    // The cosine decay spans --steps: a different total moves the schedule.
    if a.lr_decay_to != 1.0 {
        v.push(("steps", "--steps", a.steps.to_string()));
    }
    v
}

/// The state's scalars after `step` steps of this run.
pub fn state_meta(a: &RunArgs, model: &Gpt2Config, step: usize, first_loss: f64, train_tokens: usize) -> Meta {
    let mut m = Meta::default();
    m.set("fusec_version", env!("CARGO_PKG_VERSION"));
    m.set("step", step);
    m.set("steps", a.steps);
    // Display of an f64 is the shortest text that parses back to the same bits.
    m.set("first_loss", first_loss);
    m.set("train_batch", step * a.grad_accum);
    m.set("train_tokens", train_tokens);
    // No random numbers are drawn during training (no dropout): the seed is the whole RNG state.
    m.set("seed", a.seed);
    for (k, v) in model_fields(model) {
        m.set(k, v);
    }
    for (k, _, v) in fixed_settings(a) {
        m.set(k, v);
    }
    for (k, _, v) in other_settings(a) {
        m.set(k, v);
    }
    m
}

/// Checks a resumed run against the saved state's scalars before anything is compiled: the
/// same model, precision, B, T and accumulation (else an error naming the flag), more `--steps`
/// than were done (or 0, to evaluate); notes on standard error for other settings that differ.
pub fn check(a: &RunArgs, dir: &Path, model: &Gpt2Config, m: &Meta) -> Result<(), String> {
    // States saved before data parallelism have no `ranks`: they are of one process.
    let saved = |k: &str| m.get(k).unwrap_or(if k == "ranks" { "1" } else { "none" }).to_string();
    let diff: Vec<String> = model_fields(model)
        .iter()
        .filter(|(k, v)| saved(k) != v.to_string())
        .map(|(k, v)| format!("{k} {} there, {v} in this graph", saved(k)))
        .collect();
    if !diff.is_empty() {
        return Err(format!("--resume {}: the checkpoint is of another model: {}", dir.display(), diff.join("; ")));
    }
    for (k, flag, v) in fixed_settings(a) {
        if saved(k) != v {
            return Err(format!(
                "--resume {}: {flag} {v} differs from the saved run's {flag} {}: a resumed run keeps --precision, --batch, --seq, --grad-accum and --ranks",
                dir.display(),
                saved(k)
            ));
        }
    }
    let step: usize = m.parse("step").map_err(|e| format!("--resume {}: {e}", dir.display()))?;
    steps_left(a, dir, step)?;
    let notes: Vec<String> = other_settings(a)
        .into_iter()
        .filter(|(k, _, v)| m.get(k).is_some_and(|s| s != v))
        .map(|(k, flag, v)| format!("{flag} {v} (saved: {})", saved(k)))
        .collect();
    if !notes.is_empty() {
        errln!("note: resuming with {}: the run goes on, but not as the saved run would have", notes.join(", "));
    }
    Ok(())
}

/// Refuses `--steps` at or below the checkpoint's `step` (0 evaluates, and is allowed).
fn steps_left(a: &RunArgs, dir: &Path, step: usize) -> Result<(), String> {
    if a.steps != 0 && a.steps <= step {
        return Err(format!(
            "--steps {}: the checkpoint in {} is at step {step} already; --steps counts every step of the run, so give more than {step} \
             (or 0 to evaluate)",
            a.steps,
            dir.display()
        ));
    }
    Ok(())
}

/// Where the resumed run starts: (steps done, the first step's loss), from the state that
/// [`savedir::resume`] loaded; notes a different training set. It refuses a state at or past `--steps` (after an interrupted save,
/// the newer state, which [`check`] may not have seen).
pub fn start(m: &Meta, a: &RunArgs, dir: &Path, train_tokens: usize) -> Result<(usize, f64), String> {
    let step: usize = m.parse("step")?;
    steps_left(a, dir, step)?;
    let batch: usize = m.parse("train_batch")?;
    if step.checked_mul(a.grad_accum) != Some(batch) {
        return Err(format!("the state's data position (batch {batch}) is not that of step {step}: a corrupt state"));
    }
    if m.get("train_tokens") != Some(&train_tokens.to_string()) {
        errln!(
            "note: the training data has {train_tokens} tokens, the saved run's had {}: batches after step {step} differ from the saved run's",
            m.get("train_tokens").unwrap_or("?")
        );
    }
    Ok((step, m.parse("first_loss")?))
}

/// Writes a save of the executor's state after `step` steps: a checkpoint folder (model and
/// state), or the model alone to a `.bin` path. Never torn: see [`savedir`]. With ZeRO-1
/// (`zero`, on rank 0) the moments other ranks hold are gathered tensor by tensor while the
/// state is written (the other ranks take part: [`super::ranks::serve_moments`]), so the
/// folder is the same as a run without ZeRO writes.
pub fn save(path: &Path, ex: &mut dyn Executor, run: &RunPrograms, model: &Gpt2Config, meta: &Meta, zero: Option<Shard>) -> Result<(), String> {
    if saves_model_only(path) {
        return write_atomic(path, |f| write_params(f, model, &mut |name, _, v| ex.get_f32(name, v)))
            .map_err(|e| format!("saving {} failed: {e}; the previous file there is kept", path.display()));
    }
    let Some(shard) = zero else { return savedir::save(path, ex, run.step()?, &run.bind, model, meta) };
    let moments = super::ranks::zero_moments(run, shard)?;
    let specs: Vec<_> = moments.iter().map(|(spec, _)| spec.clone()).collect();
    let owner: std::collections::HashMap<&str, (usize, usize)> =
        moments.iter().map(|((n, _, s), o)| (n.as_str(), (*o, s.iter().product()))).collect();
    let ex = std::cell::RefCell::new(ex);
    savedir::save_with(
        path,
        &mut |name, v| ex.borrow().get_f32(name, v),
        &specs,
        &mut |name, v| {
            let o = *owner.get(name).ok_or_else(|| format!("internal: no owner of `{name}`"))?;
            super::ranks::gather_moment(&mut **ex.borrow_mut(), shard, name, o, v)
        },
        model,
        meta,
    )
}
