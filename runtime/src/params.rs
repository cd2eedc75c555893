//! Binding checkpoint tensors to graph parameters, by name, and loading parameters into an
//! executor one tensor at a time (no host copy of the whole model, no f64 copy at all on the
//! CPU and CUDA targets).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fusec_ir::interp::Tensor;
use fusec_ir::{Bindings, DType, Graph};
use fusec_models::Gpt2Config;

use crate::checkpoint::{graph_param_names, random_params, read_params, Checkpoint};
use crate::executor::Executor;

/// One host tensor per graph parameter, taken from the checkpoint by name; errors name the
/// parameter whose tensor is missing or has another shape, and any checkpoint tensor the graph
/// does not use.
pub fn params_from_checkpoint(g: &Graph, ckpt: &Checkpoint) -> Result<HashMap<String, Tensor>, String> {
    check_params(g, &ckpt.config)?;
    Ok(ckpt.named_tensors().into_iter().map(|(name, shape, data)| (name, Tensor::from_f32(shape, data))).collect())
}

/// Checks that the graph's parameters are exactly the checkpoint tensors of config `cfg`, by
/// name and shape; errors name the parameter whose tensor is missing or has another shape, and
/// any checkpoint tensor the graph does not use.
pub fn check_params(g: &Graph, cfg: &Gpt2Config) -> Result<(), String> {
    let named = graph_param_names(cfg);
    let by_name: HashMap<&str, &Vec<usize>> = named.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let mut used = HashSet::new();
    for (name, v) in g.params() {
        let want = g.ty(v).shape.eval(&Bindings::default()).map_err(|e| format!("parameter `{name}`: {e}"))?;
        let shape = by_name.get(name).ok_or_else(|| format!("the graph's parameter `{name}` is not in the checkpoint (config {cfg:?})"))?;
        if **shape != want {
            return Err(format!(
                "checkpoint tensor `{name}` has shape {shape:?} but the graph wants {want:?}: the checkpoint's config {cfg:?} does not fit the graph"
            ));
        }
        used.insert(name);
    }
    if let Some((n, _)) = named.iter().find(|(n, _)| !used.contains(n.as_str())) {
        return Err(format!("checkpoint tensor `{n}` has no parameter of that name in graph `{}`", g.name));
    }
    Ok(())
}

/// Where the initial parameters come from.
#[derive(Clone, Debug)]
pub enum ParamSource {
    /// GPT-2 random initialization ([`random_params`]) with this seed.
    Random(u64),
    /// An llm.c checkpoint file, read tensor by tensor ([`read_params`]).
    File(PathBuf),
}

/// Bytes of parameters a producer may have ready before the executor takes them: all of GPT-2
/// 124M's (drawn while compiling), 1 GiB of larger models' (the host-memory allowance).
const AHEAD_BYTES: usize = 1 << 30;

/// One parameter as produced: name, shape, values.
type Produced = (String, Vec<usize>, Vec<f32>);

/// Bytes produced and not yet taken (and whether the taker is gone), and its signal.
#[derive(Default)]
struct Budget {
    waiting: Mutex<(usize, bool)>,
    taken: Condvar,
}

impl Budget {
    /// Waits until `bytes` more fit (or nothing waits: a tensor larger than the budget goes
    /// alone; or the taker is gone), then counts them.
    fn reserve(&self, bytes: usize) {
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        while !w.1 && w.0 > 0 && w.0 + bytes > AHEAD_BYTES {
            w = self.taken.wait(w).unwrap_or_else(|e| e.into_inner());
        }
        w.0 += bytes;
    }

    fn release(&self, bytes: usize, gone: bool) {
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        w.0 = w.0.saturating_sub(bytes);
        w.1 |= gone;
        self.taken.notify_one();
    }
}

/// Frees a producer waiting for room when the [`Prefetched`] holding it is dropped (its sends
/// then fail and it stops).
struct Taker(Arc<Budget>);

impl Drop for Taker {
    fn drop(&mut self) {
        self.0.release(0, true);
    }
}

/// Parameters produced (drawn or read) on a background thread from the moment [`prefetch`]
/// returns, in checkpoint order: producing them overlaps compiling, and each tensor's upload
/// overlaps producing the next (GPT-2 1.5B: drawing 1.56 B normals takes seconds). Buffers go
/// back to the producer once uploaded, so no tensor is copied on the host and memory once
/// touched is reused.
pub struct Prefetched {
    cfg: Gpt2Config,
    rx: Receiver<Produced>,
    back: Sender<Vec<f32>>,
    taker: Taker,
    producer: JoinHandle<Result<(Option<u32>, Duration), String>>,
}

/// Where loading the parameters spent its time (wall times of the two threads).
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadTimes {
    /// Bytes of f32 parameters loaded.
    pub bytes: u64,
    /// The producer drawing or reading (its hand-offs and waits for room excluded).
    pub produce: Duration,
    /// The taker setting parameters in the executor (uploads, bf16 copies, zeroed state).
    pub set: Duration,
    /// The taker waiting for the producer.
    pub wait: Duration,
}

impl LoadTimes {
    /// One line for a run's summary.
    pub fn row(&self) -> String {
        format!(
            "{:.1} MiB: produced (drawn or read) in {:.2} s; set in the executor in {:.2} s, waiting {:.2} s for the producer",
            self.bytes as f64 / (1u64 << 20) as f64,
            self.produce.as_secs_f64(),
            self.set.as_secs_f64(),
            self.wait.as_secs_f64()
        )
    }
}

/// Starts producing the parameters of a GPT-2 of config `cfg` from `src`.
pub fn prefetch(cfg: Gpt2Config, src: ParamSource) -> Prefetched {
    let (tx, rx) = channel::<Produced>();
    let (back, returned) = channel::<Vec<f32>>();
    let budget = Arc::new(Budget::default());
    let gate = budget.clone();
    let producer = std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut handing = Duration::ZERO;
        // A closed channel (the run stopped) ends the producer quietly.
        let mut sink = |name: &str, shape: &[usize], data: &mut Vec<f32>| {
            let t = Instant::now();
            gate.reserve(data.len() * 4);
            // The longest buffer back from the taker replaces the one sent (none: a new one).
            let spare = returned.try_iter().max_by_key(|v| v.len()).unwrap_or_default();
            let sent = tx.send((name.to_string(), shape.to_vec(), std::mem::replace(data, spare)));
            handing += t.elapsed();
            sent.map_err(|_| "stopped".to_string())
        };
        let crc = match &src {
            ParamSource::Random(seed) => random_params(&cfg, *seed, &mut sink).map(|_| None),
            ParamSource::File(path) => {
                let (found, crc) = read_params(path, &mut sink)?;
                if found != cfg {
                    return Err(format!("{}: the checkpoint's config {found} is not the graph's {cfg}", path.display()));
                }
                Ok(Some(crc))
            }
        }?;
        Ok((crc, t0.elapsed().saturating_sub(handing)))
    });
    Prefetched { cfg, rx, back, taker: Taker(budget), producer }
}

impl Prefetched {
    /// Sets every parameter of `step_graph` in the executor as it arrives ([`set_param`]).
    /// Returns the CRC-32 of the checkpoint file read, if any, and where the time went.
    pub fn load(self, ex: &mut dyn Executor, step_graph: &Graph) -> Result<(Option<u32>, LoadTimes), String> {
        check_params(step_graph, &self.cfg)?;
        let inputs = input_names(step_graph);
        let mut times = LoadTimes::default();
        loop {
            let t = Instant::now();
            let Ok((name, shape, data)) = self.rx.recv() else { break };
            times.wait += t.elapsed();
            let t = Instant::now();
            set_param(ex, &inputs, &name, &shape, &data)?;
            times.set += t.elapsed();
            times.bytes += data.len() as u64 * 4;
            self.taker.0.release(data.len() * 4, false);
            // A producer already done no longer takes buffers back.
            let _ = self.back.send(data);
        }
        let (crc, produce) = self.producer.join().map_err(|_| "the parameter producer panicked".to_string())??;
        times.produce = produce;
        Ok((crc, times))
    }
}

/// Loads every parameter of `step_graph` (a GPT-2 of config `cfg`) from `src` into the
/// executor, one tensor at a time, with [`set_param`]. Returns the CRC-32 of the checkpoint file
/// read, if any.
pub fn load_params(ex: &mut dyn Executor, step_graph: &Graph, cfg: &Gpt2Config, src: ParamSource) -> Result<Option<u32>, String> {
    Ok(prefetch(*cfg, src).load(ex, step_graph)?.0)
}

/// The names of a graph's inputs.
pub fn input_names(g: &Graph) -> HashSet<String> {
    g.inputs().into_iter().map(|(n, _)| n.to_string()).collect()
}

/// Sets parameter `name` (and its bf16 copy, where the step reads the copy that AdamW writes)
/// and zeroes its optimizer state and gradient accumulator. `inputs` are the step program's
/// input names. The only way parameters are set for training: a copy left stale would train on
/// other weights.
pub fn set_param(ex: &mut dyn Executor, inputs: &HashSet<String>, name: &str, shape: &[usize], data: &[f32]) -> Result<(), String> {
    ex.set_f32(name, DType::F32, shape, data)?;
    let copy = format!("{}{name}", fusec_passes::amp::COPY_PREFIX);
    if inputs.contains(&copy) {
        ex.set_copy(name, &copy, DType::BF16, shape, data)?;
    }
    for prefix in ["m.", "v.", "grad."] {
        let state = format!("{prefix}{name}");
        // A step without accumulation has no `grad.P` (the gradients are its transients), and
        // one with sharded optimizer state has `m.P` and `v.P` only for the parameters this
        // rank owns.
        if inputs.contains(&state) {
            ex.set_zeros(&state, DType::F32, shape.to_vec())?;
        }
    }
    Ok(())
}

/// Writes parameter tensors back into a checkpoint of the given config, by name.
pub fn checkpoint_from_params(cfg: &fusec_models::Gpt2Config, params: &HashMap<String, Tensor>) -> Result<Checkpoint, String> {
    Checkpoint::from_named(*cfg, |name| params.get(name).map(|t| t.to_f32()))
}
