//! The `fusec` command line: thin wrappers over the library crates.

#[macro_use]
mod out;
mod cmd_dump;
mod cmd_export;
mod cmd_export_weights;
mod cmd_import;
mod cmd_nccl_check;
mod cmd_plot;
mod cmd_prepare;
mod cmd_run;
mod cmd_sample;
mod report;
mod sample;
mod token_stream;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// fusec: a JIT fusion compiler for transformer training.
#[derive(Parser)]
#[command(name = "fusec", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a graph after a pass, as canonical `.graph` text.
    Dump(cmd_dump::DumpArgs),
    /// Write a model's graph (forward + loss) as a `.graph` file.
    Export(cmd_export::ExportArgs),
    /// Evaluate or train a graph on a target.
    Run(Box<cmd_run::RunArgs>),
    /// Generate text from a checkpoint with the compiled key/value-cache decoder, streamed.
    Sample(cmd_sample::SampleArgs),
    /// Tokenize text with GPT-2 BPE into llm.c token files (train and val).
    Prepare(cmd_prepare::PrepareArgs),
    /// Draw the loss curves of `run --log-json` logs as SVG or PNG.
    Plot(cmd_plot::PlotArgs),
    /// Convert Hugging Face GPT-2 weights (safetensors + config.json) into an llm.c checkpoint.
    Import(cmd_import::ImportArgs),
    /// Write an llm.c checkpoint as Hugging Face GPT-2 weights (safetensors + config.json).
    ExportWeights(cmd_export_weights::ExportWeightsArgs),
    /// Check NCCL across this host's GPUs: an all-reduce, every GPU one rank, verified and timed.
    NcclCheck(cmd_nccl_check::NcclCheckArgs),
    /// Internal: compile CUDA modules sent on stdin with NVRTC (a cold build's worker process).
    #[command(hide = true)]
    NvrtcWorker,
}

/// An error for the user: printed as `error: ...`, exit code 2.
pub type CliResult = Result<(), String>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Ok(exe) = std::env::current_exe() {
        fusec_codegen_cuda::nvrtc::workers::enable(exe);
    }
    let result = match cli.command {
        Command::Dump(a) => cmd_dump::dump(a),
        Command::Export(a) => cmd_export::export(a),
        Command::Run(a) => cmd_run::run(*a),
        Command::Sample(a) => cmd_sample::sample(a),
        Command::Prepare(a) => cmd_prepare::prepare(a),
        Command::Plot(a) => cmd_plot::plot(a),
        Command::Import(a) => cmd_import::import(a),
        Command::ExportWeights(a) => cmd_export_weights::export_weights(a),
        Command::NcclCheck(a) => cmd_nccl_check::nccl_check(a),
        Command::NvrtcWorker => fusec_codegen_cuda::nvrtc::workers::serve(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of a pipe stopped reading (`| head`): not an error of the run.
        Err(e) if e == out::STDOUT_CLOSED => ExitCode::SUCCESS,
        Err(e) => {
            out::set_quiet(false);
            errln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Reads and parses a `.graph` file (parse errors come back as `file:line:col: ...`).
pub fn load_graph(path: &std::path::Path) -> Result<fusec_ir::Graph, String> {
    let src = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    fusec_ir::text::parse(&src, &path.display().to_string()).map_err(|e| e.to_string())
}
