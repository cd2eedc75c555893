//! The programs of a run: the forward graph compiled once per program a training run needs,
//! through one pipeline mode, for one binding of `B` and `T`. The CLI, the benchmarks and the
//! tests all build them here ([`RunPrograms::compile`]); every target takes a [`RunPrograms`].

use std::collections::HashMap;

use fusec_ir::{Bindings, Graph};
use fusec_models::{decoder_graph, logits_graph, Gpt2Config};
use fusec_passes::pipeline::{compile, Mode, PassRun, PipelineOptions};

/// One program of a training run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Program {
    /// Forward + loss (validation).
    Eval,
    /// Forward + backward, accumulating into the `grad.P` tensors (a micro-step).
    Grad,
    /// Forward + backward + AdamW (the last micro-step of a step).
    Step,
    /// Forward to the logits (sampling).
    Logits,
    /// The decoder's prefill: the prompt's positions into the key/value cache, the last one's
    /// logits ([`fusec_models::decoder_graph`] for the prompt's length).
    Prefill,
    /// One decoding step: one new position into the key/value cache, its logits.
    Decode,
}

impl Program {
    /// What the pass pipeline builds for this program.
    pub fn mode(self) -> Mode {
        match self {
            Program::Eval | Program::Logits | Program::Prefill | Program::Decode => Mode::Forward,
            Program::Grad => Mode::Grad,
            Program::Step => Mode::Step,
        }
    }
}

/// The scheduled programs of a run, with the pipeline options and binding they were built for.
pub struct RunPrograms {
    /// Each program's graph after `schedule`.
    pub graphs: HashMap<Program, Graph>,
    /// The binding of `B` and `T`.
    pub bind: Bindings,
    /// The pipeline options (precision, AdamW constants, fused or not).
    pub opts: PipelineOptions,
    /// Every program's passes with their start and compile times, in the order they ran.
    pub pass_runs: Vec<(Program, PassRun)>,
}

impl RunPrograms {
    /// Compiles Eval, Grad and Step (and Logits when `logits`, for sampling) from a forward +
    /// loss graph through `schedule` (targets plan memory themselves). With
    /// `opts.adamw.fresh_grads` the step has no gradient accumulators and there is no Grad
    /// program (no micro-steps to accumulate).
    pub fn compile(fwd: &Graph, opts: &PipelineOptions, bind: &Bindings, logits: bool) -> Result<RunPrograms, String> {
        let mut graphs = HashMap::new();
        let mut pass_runs = vec![];
        let grad = (!opts.adamw.fresh_grads).then_some(Program::Grad);
        for p in [Some(Program::Eval), grad, Some(Program::Step)].into_iter().flatten() {
            let c = compile(fwd, "schedule", p.mode(), opts, bind)?;
            pass_runs.extend(c.runs.into_iter().map(|r| (p, r)));
            graphs.insert(p, c.graph);
        }
        if logits {
            let c = compile(&logits_graph(fwd)?, "schedule", Mode::Forward, opts, bind)?;
            pass_runs.extend(c.runs.into_iter().map(|r| (Program::Logits, r)));
            graphs.insert(Program::Logits, c.graph);
        }
        Ok(RunPrograms { graphs, bind: bind.clone(), opts: opts.clone(), pass_runs })
    }

    /// Compiles the decoder of a GPT-2 of config `cfg` (no symbolic dims): `Decode` (one new
    /// position) and, for a prompt of `prompt_len` > 1 tokens, `Prefill` for that length. Both
    /// read and write the same key/value caches (their layout is shared by name).
    pub fn decoder(cfg: &Gpt2Config, prompt_len: usize, opts: &PipelineOptions) -> Result<RunPrograms, String> {
        let bind = Bindings::default();
        let mut graphs = HashMap::new();
        let mut pass_runs = vec![];
        let prefill = (prompt_len > 1).then_some((Program::Prefill, prompt_len));
        for (p, new) in [prefill, Some((Program::Decode, 1))].into_iter().flatten() {
            let c = compile(&decoder_graph(cfg, new)?, "schedule", p.mode(), opts, &bind)?;
            pass_runs.extend(c.runs.into_iter().map(|r| (p, r)));
            graphs.insert(p, c.graph);
        }
        Ok(RunPrograms { graphs, bind, opts: opts.clone(), pass_runs })
    }

    /// `B` and `T` bound to `batch` and `seq`.
    pub fn bindings(batch: usize, seq: usize) -> Bindings {
        let mut bind = Bindings::default();
        bind.set("B", batch as u64).set("T", seq as u64);
        bind
    }

    /// The programs in a fixed order (Eval, Grad, Step, Logits, Prefill, Decode).
    pub fn in_order(&self) -> Vec<(Program, &Graph)> {
        let mut v: Vec<(Program, &Graph)> = self.graphs.iter().map(|(p, g)| (*p, g)).collect();
        v.sort_by_key(|(p, _)| *p);
        v
    }

    /// The Step program's graph.
    pub fn step(&self) -> Result<&Graph, String> {
        self.graphs.get(&Program::Step).ok_or_else(|| "the programs of a run must include Step".to_string())
    }
}
