//! Helpers shared by the cross-crate tests: locating ../shared, building executors.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use fusec_ir::interp::Precision;
use fusec_ir::{Bindings, Graph};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_runtime::executor::{Program, RefExecutor};

/// The llm.c reference folder, or `None` (with a printed reason) when ../shared is absent.
pub fn llmc_odd() -> Option<PathBuf> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/refs/llmc-odd"));
    if p.join("reference.json").exists() {
        Some(p)
    } else {
        eprintln!("SKIPPED: {} is absent (the llm.c reference lives outside the repository)", p.display());
        None
    }
}

/// `reference.json` of the llm.c reference.
pub fn reference_json(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

/// The Eval, Grad and Step programs of a forward graph, through the whole pipeline up to
/// `schedule` with `opts` (`no_fusion` gives the unfused programs).
pub fn programs(fwd: &Graph, opts: &PipelineOptions) -> HashMap<Program, Graph> {
    let bind = fusec_passes::schedule::default_bindings(fwd);
    let c = |m| compile(fwd, "schedule", m, opts, &bind).unwrap().graph;
    [(Program::Eval, c(Mode::Forward)), (Program::Grad, c(Mode::Grad)), (Program::Step, c(Mode::Step))].into()
}

/// Pipeline options for the unfused reference programs.
pub fn unfused() -> PipelineOptions {
    PipelineOptions { no_fusion: true, ..PipelineOptions::default() }
}

/// A reference executor for B x T.
pub fn ref_executor(fwd: &Graph, opts: &PipelineOptions, b: usize, t: usize, prec: Precision) -> RefExecutor {
    let mut bind = Bindings::default();
    bind.set("B", b as u64).set("T", t as u64);
    RefExecutor::new(programs(fwd, opts), bind, prec)
}

/// Reads a headerless little-endian f32 file.
pub fn read_f32s(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// A CPU executor for B x T with the fully fused programs, and its build report.
pub fn cpu_executor(fwd: &Graph, b: usize, t: usize, threads: usize) -> (fusec_runtime::cpu::CpuExecutor, fusec_runtime::cpu::CpuBuild) {
    let mut bind = Bindings::default();
    bind.set("B", b as u64).set("T", t as u64);
    let opts = PipelineOptions::default();
    let c = |m| compile(fwd, "schedule", m, &opts, &bind).unwrap().graph;
    let graphs = [(Program::Eval, c(Mode::Forward)), (Program::Grad, c(Mode::Grad)), (Program::Step, c(Mode::Step))].into();
    fusec_runtime::cpu::CpuExecutor::new(&graphs, &bind, threads, false).unwrap()
}
