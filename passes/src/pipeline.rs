//! The pass pipeline and its names, as accepted by `fusec dump --pass`.

use fusec_ir::Graph;

use crate::optimizer::AdamWConfig;

/// Pass names in pipeline order.
pub const PASSES: &[&str] = &["parse", "autodiff", "optimizer"];

/// Options that change what the passes build.
#[derive(Clone, Debug, Default)]
pub struct PipelineOptions {
    /// AdamW constants (lr and bias corrections are runtime inputs).
    pub adamw: AdamWConfig,
}

/// One pass's result and how long it took.
pub struct PassRun {
    /// The pass name.
    pub name: &'static str,
    /// Wall time.
    pub time: std::time::Duration,
}

/// Runs the pipeline on a parsed forward graph up to and including `last`, returning the graph
/// and per-pass timings. Every intermediate graph is verified in debug builds.
pub fn run_until(g: &Graph, last: &str, opts: &PipelineOptions) -> Result<(Graph, Vec<PassRun>), String> {
    let stop = PASSES.iter().position(|p| *p == last).ok_or_else(|| {
        format!("unknown pass `{last}`; passes: {}", PASSES.join(", "))
    })?;
    let mut g = g.clone();
    let mut runs = vec![];
    for &name in &PASSES[1..=stop] {
        let t0 = std::time::Instant::now();
        g = match name {
            "autodiff" => crate::autodiff::autodiff(&g)?,
            "optimizer" => crate::optimizer::optimizer(&g, &opts.adamw)?,
            _ => unreachable!("every name in PASSES has a case"),
        };
        runs.push(PassRun { name, time: t0.elapsed() });
        if cfg!(debug_assertions) {
            fusec_ir::verify::verify(&g).map_err(|e| format!("after pass `{name}`: {e}"))?;
        }
    }
    Ok((g, runs))
}
