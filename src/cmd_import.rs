//! `fusec import hf MODEL.safetensors -o model.bin`: a Hugging Face GPT-2 (the safetensors file
//! and the `config.json` beside it) into an llm.c checkpoint that `fusec run --init` and
//! `fusec export gpt2 --like` read. The conversion is `fusec_runtime::hf_gpt2`.

use clap::{Args, ValueEnum};
use std::path::PathBuf;

use fusec_runtime::hf_gpt2::import_hf;

use crate::CliResult;

/// Weight formats `fusec import` reads.
#[derive(Clone, Copy, ValueEnum)]
pub enum Format {
    /// A Hugging Face GPT-2 (gpt2, gpt2-medium, gpt2-large, gpt2-xl or the same layout):
    /// `model.safetensors` in F32, F16 or BF16, sizes from `config.json`.
    Hf,
}

/// Arguments of `fusec import`.
#[derive(Args)]
pub struct ImportArgs {
    /// The format of the weights.
    format: Format,
    /// The weights (`model.safetensors`).
    file: PathBuf,
    /// The model's `config.json` (default: `config.json` beside the weights).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The llm.c checkpoint to write (fp32, vocabulary padded to a multiple of 128).
    #[arg(short, long)]
    output: PathBuf,
}

/// Runs `fusec import`.
pub fn import(a: ImportArgs) -> CliResult {
    let Format::Hf = a.format;
    let config = a.config.clone().unwrap_or_else(|| a.file.with_file_name("config.json"));
    let got = import_hf(&a.file, &config, &a.output)?;
    let c = got.config;
    let dtypes: Vec<&str> = got.dtypes.iter().map(String::as_str).collect();
    outln!(
        "imported {} ({}, {} parameters; {} layers, {} heads, {} channels, vocabulary {} padded to {}, {} positions) -> {}",
        a.file.display(),
        dtypes.join("+"),
        c.num_params(),
        c.layers,
        c.heads,
        c.channels,
        c.vocab,
        c.padded_vocab,
        c.max_seq,
        a.output.display()
    )?;
    if got.ignored > 0 {
        outln!("ignored {} tensor(s) the model does not need (attention mask buffers, the tied lm_head)", got.ignored)?;
    }
    let out = a.output.display();
    outln!("next: fusec export gpt2 --like {out} -o model.graph && fusec run model.graph --init {out} --data ...")
}
