//! Sampling with a key/value cache: the decoder programs ([`RunPrograms::decoder`]) on any
//! executor, fed one prompt (the `Prefill` program: all its positions at once) and then one
//! token at a time (the `Decode` program), drawing each next token as [`crate::sample`] says.
//!
//! The caches are executor tensors (`cache.k.L`, `cache.v.L`) that both programs read and write
//! back in place; `pos` is the number of positions they hold. Past the model's maximum sequence
//! length, [`Decoder::generate`] slides: it keeps the last half of the context and refills the
//! cache from it, one position at a time.

use std::time::{Duration, Instant};

use fusec_ir::interp::Tensor;
use fusec_ir::rng::Rng;
use fusec_ir::DType;
use fusec_models::{cache_shape, decoder_tokens_input, key_cache_name, value_cache_name, Gpt2Config};

use crate::executor::Executor;
use crate::programs::Program;
use crate::sample::{sample_next_with, Draw};

/// The decoder of one GPT-2 on one executor, with the position its caches hold.
pub struct Decoder {
    ex: Box<dyn Executor>,
    cfg: Gpt2Config,
    /// The prompt length the `Prefill` program was compiled for (1: there is none).
    prefill_len: usize,
    /// Positions held by the caches.
    pos: usize,
    /// The latest logits row (`Vp` values).
    logits: Vec<f32>,
}

/// What [`Decoder::generate`] made and how long it took.
#[derive(Clone, Debug, Default)]
pub struct Generated {
    /// The new tokens (without the prompt).
    pub tokens: Vec<u16>,
    /// The prefill's time (the prompt's positions and the first token's logits).
    pub prefill: Duration,
    /// Time of the decoding steps after the prefill (refills included).
    pub decode: Duration,
    /// Decoding steps run after the prefill.
    pub steps: usize,
}

impl Decoder {
    /// A decoder over an executor built for `RunPrograms::decoder(cfg, prefill_len, ..)`, with
    /// empty (zeroed) caches; its parameters still have to be set ([`Decoder::set_param`]).
    pub fn new(ex: Box<dyn Executor>, cfg: &Gpt2Config, prefill_len: usize) -> Result<Decoder, String> {
        let mut d = Decoder { ex, cfg: *cfg, prefill_len: prefill_len.max(1), pos: 0, logits: vec![] };
        let shape = cache_shape(cfg).to_vec();
        for l in 0..cfg.layers {
            // Zeros, never garbage: a hidden position's weight is 0, and 0 × NaN is NaN.
            d.ex.set_zeros(&key_cache_name(l), DType::F32, shape.clone())?;
            d.ex.set_zeros(&value_cache_name(l), DType::F32, shape.clone())?;
        }
        d.ex.set("pos", Tensor::scalar(DType::F32, 0.0))?;
        Ok(d)
    }

    /// Sets parameter `name` (a graph parameter name, e.g. `qkvw.3`) from f32 values.
    pub fn set_param(&mut self, name: &str, shape: &[usize], data: &[f32]) -> Result<(), String> {
        self.ex.set_f32(name, DType::F32, shape, data)
    }

    /// The positions the caches hold.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The model's config.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// The latest logits (`Vp` values: the last position's).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Empties the caches and runs `prompt` from position 0: one `Prefill` run when the
    /// prompt has the length it was compiled for, else one `Decode` step per token. Leaves the
    /// last position's logits in [`Decoder::logits`].
    pub fn prefill(&mut self, prompt: &[u16]) -> Result<(), String> {
        if prompt.is_empty() || prompt.len() > self.cfg.max_seq {
            return Err(format!("a prompt takes 1..={} tokens, not {}", self.cfg.max_seq, prompt.len()));
        }
        self.pos = 0;
        if prompt.len() == 1 || prompt.len() != self.prefill_len {
            return prompt.iter().try_for_each(|&t| self.step(t));
        }
        self.run(Program::Prefill, prompt)
    }

    /// Appends one token at the next position; its logits land in [`Decoder::logits`].
    pub fn step(&mut self, token: u16) -> Result<(), String> {
        if self.pos >= self.cfg.max_seq {
            return Err(format!("the key/value cache is full ({} positions)", self.cfg.max_seq));
        }
        self.run(Program::Decode, &[token])
    }

    fn run(&mut self, program: Program, tokens: &[u16]) -> Result<(), String> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(format!("token {bad} is outside the vocabulary of {}", self.cfg.vocab));
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.ex.set(decoder_tokens_input(tokens.len()), Tensor::from_i32(vec![tokens.len()], &ids))?;
        self.ex.set("pos", Tensor::scalar(DType::F32, self.pos as f64))?;
        self.ex.run(program)?;
        let out = self.ex.output(program, "logits")?;
        self.logits.clear();
        self.logits.extend(out.data.iter().map(|&x| x as f32));
        self.pos += tokens.len();
        Ok(())
    }

    /// Generates `n` tokens after `prompt`, calling `on_token` with each as soon as it is drawn
    /// (one [`Rng`] seeded by `seed`, as [`crate::sample::generate`]). When the cache is full,
    /// the last half of the context is run again from position 0 (a sliding window).
    pub fn generate(
        &mut self,
        prompt: &[u16],
        n: usize,
        draw: &Draw,
        seed: u64,
        mut on_token: impl FnMut(u16) -> Result<(), String>,
    ) -> Result<Generated, String> {
        let vocab = self.cfg.vocab;
        if vocab == 0 || vocab > 1 << 16 {
            return Err(format!("cannot sample from a vocabulary of {vocab} tokens (u16 ids need 1..=65536)"));
        }
        let mut rng = Rng::new(seed);
        let mut context = prompt.to_vec();
        let mut out = Generated::default();
        let t0 = Instant::now();
        self.prefill(prompt)?;
        out.prefill = t0.elapsed();
        let t1 = Instant::now();
        for i in 0..n {
            let next = sample_next_with(&self.logits, vocab, draw, &mut rng);
            on_token(next)?;
            out.tokens.push(next);
            context.push(next);
            if i + 1 == n {
                break;
            }
            if self.pos >= self.cfg.max_seq {
                let keep = (self.cfg.max_seq / 2).max(1);
                let window = context[context.len() - keep..].to_vec();
                self.pos = 0;
                for &t in &window {
                    self.step(t)?;
                    out.steps += 1;
                }
            } else {
                self.step(next)?;
                out.steps += 1;
            }
        }
        out.decode = t1.elapsed();
        Ok(out)
    }
}
