//! The pass pipeline and its names, as accepted by `fusec dump --pass`.
//!
//! ```text
//! parse → canonicalize → fuse-layernorm → autodiff → data-parallel → optimizer → amp → recompute
//!       → fuse-classifier → fuse-epilogue → fuse-grad-accum → fuse-elementwise → schedule
//!       → memplan
//! ```
//!
//! Decision (differs from the original design notes, which ran `fuse-elementwise` before the
//! matmul fusions; see `docs/design.md`):
//! the matmul epilogue passes run first, so that a bias add, GELU or gradient accumulation is
//! claimed by the matmul that produces it (a cuBLASLt epilogue, or a block-wise CPU epilogue)
//! instead of becoming a separate elementwise kernel that re-reads the product from memory.

use std::time::{Duration, Instant};

use fusec_ir::{Bindings, Graph, Op};

use crate::amp::Precision;
use crate::explain::FusionLog;
use crate::memplan::{MemPlan, MemplanOptions};
use crate::optimizer::AdamWConfig;
use crate::recompute::Recompute;

/// Pass names in pipeline order (`fuse` names the last fusion pass).
pub const PASSES: &[&str] = &[
    "parse",
    "canonicalize",
    "fuse-layernorm",
    "autodiff",
    "data-parallel",
    "optimizer",
    "amp",
    "recompute",
    "fuse-classifier",
    "fuse-epilogue",
    "fuse-grad-accum",
    "fuse-elementwise",
    "fuse",
    "schedule",
    "memplan",
];

/// Which program to build from a forward graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Forward + loss only (`autodiff` and `optimizer` are skipped).
    Forward,
    /// Forward + backward, accumulating gradients (`optimizer` is skipped).
    Grad,
    /// A whole training step.
    Step,
}

/// Options that change what the passes build.
#[derive(Clone, Debug, Default)]
pub struct PipelineOptions {
    /// AdamW constants (lr and bias corrections are runtime inputs).
    pub adamw: AdamWConfig,
    /// The mixed-precision policy of `amp`.
    pub precision: Precision,
    /// What the backward recomputes instead of storing (`recompute`).
    pub recompute: Recompute,
    /// Run the fusion passes (`canonicalize`, `fuse-*`); off gives the unfused program.
    pub no_fusion: bool,
    /// Memory planning options.
    pub memplan: MemplanOptions,
    /// Build one rank of a data-parallel run (`data-parallel`: the loss and the gradients are
    /// all-reduced); off skips the pass.
    pub data_parallel: bool,
}

/// One pass's result and how long it took.
pub struct PassRun {
    /// The pass name.
    pub name: &'static str,
    /// When it started (timelines place it: `fusec run --trace`).
    pub start: Instant,
    /// Wall time.
    pub time: Duration,
}

/// What the pipeline produced.
pub struct Compiled {
    /// The graph after the last pass run.
    pub graph: Graph,
    /// Per-pass timings, in order.
    pub runs: Vec<PassRun>,
    /// Refused fusion candidates.
    pub log: FusionLog,
    /// The memory plan, when `memplan` ran.
    pub plan: Option<MemPlan>,
}

/// Runs the pipeline on a parsed forward graph up to and including `last` (a name from
/// [`PASSES`]). `bind` binds the symbolic dims for `memplan`. The input graph is verified first
/// (the passes rely on it), and every intermediate graph in debug builds. Bad input (a graph
/// that does not verify, options out of range, sizes that overflow) is an `Err`, never a panic.
pub fn compile(g: &Graph, last: &str, mode: Mode, opts: &PipelineOptions, bind: &Bindings) -> Result<Compiled, String> {
    let last = if last == "fuse" { "fuse-elementwise" } else { last };
    let stop = PASSES.iter().position(|p| *p == last).ok_or_else(|| format!("unknown pass `{last}`; passes: {}", PASSES.join(", ")))?;
    fusec_ir::verify::verify(g).map_err(|e| format!("the input graph does not verify: {e}"))?;
    let mut out = Compiled { graph: g.clone(), runs: vec![], log: FusionLog::default(), plan: None };
    for &name in &PASSES[1..=stop] {
        let skip = match name {
            "autodiff" => mode == Mode::Forward,
            "recompute" => mode == Mode::Forward || opts.recompute == Recompute::None,
            "data-parallel" => !opts.data_parallel,
            "optimizer" => mode != Mode::Step,
            "fuse" => true,
            "canonicalize" | "fuse-layernorm" | "fuse-classifier" | "fuse-epilogue" | "fuse-grad-accum" | "fuse-elementwise" => {
                opts.no_fusion
            }
            _ => false,
        };
        if skip {
            continue;
        }
        let t0 = Instant::now();
        let (graph, plan) = if name == "data-parallel" {
            // Micro-steps reduce their loss only; the step reduces the gradients it applies.
            (crate::data_parallel::data_parallel(&out.graph, mode == Mode::Step)?, None)
        } else {
            run_pass(name, &out.graph, opts, bind, &mut out.log)?
        };
        out.graph = graph;
        if plan.is_some() {
            out.plan = plan;
        }
        out.runs.push(PassRun { name, start: t0, time: t0.elapsed() });
        if cfg!(debug_assertions) {
            fusec_ir::verify::verify(&out.graph).map_err(|e| format!("after pass `{name}`: {e}"))?;
        }
    }
    Ok(out)
}

/// Runs the one pass `name` (a name from [`PASSES`] other than `parse` and `fuse`) on `g`, with
/// no skipping and no verification: the graph after it, and the plan when the pass is
/// `memplan` (whose graph is `g` unchanged). Fusion refusals go to `log`. [`compile`] runs
/// every pass through this; the filetests (`passes/tests/filetests`) run one.
pub fn run_pass(
    name: &str,
    g: &Graph,
    opts: &PipelineOptions,
    bind: &Bindings,
    log: &mut FusionLog,
) -> Result<(Graph, Option<MemPlan>), String> {
    let graph = match name {
        "canonicalize" => crate::canonicalize::canonicalize(g)?,
        "fuse-layernorm" => crate::fuse_layernorm::fuse_layernorm(g, log)?,
        "autodiff" => crate::autodiff::autodiff(g)?,
        "data-parallel" => crate::data_parallel::data_parallel(g, true)?,
        "optimizer" => crate::optimizer::optimizer(g, &opts.adamw)?,
        "amp" => crate::amp::amp(g, opts.precision)?,
        "recompute" => crate::recompute::recompute(g, opts.recompute)?,
        "fuse-classifier" => crate::fuse_classifier::fuse_classifier(g, log)?,
        "fuse-epilogue" => crate::fuse_epilogue::fuse_epilogue(g, log)?,
        "fuse-grad-accum" => crate::fuse_grad_accum::fuse_grad_accum(g, log)?,
        "fuse-elementwise" => crate::fuse_elementwise::fuse_elementwise(g, log)?,
        "schedule" => crate::schedule::schedule_with(g, bind)?,
        "memplan" => return Ok((g.clone(), Some(crate::memplan::memplan(g, bind, &opts.memplan)?))),
        _ => return Err(format!("unknown pass `{name}` (`parse` and `fuse` name no pass of their own)")),
    };
    Ok((graph, None))
}

/// Launch counts of a program: what a backend runs per step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Launches {
    /// Matmuls and gemms.
    pub matmul: usize,
    /// Everything else that runs (kernels, composites, unfused primitives, constant fills).
    pub other: usize,
}

/// Counts launches: every node except parameters, inputs and views (`reshape`).
pub fn launches(g: &Graph) -> Launches {
    let mut l = Launches::default();
    for n in &g.nodes {
        match n.op {
            Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. } => {}
            Op::MatMul { .. } | Op::Gemm(_) => l.matmul += 1,
            _ => l.other += 1,
        }
    }
    l
}
