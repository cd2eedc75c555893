//! `fusec export-weights model.bin -o model.safetensors`: an llm.c checkpoint (or a `--save`
//! folder's) as a Hugging Face GPT-2, with `config.json` beside it. The conversion is
//! `fusec_runtime::hf_gpt2`.

use clap::Args;
use std::path::PathBuf;

use fusec_runtime::hf_gpt2::export_hf;

use crate::CliResult;

/// Arguments of `fusec export-weights`.
#[derive(Args)]
pub struct ExportWeightsArgs {
    /// The llm.c checkpoint: a `model.bin`, or a folder written by `fusec run --save DIR`.
    checkpoint: PathBuf,
    /// The safetensors file to write (F32, Hugging Face GPT-2 keys and layouts); `config.json`
    /// is written (replaced) beside it.
    #[arg(short, long)]
    output: PathBuf,
}

/// Runs `fusec export-weights`.
pub fn export_weights(a: ExportWeightsArgs) -> CliResult {
    let ckpt = if a.checkpoint.is_dir() { a.checkpoint.join("model.bin") } else { a.checkpoint.clone() };
    let config = export_hf(&ckpt, &a.output)?;
    outln!("wrote {} and {}", a.output.display(), config.display())
}
