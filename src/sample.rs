//! Sampling through the compiled decoder with a key/value cache, shared by `fusec sample` and
//! `fusec run --sample`: building the decoder for a target, and generating with the tokens
//! streamed to standard output as they are made.

use std::time::{Duration, Instant};

use fusec_ir::interp::Rounding;
use fusec_models::Gpt2Config;
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::graph_param_names;
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::cuda::{CudaExecutor, CudaOptions};
use fusec_runtime::decoder::{Decoder, Generated};
use fusec_runtime::executor::{Executor, RefExecutor};
use fusec_runtime::programs::RunPrograms;
use fusec_runtime::sample::Draw;
use fusec_runtime::tokenizer::{Gpt2Tokenizer, GPT2_VOCAB};

use crate::cmd_run::Target;
use crate::token_stream::TokenStream;

/// Compiles the decoder of `cfg` for a prompt of `prompt_len` tokens and builds its executor on
/// `target` (the interpreter runs the unfused programs); the caches start empty and the
/// parameters are still to be set. Returns it with the compile time.
pub fn build_decoder(
    cfg: &Gpt2Config,
    prompt_len: usize,
    target: Target,
    threads: usize,
    cuda: &CudaOptions,
) -> Result<(Decoder, Duration), String> {
    let t0 = Instant::now();
    let opts = PipelineOptions { no_fusion: target == Target::Ref, ..PipelineOptions::default() };
    let run = RunPrograms::decoder(cfg, prompt_len, &opts)?;
    let ex: Box<dyn Executor> = match target {
        Target::Ref => Box::new(RefExecutor::new(&run, Rounding::F32)),
        Target::Cpu => Box::new(CpuExecutor::new(&run, threads, false)?.0),
        Target::Cuda => Box::new(CudaExecutor::new(&run, cuda)?.0),
    };
    Ok((Decoder::new(ex, cfg, prompt_len)?, t0.elapsed()))
}

/// The prompt a sample starts from without one: `<|endoftext|>` for GPT-2 vocabularies, else
/// token 0.
pub fn default_prompt(cfg: &Gpt2Config) -> Vec<u16> {
    if cfg.vocab == GPT2_VOCAB {
        vec![Gpt2Tokenizer::EOT]
    } else {
        vec![0]
    }
}

/// Generates `n` tokens after `prompt`, printing each one's text (or id) to standard output as
/// soon as it is drawn.
pub fn stream(d: &mut Decoder, prompt: &[u16], n: usize, draw: &Draw, seed: u64) -> Result<Generated, String> {
    let mut text = TokenStream::new(d.config().vocab)?;
    let g = d.generate(prompt, n, draw, seed, |id| out!("{}", text.push(id)))?;
    out!("{}", text.finish())?;
    Ok(g)
}

/// "prefill 12 tokens 3.1 ms · decode 59 tokens 0.42 s = 140.5 tokens/s": the timings of a
/// generation.
pub fn describe(prompt_len: usize, g: &Generated) -> String {
    let secs = g.decode.as_secs_f64();
    let rate = if secs > 0.0 { g.steps as f64 / secs } else { 0.0 };
    format!(
        "prefill {prompt_len} tokens {:.1} ms · decode {} tokens {:.3} s = {rate:.1} tokens/s",
        g.prefill.as_secs_f64() * 1e3,
        g.steps,
        secs
    )
}

/// `--sample N` after training: `N` tokens from the default prompt through the decoder on the
/// run's target, with the trained parameters copied from the training executor `ex`.
pub fn print_sample(
    ex: &dyn Executor,
    model: &Gpt2Config,
    target: Target,
    threads: usize,
    cuda: &CudaOptions,
    n: usize,
    temperature: f32,
    seed: u64,
) -> Result<(), String> {
    let prompt = default_prompt(model);
    let (mut d, _) = build_decoder(model, prompt.len(), target, threads, cuda)?;
    let mut buf = vec![];
    for (name, shape) in graph_param_names(model) {
        ex.get_f32(&name, &mut buf)?;
        d.set_param(&name, &shape, &buf)?;
    }
    outln!("── sample ({n} tokens, temperature {temperature}) ──")?;
    let g = stream(&mut d, &prompt, n, &Draw { temperature, top_k: None }, seed)?;
    out!("\n")?;
    errln!("sample: {}", describe(prompt.len(), &g));
    Ok(())
}
