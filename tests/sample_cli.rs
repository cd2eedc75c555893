//! `fusec sample` and `fusec run --sample` through the binary: greedy and seeded text from the
//! cached decoder equals the old whole-forward sampling's (every token a whole `[1, T]` forward on the
//! interpreter, as `--sample` ran before issue 17), the GPT-2 prompt is continued and streamed
//! as text, top-k 1 is greedy, and bad input is a clear error naming the flag, never a panic.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use fusec_ir::interp::{Rounding, Tensor};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::executor::{Executor, RefExecutor};
use fusec_runtime::programs::{Program, RunPrograms};
use fusec_runtime::sample::generate;
use fusec_runtime::tokenizer::Gpt2Tokenizer;

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2-tiny.graph");

fn fusec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fusec")).args(args).stdin(Stdio::null()).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn dir() -> PathBuf {
    fusec_ir::testkit::process_dir("sample")
}

/// The tiny GPT-2 (vocabulary 250) after 30 training steps, saved once per test process.
fn tiny_checkpoint() -> &'static Path {
    static CK: OnceLock<PathBuf> = OnceLock::new();
    CK.get_or_init(|| {
        let ck = dir().join("tiny-ck");
        let o = fusec(&["run", TINY, "--steps", "30", "--save", s(&ck)]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        ck
    })
}

/// A 1-layer GPT-2 with GPT-2's vocabulary and a 32-token window after one step, saved once.
fn gpt2_vocab_checkpoint() -> &'static Path {
    static CK: OnceLock<PathBuf> = OnceLock::new();
    CK.get_or_init(|| {
        let graph = dir().join("bpe.graph");
        let args = ["export", "gpt2", "--layers", "1", "--heads", "2", "--channels", "32", "--vocab", "50257", "--max-seq", "32"];
        let o = fusec(&[&args[..], &["-o", s(&graph)]].concat());
        assert!(o.status.success(), "{}", text(&o.stderr));
        let ck = dir().join("bpe-ck");
        let o = fusec(&["run", s(&graph), "--steps", "1", "--batch", "1", "--seq", "16", "--save", s(&ck)]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        ck
    })
}

/// The old `--sample`: tokens after `prompt` drawn at `temperature` (seed `seed`), each from a
/// whole `[1, T]` forward of the interpreter over the context (padded with token 0), `T` the
/// model's maximum sequence length.
fn whole_forward_sample(ck: &Path, prompt: &[u16], n: usize, temperature: f32, seed: u64) -> Vec<u16> {
    let ckpt = Checkpoint::read(&ck.join("model.bin")).unwrap();
    let cfg: Gpt2Config = ckpt.config;
    let t = cfg.max_seq;
    let opts = PipelineOptions { no_fusion: true, ..PipelineOptions::default() };
    let run = RunPrograms::compile(&build_gpt2(&cfg, "full"), &opts, &RunPrograms::bindings(1, t), true).unwrap();
    let mut ex = RefExecutor::new(&run, Rounding::F32);
    for (name, shape, data) in ckpt.named_tensors() {
        ex.set(&name, Tensor::from_f32(shape, data)).unwrap();
    }
    ex.set("targets", Tensor::from_i32(vec![1, t], &vec![0; t])).unwrap();
    let vp = cfg.padded_vocab;
    let next = |ctx: &[u16]| -> Result<Vec<f32>, String> {
        let mut batch = vec![0i32; t];
        for (d, s) in batch.iter_mut().zip(ctx) {
            *d = *s as i32;
        }
        ex.set("tokens", Tensor::from_i32(vec![1, t], &batch))?;
        ex.run(Program::Logits)?;
        let logits = ex.output(Program::Logits, "logits")?;
        let at = (ctx.len() - 1) * vp;
        Ok(logits.data[at..at + vp].iter().map(|&x| x as f32).collect())
    };
    generate(next, prompt, n, cfg.vocab, temperature, seed).unwrap()
}

fn ids(out: &str) -> Vec<u16> {
    out.split_whitespace().map(|w| w.parse().unwrap()).collect()
}

#[test]
fn greedy_sample_equals_the_whole_forward_sampling_on_every_target() {
    let ck = tiny_checkpoint();
    let want = whole_forward_sample(ck, &[0], 20, 0.0, 1);
    for target in ["cpu", "ref"] {
        let o = fusec(&["sample", s(ck), "--tokens", "20", "--temperature", "0", "--target", target]);
        assert!(o.status.success(), "{target}: {}", text(&o.stderr));
        assert_eq!(ids(&text(&o.stdout)), want, "{target}");
        let err = text(&o.stderr);
        assert!(err.contains("prefill 1 tokens") && err.contains("decode 19 tokens") && err.contains("tokens/s"), "{err}");
    }
    // Drawn at temperature 1 with one seed: the same draws from the same distributions.
    let want = whole_forward_sample(ck, &[0], 40, 1.0, 99);
    let distinct: std::collections::HashSet<&u16> = want.iter().collect();
    assert!(distinct.len() >= 5, "a sample this uniform tests little: {want:?}");
    for target in ["cpu", "ref"] {
        let o = fusec(&["sample", s(ck), "--tokens", "40", "--temperature", "1", "--seed", "99", "--target", target]);
        assert!(o.status.success(), "{target}: {}", text(&o.stderr));
        assert_eq!(ids(&text(&o.stdout)), want, "{target}");
    }
    let want = whole_forward_sample(ck, &[0], 20, 0.0, 1);
    // `--top-k 1` draws the argmax at any temperature; a checkpoint file works like its folder.
    let o = fusec(&["sample", s(&ck.join("model.bin")), "--tokens", "20", "--top-k", "1", "--temperature", "2"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(ids(&text(&o.stdout)), want);
}

#[test]
fn run_sample_uses_the_decoder_after_training() {
    let ck = dir().join("run-sample-ck");
    let o = fusec(&["run", TINY, "--steps", "3", "--save", s(&ck), "--sample", "12", "--temperature", "0"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let sample = out.split("── sample (12 tokens, temperature 0) ──\n").nth(1).and_then(|r| r.lines().next()).unwrap();
    assert_eq!(ids(sample), whole_forward_sample(&ck, &[0], 12, 0.0, 1));
    assert!(text(&o.stderr).contains("sample: prefill 1 tokens"), "{}", text(&o.stderr));
}

#[test]
fn a_text_prompt_is_continued_and_streamed_as_text() {
    let ck = gpt2_vocab_checkpoint();
    let tok = Gpt2Tokenizer::new().unwrap();
    let prompt_text = "The quick brown fox jumps";
    let prompt = tok.encode(prompt_text);
    let want = whole_forward_sample(ck, &prompt, 8, 0.0, 1);
    let o = fusec(&["sample", s(ck), "--prompt", prompt_text, "--tokens", "8", "--temperature", "0"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), format!("{prompt_text}{}\n", tok.decode(&want)));
    assert!(text(&o.stderr).contains(&format!("prefill {} tokens", prompt.len())), "{}", text(&o.stderr));
    // Drawn at temperature 1: the old sampling's draws, seed for seed.
    let want = whole_forward_sample(ck, &prompt, 8, 1.0, 5);
    let o = fusec(&["sample", s(ck), "--prompt", prompt_text, "--tokens", "8", "--seed", "5"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), format!("{prompt_text}{}\n", tok.decode(&want)));
}

/// Asserts exit 2, no panic, and every `needle` in standard error.
fn refused(args: &[&str], needles: &[&str]) {
    common::assert_refused(&fusec(args), args, needles);
}

#[test]
fn bad_sample_input_is_a_clear_error() {
    let tiny = s(tiny_checkpoint());
    let bpe = s(gpt2_vocab_checkpoint());
    let missing = dir().join("no-such.bin");
    refused(&["sample", s(&missing), "--tokens", "3"], &["no-such.bin", "cannot open"]);
    refused(&["sample", s(&dir()), "--tokens", "3"], &["without model.bin"]);
    let truncated = dir().join("truncated.bin");
    let bytes = std::fs::read(tiny_checkpoint().join("model.bin")).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    refused(&["sample", s(&truncated), "--tokens", "3"], &["truncated.bin"]);
    refused(&["sample", tiny, "--tokens", "0"], &["--tokens 0", "1..=63"]);
    refused(&["sample", tiny, "--tokens", "64"], &["--tokens 64", "1..=63"]);
    refused(&["sample", tiny, "--top-k", "0"], &["--top-k 0", "1..=250"]);
    refused(&["sample", tiny, "--top-k", "251"], &["--top-k 251", "1..=250"]);
    refused(&["sample", tiny, "--temperature", "nan"], &["--temperature", "at most 100"]);
    refused(&["sample", tiny, "--temperature", "-1"], &["--temperature -1"]);
    refused(&["sample", tiny, "--threads", "0"], &["--threads 0", "1..=1024"]);
    refused(&["sample", tiny, "--prompt", "hello"], &["--prompt", "GPT-2 vocabulary", "250 tokens"]);
    refused(&["sample", bpe, "--prompt", ""], &["--prompt is empty"]);
    let long = "word ".repeat(40);
    refused(&["sample", bpe, "--prompt", &long], &["--prompt is", "tokens: it must be in 1..=31"]);
    refused(&["sample", bpe, "--prompt", "one two three", "--tokens", "30"], &["--tokens 30", "1..=29", "3 tokens"]);
}
