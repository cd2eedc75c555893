//! `fusec dump FILE --pass NAME`: the graph after a pass, as text.

use clap::Args;
use std::path::PathBuf;

use fusec_passes::optimizer::AdamWConfig;
use fusec_passes::pipeline::{run_until, PipelineOptions, PASSES};

use crate::{load_graph, CliResult};

/// Arguments of `fusec dump`.
#[derive(Args)]
pub struct DumpArgs {
    /// The `.graph` file.
    file: PathBuf,
    /// Print the graph after this pass (`parse` prints the canonical form of the input).
    #[arg(long, default_value = "parse", value_parser = clap::builder::PossibleValuesParser::new(PASSES))]
    pass: String,
    /// Include global-norm gradient clipping in the optimizer.
    #[arg(long)]
    grad_clip: bool,
    /// Print per-pass compile time on standard error.
    #[arg(long)]
    timings: bool,
}

/// Runs `fusec dump`.
pub fn dump(a: DumpArgs) -> CliResult {
    let t0 = std::time::Instant::now();
    let g = load_graph(&a.file)?;
    let parse_time = t0.elapsed();
    let opts = PipelineOptions { adamw: AdamWConfig { clip: a.grad_clip, ..AdamWConfig::default() } };
    let (g, runs) = run_until(&g, &a.pass, &opts)?;
    print!("{}", fusec_ir::text::print(&g));
    if a.timings {
        eprintln!("{:<16} {:>10.3} ms", "parse", parse_time.as_secs_f64() * 1e3);
        for r in &runs {
            eprintln!("{:<16} {:>10.3} ms", r.name, r.time.as_secs_f64() * 1e3);
        }
        eprintln!("{} nodes", g.nodes.len());
    }
    Ok(())
}
