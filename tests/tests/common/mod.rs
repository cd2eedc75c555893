//! Helpers shared by the cross-crate tests: locating ../shared, building executors.

#![allow(dead_code)]

use std::path::PathBuf;

use fusec_ir::interp::Rounding;
use fusec_ir::Graph;
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::executor::RefExecutor;
use fusec_runtime::programs::RunPrograms;

/// The llm.c reference folder, or `None` (with a printed reason) when ../shared is absent.
pub fn llmc_odd() -> Option<PathBuf> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/refs/llmc-odd"));
    if p.join("reference.json").exists() {
        Some(p)
    } else {
        fusec_ir::testkit::skip("llm.c parity", &format!("{} is absent (the llm.c reference lives outside the repository)", p.display()));
        None
    }
}

/// `reference.json` of the llm.c reference.
pub fn reference_json(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

/// The programs of a run of a forward graph for B x T, through the pipeline with `opts`
/// (`no_fusion` gives the unfused programs).
pub fn programs(fwd: &Graph, opts: &PipelineOptions, b: usize, t: usize) -> RunPrograms {
    RunPrograms::compile(fwd, opts, &RunPrograms::bindings(b, t), false).unwrap()
}

/// Pipeline options for the unfused reference programs.
pub fn unfused() -> PipelineOptions {
    PipelineOptions { no_fusion: true, ..PipelineOptions::default() }
}

/// A reference executor for B x T, and the Step program (for `init_state`).
pub fn ref_executor(fwd: &Graph, opts: &PipelineOptions, b: usize, t: usize, prec: Rounding) -> (RefExecutor, Graph) {
    let run = programs(fwd, opts, b, t);
    (RefExecutor::new(&run, prec), run.step().unwrap().clone())
}

/// Reads a headerless little-endian f32 file.
pub fn read_f32s(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// A CPU executor for B x T with the fully fused programs, and the Step program.
pub fn cpu_executor(fwd: &Graph, b: usize, t: usize, threads: usize) -> (fusec_runtime::cpu::CpuExecutor, Graph) {
    let run = programs(fwd, &PipelineOptions::default(), b, t);
    (fusec_runtime::cpu::CpuExecutor::new(&run, threads, false).unwrap().0, run.step().unwrap().clone())
}

/// A CPU executor for B x T with the programs of `opts` at instruction-set level `isa`, and the
/// Step program.
pub fn cpu_executor_with(
    fwd: &Graph,
    opts: &PipelineOptions,
    b: usize,
    t: usize,
    threads: usize,
    isa: fusec_codegen_cpu::isa::Isa,
) -> (fusec_runtime::cpu::CpuExecutor, Graph) {
    let run = programs(fwd, opts, b, t);
    let ex = fusec_runtime::cpu::CpuExecutor::with_isa(&run, threads, false, isa).unwrap_or_else(|e| panic!("{isa:?}: {e}")).0;
    (ex, run.step().unwrap().clone())
}
