//! `fusec sample CKPT --prompt TEXT --tokens N`: text from an llm.c checkpoint through the
//! compiled decoder with a key/value cache (the prompt in one prefill, then one token at a
//! time), streamed as it is made, then the prefill time and the decoding rate.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use fusec_models::Gpt2Config;
use fusec_runtime::checkpoint::{read_params, Checkpoint};
use fusec_runtime::cuda::CudaOptions;
use fusec_runtime::sample::Draw;
use fusec_runtime::tokenizer::{Gpt2Tokenizer, GPT2_VOCAB};

use crate::cmd_run::Target;
use crate::sample::{build_decoder, default_prompt, describe, stream};
use crate::CliResult;

/// Arguments of `fusec sample`.
#[derive(Args)]
pub struct SampleArgs {
    /// The llm.c checkpoint (`model.bin`, e.g. from `fusec run --save` or `fusec import hf`),
    /// or a `--save` folder holding one.
    checkpoint: PathBuf,
    /// The text to continue (GPT-2 BPE; GPT-2 vocabularies only). Without it generation starts
    /// from <|endoftext|> (GPT-2) or token 0 (other vocabularies).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate: 1 to the model's maximum sequence length minus the prompt's tokens.
    #[arg(long, default_value_t = 64, value_name = "N")]
    tokens: usize,
    /// Sampling temperature (0: greedy; finite, at most 100).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_name = "T")]
    temperature: f32,
    /// Draw only among the K most likely tokens (1 to the vocabulary size).
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Seed of the draws (the same seed, model and flags give the same text).
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Where the decoder runs.
    #[arg(long, value_enum, default_value = "cpu")]
    target: Target,
    /// CPU threads (1..=1024; default: all cores).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

/// Runs `fusec sample`.
pub fn sample(a: SampleArgs) -> CliResult {
    if !(a.temperature.is_finite() && (0.0..=100.0).contains(&a.temperature)) {
        return Err(format!("--temperature {} is out of range: it must be finite, at least 0 and at most 100", a.temperature));
    }
    if let Some(n) = a.threads.filter(|n| !(1..=1024).contains(n)) {
        return Err(format!("--threads {n} is out of range: it must be in 1..=1024"));
    }
    if a.target == Target::Cuda {
        fusec_runtime::cuda::start_driver();
        fusec_codegen_cuda::nvrtc::workers::prestart();
    }
    let path = checkpoint_file(&a.checkpoint)?;
    let cfg = Checkpoint::read_header(&path).map_err(|e| e.to_string())?;
    if let Some(k) = a.top_k.filter(|&k| k == 0 || k > cfg.vocab) {
        return Err(format!("--top-k {k} is out of range: it must be in 1..={} (the model's vocabulary)", cfg.vocab));
    }
    let prompt = prompt_tokens(&a, &cfg)?;
    let room = cfg.max_seq - prompt.len();
    if a.tokens == 0 || a.tokens > room {
        return Err(format!(
            "--tokens {} is out of range: it must be in 1..={room} (the model's maximum sequence length {} minus the prompt's {} tokens)",
            a.tokens,
            cfg.max_seq,
            prompt.len()
        ));
    }
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().map_err(|e| format!("thread pool: {e}"))?;

    let (mut d, compile) = build_decoder(&cfg, prompt.len(), a.target, threads, &CudaOptions::default())?;
    let t_load = Instant::now();
    let (found, _) = read_params(&path, &mut |name, shape, data| d.set_param(name, shape, data))?;
    if found != cfg {
        return Err(format!("{}: the checkpoint changed while it was read", path.display()));
    }
    let load = t_load.elapsed();
    if let Some(text) = &a.prompt {
        out!("{text}")?;
    }
    let draw = Draw { temperature: a.temperature, top_k: a.top_k };
    let g = stream(&mut d, &prompt, a.tokens, &draw, a.seed)?;
    out!("\n")?;
    errln!(
        "{} ({} target{}; compile {:.0} ms, weights {:.0} ms)",
        describe(prompt.len(), &g),
        target_name(a.target),
        if a.target == Target::Cpu { format!(", {threads} threads") } else { String::new() },
        compile.as_secs_f64() * 1e3,
        load.as_secs_f64() * 1e3
    );
    Ok(())
}

fn target_name(t: Target) -> &'static str {
    match t {
        Target::Ref => "ref",
        Target::Cpu => "cpu",
        Target::Cuda => "cuda",
    }
}

/// The checkpoint file: `path` itself, or `path/model.bin` for a folder.
fn checkpoint_file(path: &Path) -> Result<PathBuf, String> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let file = path.join("model.bin");
    if file.is_file() {
        Ok(file)
    } else {
        Err(format!("{}: a folder without model.bin (give an llm.c checkpoint or a `fusec run --save` folder)", path.display()))
    }
}

/// The prompt's tokens: `--prompt` encoded with GPT-2's BPE, or the default start token.
fn prompt_tokens(a: &SampleArgs, cfg: &Gpt2Config) -> Result<Vec<u16>, String> {
    let Some(text) = &a.prompt else {
        return Ok(default_prompt(cfg));
    };
    if cfg.vocab != GPT2_VOCAB {
        return Err(format!(
            "--prompt is text, which needs a GPT-2 vocabulary ({GPT2_VOCAB} tokens); this checkpoint's vocabulary has {} tokens: leave --prompt out to start from token 0",
            cfg.vocab
        ));
    }
    let tokens = Gpt2Tokenizer::new()?.encode(text);
    if tokens.is_empty() {
        return Err("--prompt is empty: give some text, or leave --prompt out to start from <|endoftext|>".into());
    }
    if tokens.len() >= cfg.max_seq {
        return Err(format!(
            "--prompt is {} tokens: it must be in 1..={} (the model's maximum sequence length {}, less one token to generate)",
            tokens.len(),
            cfg.max_seq - 1,
            cfg.max_seq
        ));
    }
    Ok(tokens)
}
