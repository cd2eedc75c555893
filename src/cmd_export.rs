//! `fusec export gpt2`: writes a GPT-2 graph from a preset, explicit sizes, or a checkpoint.

use clap::{Args, ValueEnum};
use fusec_models::{build_gpt2, presets, Gpt2Config};
use std::path::PathBuf;

use crate::CliResult;

/// Models `fusec export` can build.
#[derive(Clone, Copy, ValueEnum)]
pub enum Model {
    /// GPT-2 (forward + mean cross-entropy loss, tied LM head).
    Gpt2,
}

/// Arguments of `fusec export`.
#[derive(Args)]
pub struct ExportArgs {
    /// Which model.
    model: Model,
    /// A named configuration: tiny, small, d12 (124M), d24, d36, d48.
    #[arg(long, conflicts_with = "like")]
    preset: Option<String>,
    /// Take the sizes from an llm.c checkpoint's header.
    #[arg(long)]
    like: Option<PathBuf>,
    /// Number of blocks (overrides the preset).
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads (overrides the preset).
    #[arg(long)]
    heads: Option<usize>,
    /// Channels (overrides the preset).
    #[arg(long)]
    channels: Option<usize>,
    /// Vocabulary size V (overrides the preset).
    #[arg(long)]
    vocab: Option<usize>,
    /// Padded vocabulary Vp (default: V rounded up to a multiple of 128 when not from a preset).
    #[arg(long)]
    padded_vocab: Option<usize>,
    /// Maximum sequence length (overrides the preset).
    #[arg(long)]
    max_seq: Option<usize>,
    /// Graph name in the header (default: gpt2_<preset> or gpt2).
    #[arg(long)]
    name: Option<String>,
    /// Output file (default: standard output).
    #[arg(short, long)]
    output: Option<PathBuf>,
}

/// Runs `fusec export`.
pub fn export(a: ExportArgs) -> CliResult {
    let Model::Gpt2 = a.model;
    let mut cfg = base_config(&a)?;
    cfg.layers = a.layers.unwrap_or(cfg.layers);
    cfg.heads = a.heads.unwrap_or(cfg.heads);
    cfg.channels = a.channels.unwrap_or(cfg.channels);
    cfg.max_seq = a.max_seq.unwrap_or(cfg.max_seq);
    if let Some(v) = a.vocab {
        cfg.vocab = v;
        cfg.padded_vocab = v.div_ceil(128) * 128;
    }
    cfg.padded_vocab = a.padded_vocab.unwrap_or(cfg.padded_vocab);
    cfg.validate()?;
    let name = a.name.clone().unwrap_or_else(|| match &a.preset {
        Some(p) => format!("gpt2_{p}"),
        None => "gpt2".to_string(),
    });
    let text = fusec_ir::text::print(&build_gpt2(&cfg, &name));
    match &a.output {
        Some(path) => std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display())),
        None => out!("{text}"),
    }
}

fn base_config(a: &ExportArgs) -> Result<Gpt2Config, String> {
    if let Some(p) = &a.preset {
        return Gpt2Config::preset(p).ok_or_else(|| {
            let names: Vec<_> = presets().iter().map(|(n, _, _)| *n).collect();
            format!("unknown preset `{p}`; presets: {}", names.join(", "))
        });
    }
    if let Some(path) = &a.like {
        return fusec_runtime::checkpoint::Checkpoint::read_header(path).map_err(|e| e.to_string());
    }
    let required =
        [("--layers", a.layers), ("--heads", a.heads), ("--channels", a.channels), ("--vocab", a.vocab), ("--max-seq", a.max_seq)];
    if let Some((flag, _)) = required.iter().find(|(_, v)| v.is_none()) {
        return Err(format!("without --preset or --like, {flag} is required"));
    }
    Ok(Gpt2Config { layers: 0, heads: 0, channels: 0, vocab: 0, padded_vocab: 0, max_seq: 0 })
}
