//! A checkpoint directory (`fusec run --save DIR`, `--resume DIR`): `model.bin`, the parameters
//! as an llm.c checkpoint, and `state.bin` ([`crate::state`]), everything else a resumed run
//! needs, saved and read as a pair.
//!
//! A save writes `model.bin.tmp` and `state.bin.tmp` completely and flushes them to disk, then
//! renames `model.bin.tmp` over `model.bin` and `state.bin.tmp` over `state.bin`. The state
//! records the model file's CRC-32, so a pair is checked when it is read. A process killed at
//! any moment leaves one of:
//! - before the first rename: the previous pair, untouched (a `.tmp` file is ignored, and
//!   overwritten by the next save);
//! - between the renames: the new `model.bin`, the previous `state.bin` and the complete new
//!   `state.bin.tmp`: reading finds that `state.bin` does not name this `model.bin`, checks
//!   `state.bin.tmp` whole, and takes it when it does (the interrupted save is rolled forward);
//! - after the second rename: the new pair.
//!
//! A write that fails (a full disk) removes its temporary file and leaves the previous pair.

use std::collections::HashMap;
use std::path::Path;

use fusec_ir::{Bindings, DType, Graph};
use fusec_models::Gpt2Config;

use crate::atomic::{temp_path, PendingFile};
use crate::checkpoint::write_params;
use crate::executor::Executor;
use crate::file_error::HEADER_BYTES;
use crate::params::{load_params, ParamSource};
use crate::state::{write_state, Meta, StateReader};

/// The parameters, an llm.c checkpoint.
pub const MODEL_FILE: &str = "model.bin";
/// Everything else ([`crate::state`]).
pub const STATE_FILE: &str = "state.bin";
/// The inputs of a step program that the training loop sets before every step: not state.
pub const PER_STEP_INPUTS: [&str; 7] = ["tokens", "targets", "dloss", "lr", "bc1", "bc2", "grad_clip"];
/// Test hook: `PHASE:STEP` ends the process at once (exit code 137, no cleanup, as a SIGKILL)
/// when the save of step STEP reaches PHASE: `model` (half of `model.bin.tmp` written), `state`
/// (half of `state.bin.tmp` written), `commit` (`model.bin` renamed, `state.bin` not yet) or
/// `saved` (the save complete).
pub const KILL_ENV: &str = "FUSEC_TEST_KILL_AT";

/// The tensors a state file holds for a step program: every input except the per-step ones,
/// the gradient accumulators (zero between steps) and the bf16 parameter copies (the rounded
/// parameters, restored from `model.bin`): the AdamW moments `m.P` and `v.P`.
pub fn state_tensors(step_graph: &Graph, bind: &Bindings) -> Result<Vec<(String, DType, Vec<usize>)>, String> {
    let mut out = vec![];
    for (name, v) in step_graph.inputs() {
        if PER_STEP_INPUTS.contains(&name) || name.starts_with("grad.") || name.starts_with(fusec_passes::amp::COPY_PREFIX) {
            continue;
        }
        let ty = step_graph.ty(v);
        let shape = ty.shape.eval(bind).map_err(|e| format!("input `{name}`: {e}"))?;
        out.push((name.to_string(), ty.dtype, shape));
    }
    Ok(out)
}

fn kill_requested(phase: &str, step: &str) -> bool {
    std::env::var(KILL_ENV).is_ok_and(|v| v == format!("{phase}:{step}"))
}

/// Saves the executor's parameters (a GPT-2 of config `cfg`) and state into `dir` (created if
/// missing), with the scalars `meta` (its `step` names the save in errors). On an error the
/// previous pair in `dir` is kept, and the message says so.
pub fn save(dir: &Path, ex: &dyn Executor, step_graph: &Graph, bind: &Bindings, cfg: &Gpt2Config, meta: &Meta) -> Result<(), String> {
    let specs = state_tensors(step_graph, bind)?;
    save_with(dir, &mut |name, v| ex.get_f32(name, v), &specs, &mut |name, v| ex.get_f32(name, v), cfg, meta)
}

/// A tensor's values by name, into the vector given (reused).
pub type Source<'a> = dyn FnMut(&str, &mut Vec<f32>) -> Result<(), String> + 'a;

/// [`save`] with the parameters read from `params` and the state tensors `specs` (name, type,
/// shape) from `state`, in `specs` order: a ZeRO-1 rank 0 gathers the moments other ranks hold.
pub fn save_with(
    dir: &Path,
    params: &mut Source,
    specs: &[(String, DType, Vec<usize>)],
    state_source: &mut Source,
    cfg: &Gpt2Config,
    meta: &Meta,
) -> Result<(), String> {
    let step = meta.get("step").unwrap_or("?").to_string();
    let fail =
        |e: String| format!("saving the checkpoint of step {step} failed: {e}; the previous checkpoint in {} is kept", dir.display());
    std::fs::create_dir_all(dir).map_err(|e| fail(format!("{}: cannot create the folder: {e}", dir.display())))?;
    let mut model = PendingFile::create(&dir.join(MODEL_FILE)).map_err(|e| fail(e.into()))?;
    if kill_requested("model", &step) {
        model.exit_after((HEADER_BYTES + 4 * cfg.num_params()) as u64 / 2);
    }
    write_params(&mut model, cfg, &mut |name, _, v| params(name, v)).map_err(fail)?;
    let model = model.finish().map_err(|e| fail(e.into()))?;
    let mut meta = meta.clone();
    meta.set("model_crc", format!("{:08x}", model.crc()));
    meta.set("model_bytes", model.len());
    let mut state = PendingFile::create(&dir.join(STATE_FILE)).map_err(|e| fail(e.into()))?;
    if kill_requested("state", &step) {
        state.exit_after(specs.iter().map(|(_, _, s)| 4 * s.iter().product::<usize>() as u64).sum::<u64>() / 2);
    }
    write_state(&mut state, &meta, specs, state_source).map_err(fail)?;
    let state = state.finish().map_err(|e| fail(e.into()))?;
    model.commit().map_err(|e| fail(e.into()))?;
    if kill_requested("commit", &step) {
        std::process::exit(137);
    }
    state.commit().map_err(|e| fail(e.into()))?;
    if kill_requested("saved", &step) {
        std::process::exit(137);
    }
    Ok(())
}

/// The scalars of `dir`'s state file (for checks before anything is compiled). After an
/// interrupted save [`resume`] may take the newer `state.bin.tmp`; its scalars are what
/// [`resume`] returns.
pub fn read_meta(dir: &Path) -> Result<Meta, String> {
    let p = state_path(dir)?;
    let p = if p.exists() { p } else { temp_path(&p) };
    Ok(StateReader::open(&p)?.meta)
}

/// `dir`'s `state.bin`, once `dir` is known to hold a checkpoint: `model.bin` and `state.bin`
/// (or, after a first save interrupted between its renames, `state.bin.tmp`).
fn state_path(dir: &Path) -> Result<std::path::PathBuf, String> {
    if !dir.is_dir() {
        let what = if dir.exists() { "is not a folder" } else { "does not exist" };
        return Err(format!("{}: {what}: --resume takes the checkpoint folder that --save DIR writes", dir.display()));
    }
    let p = dir.join(STATE_FILE);
    if !dir.join(MODEL_FILE).exists() || (!p.exists() && !temp_path(&p).exists()) {
        return Err(format!("{}: no checkpoint to resume from (no {MODEL_FILE} and {STATE_FILE}: --save DIR writes them)", dir.display()));
    }
    Ok(p)
}

/// Loads the pair in `dir` into the executor: the parameters (and their bf16 copies) from
/// `model.bin`, one tensor at a time, then the state tensors; returns the state's scalars.
/// Refuses a pair that does not belong together, a state with missing, extra or differently
/// shaped tensors, and torn files, naming the file.
pub fn resume(dir: &Path, ex: &mut dyn Executor, step_graph: &Graph, bind: &Bindings, cfg: &Gpt2Config) -> Result<Meta, String> {
    let path = state_path(dir)?;
    let model_path = dir.join(MODEL_FILE);
    let reader = StateReader::open(&path).ok();
    let crc = format!("{:08x}", load_params(ex, step_graph, cfg, ParamSource::File(model_path.clone()))?.unwrap_or(0));
    let (reader, path) = match reader {
        Some(r) if r.meta.get("model_crc") == Some(&crc) => (r, path),
        other => {
            // An interrupted save: the new model.bin and the complete new state.bin.tmp.
            let tmp = temp_path(&path);
            match StateReader::verify(&tmp) {
                Ok(m) if m.get("model_crc") == Some(&crc) => (StateReader::open(&tmp)?, tmp),
                _ => {
                    return Err(match other {
                        Some(r) => format!(
                            "{}: {MODEL_FILE} (CRC-32 {crc}) is not the model {STATE_FILE} was saved with (CRC-32 {}): a mismatched pair",
                            dir.display(),
                            r.meta.get("model_crc").unwrap_or("none")
                        ),
                        None => StateReader::open(&path).err().unwrap_or_default(),
                    })
                }
            }
        }
    };
    let meta = reader.meta.clone();
    let want: HashMap<String, (DType, Vec<usize>)> = state_tensors(step_graph, bind)?.into_iter().map(|(n, d, s)| (n, (d, s))).collect();
    // With ZeRO-1 this rank holds the moments of the parameters it owns only.
    let params: std::collections::HashSet<&str> = step_graph.params().into_iter().map(|(n, _)| n).collect();
    let held_elsewhere = |name: &str| ["m.", "v."].iter().any(|p| name.strip_prefix(p).is_some_and(|n| params.contains(n)));
    let mut seen = std::collections::HashSet::new();
    let named = |e: String| format!("{}: {e}", path.display());
    reader.read_tensors(&mut |name, dtype, shape, data| {
        match want.get(name) {
            Some((d, s)) if *d == dtype && s == shape => {}
            Some((d, s)) => return Err(named(format!("`{name}` is {dtype}{shape:?}, this run's is {d}{s:?}"))),
            None if held_elsewhere(name) => return Ok(()),
            None => return Err(named(format!("`{name}` is not a tensor of this run's optimizer state"))),
        }
        if !seen.insert(name.to_string()) {
            return Err(named(format!("`{name}` appears twice")));
        }
        ex.set_f32(name, dtype, shape, data)
    })?;
    let mut missing: Vec<&String> = want.keys().filter(|n| !seen.contains(n.as_str())).collect();
    missing.sort();
    if let Some(n) = missing.first() {
        return Err(named(format!("no `{n}` ({} tensors of this run's optimizer state are missing)", missing.len())));
    }
    Ok(meta)
}
