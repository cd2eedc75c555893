//! Shared by the decoder tests (`decoder.rs`, `cuda_decoder.rs`): random small GPT-2s, the
//! interpreter's full forward logits (the oracle) and the cached decoder's logits at every
//! position, on any target.

use fusec_ir::interp::{Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::check_slice;
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::graph_param_names;
use fusec_runtime::decoder::Decoder;
use fusec_runtime::executor::{Executor, RefExecutor};
use fusec_runtime::programs::{Program, RunPrograms};

/// Logits tolerance (absolute and relative): fp32 with a different summation order.
pub const TOL: f64 = 1e-4;

/// A random small config: 2 layers, 2 or 4 heads, 32 or 64 channels, an odd vocabulary.
pub fn random_config(rng: &mut Rng) -> Gpt2Config {
    let heads = [2, 4][rng.below(2) as usize];
    let channels = [32, 64][rng.below(2) as usize];
    let vocab = 2 * rng.below(40) as usize + 21;
    let padded_vocab = vocab.div_ceil(16) * 16;
    let max_seq = 8 + rng.below(9) as usize;
    Gpt2Config { layers: 2, heads, channels, vocab, padded_vocab, max_seq }
}

/// Random parameters (LayerNorm weights near 1, the rest uniform in ±0.3: attention far from
/// uniform), by graph name.
pub fn random_params(cfg: &Gpt2Config, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = Rng::new(seed);
    graph_param_names(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let ln_weight = name.starts_with("ln") && name.contains('w');
            let data = (0..n).map(|_| if ln_weight { 1.0 + rng.range(-0.2, 0.2) } else { rng.range(-0.3, 0.3) } as f32).collect();
            (name, shape, data)
        })
        .collect()
}

/// Random tokens of the vocabulary.
pub fn random_tokens(cfg: &Gpt2Config, n: usize, rng: &mut Rng) -> Vec<u16> {
    (0..n).map(|_| rng.below(cfg.vocab as u64) as u16).collect()
}

/// One random case: a config, its parameters (from `seed`), `max_seq` tokens and the
/// interpreter's full-forward logits over them.
pub struct Case {
    pub cfg: Gpt2Config,
    pub params: Vec<(String, Vec<usize>, Vec<f32>)>,
    pub tokens: Vec<u16>,
    pub full: Vec<f64>,
}

/// Draws a [`Case`]: the config and tokens from `rng`, the parameters from `seed`.
pub fn random_case(rng: &mut Rng, seed: u64) -> Case {
    let cfg = random_config(rng);
    let params = random_params(&cfg, seed);
    let tokens = random_tokens(&cfg, cfg.max_seq, rng);
    let full = full_forward_logits(&cfg, &params, &tokens);
    Case { cfg, params, tokens, full }
}

/// The interpreter's logits `[T, Vp]` of the whole forward over `tokens` (batch 1): the oracle.
pub fn full_forward_logits(cfg: &Gpt2Config, params: &[(String, Vec<usize>, Vec<f32>)], tokens: &[u16]) -> Vec<f64> {
    let t = tokens.len();
    let opts = PipelineOptions { no_fusion: true, ..PipelineOptions::default() };
    let run = RunPrograms::compile(&build_gpt2(cfg, "full"), &opts, &RunPrograms::bindings(1, t), true).unwrap();
    let mut ex = RefExecutor::new(&run, Rounding::F32);
    for (name, shape, data) in params {
        ex.set(name, Tensor::from_f32(shape.clone(), data)).unwrap();
    }
    let ids: Vec<i32> = tokens.iter().map(|&x| x as i32).collect();
    ex.set("tokens", Tensor::from_i32(vec![1, t], &ids)).unwrap();
    ex.set("targets", Tensor::from_i32(vec![1, t], &ids)).unwrap();
    ex.run(Program::Logits).unwrap();
    ex.output(Program::Logits, "logits").unwrap().data
}

/// A decoder over `ex` (built for `RunPrograms::decoder(cfg, prefill_len, ..)`) with `params`.
pub fn decoder(ex: Box<dyn Executor>, cfg: &Gpt2Config, prefill_len: usize, params: &[(String, Vec<usize>, Vec<f32>)]) -> Decoder {
    let mut d = Decoder::new(ex, cfg, prefill_len).unwrap();
    for (name, shape, data) in params {
        d.set_param(name, shape, data).unwrap();
    }
    d
}

/// Checks the decoder's logits against `full` (`[T, Vp]`) after a prefill of the first `p`
/// tokens and after each later token, one at a time: every position from `p - 1` on.
pub fn check_positions(what: &str, d: &mut Decoder, cfg: &Gpt2Config, tokens: &[u16], p: usize, full: &[f64]) {
    let vp = cfg.padded_vocab;
    d.prefill(&tokens[..p]).unwrap();
    assert_eq!(d.position(), p);
    check_slice(d.logits(), &full[(p - 1) * vp..p * vp], TOL, TOL).unwrap_or_else(|e| panic!("{what}: prefill of {p}: {e}"));
    for (i, &tok) in tokens.iter().enumerate().skip(p) {
        d.step(tok).unwrap();
        check_slice(d.logits(), &full[i * vp..(i + 1) * vp], TOL, TOL)
            .unwrap_or_else(|e| panic!("{what}: position {i} after a prefill of {p}: {e}"));
    }
    assert_eq!(d.position(), tokens.len());
}
