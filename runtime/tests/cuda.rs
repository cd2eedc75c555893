//! The CUDA target. Without a GPU: `CudaExecutor::new` says what is missing instead of
//! panicking. With one (`cargo test -p fusec-runtime --test cuda -- --ignored` on the device):
//! the tiny GPT-2 trains to the CPU target's losses (within 1e-3 with TF32 products, 1e-5
//! without), the same bits twice, and llm.c's reference run (llmc-odd) is reproduced.

use std::path::PathBuf;

use fusec_ir::interp::Tensor;
use fusec_ir::{DType, Graph};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::{random_init, Checkpoint};
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::cuda::{check_libraries, CudaExecutor, CudaOptions};
use fusec_runtime::data::DataLoader;
use fusec_runtime::executor::{Executor, RefExecutor};
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::programs::{Program, RunPrograms};
use fusec_runtime::tokens::read_tokens;
use fusec_runtime::train::{eval_loss, init_state, train, TrainConfig};

fn programs(fwd: &Graph, b: usize, t: usize) -> RunPrograms {
    programs_with(fwd, b, t, &PipelineOptions::default())
}

fn programs_with(fwd: &Graph, b: usize, t: usize, opts: &PipelineOptions) -> RunPrograms {
    RunPrograms::compile(fwd, opts, &RunPrograms::bindings(b, t), false).unwrap()
}

fn cuda(profile: bool, tf32: bool) -> CudaOptions {
    CudaOptions { profile, tf32, ..CudaOptions::default() }
}

fn train_config(b: usize, t: usize, steps: usize) -> TrainConfig {
    TrainConfig::new(b, t, steps, 1e-3)
}

#[test]
fn without_a_gpu_new_is_an_error_naming_what_is_missing() {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let run = programs(&build_gpt2(&cfg, "tiny"), 2, 8);
    match check_libraries() {
        Ok(()) => {
            fusec_ir::testkit::skip("cuda without a GPU", "the CUDA libraries are present here (this test is for machines without a GPU)")
        }
        Err(e) => {
            let err = CudaExecutor::new(&run, &cuda(false, true)).err().expect("no GPU: an error");
            assert_eq!(err, e);
            if !e.starts_with("no CUDA driver found") {
                eprintln!("the driver is present but: {e}");
            } else {
                assert_eq!(err, "no CUDA driver found (libcuda.so): --target cuda needs an NVIDIA GPU");
            }
        }
    }
}

/// Losses of `steps` training steps of the tiny GPT-2 (random init, the embedded corpus) on
/// an executor, plus the validation loss before training.
fn tiny_losses(ex: &mut dyn Executor, step: &Graph, cfg: &Gpt2Config, b: usize, t: usize, steps: usize) -> Vec<f64> {
    tiny_losses_with(ex, step, cfg, &train_config(b, t, steps))
}

fn tiny_losses_with(ex: &mut dyn Executor, step: &Graph, cfg: &Gpt2Config, tc: &TrainConfig) -> Vec<f64> {
    let fwd = build_gpt2(cfg, "tiny");
    let params = params_from_checkpoint(&fwd, &random_init(cfg, 1337).unwrap()).unwrap();
    init_state(ex, step, &params).unwrap();
    let data = DataLoader::new(fusec_runtime::corpus::markov_tokens(cfg.vocab, 20_000, 42, 1), tc.batch, tc.seq).unwrap();
    let mut out = vec![eval_loss(ex, &data, 2, tc.batch, tc.seq).unwrap()];
    for l in train(ex, tc, &data, None, |_| {}).unwrap() {
        out.push(l.loss);
        out.extend(l.grad_norm);
    }
    out
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn tiny_gpt2_with_clipping_decay_and_accumulation_trains_like_the_cpu_target() {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let mut opts = PipelineOptions::default();
    opts.adamw.clip = true;
    opts.adamw.weight_decay = 0.1;
    let run = programs_with(&build_gpt2(&cfg, "tiny"), 2, 32, &opts);
    let step = run.step().unwrap();
    let tc = TrainConfig { grad_accum: 2, grad_clip: Some(0.5), ..train_config(2, 32, 3) };
    let (mut cpu, _) = CpuExecutor::new(&run, 2, false).unwrap();
    let want = tiny_losses_with(&mut cpu, step, &cfg, &tc);
    let (mut gpu, _) = CudaExecutor::new(&run, &cuda(false, false)).unwrap_or_else(|e| panic!("{e}"));
    let got = tiny_losses_with(&mut gpu, step, &cfg, &tc);
    eprintln!("losses and gradient norms: cpu {want:?}\n                           gpu {got:?}");
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g.is_finite() && (g - w).abs() <= 1e-5 * w.abs().max(1.0), "value {i}: gpu {g} vs cpu {w}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn tiny_gpt2_trains_like_the_cpu_target() {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let (b, t, steps) = (4, 64, 3);
    let run = programs(&build_gpt2(&cfg, "tiny"), b, t);
    let step = run.step().unwrap();
    let (mut cpu, _) = CpuExecutor::new(&run, 2, false).unwrap();
    let want = tiny_losses(&mut cpu, step, &cfg, b, t, steps);
    for (tf32, tol) in [(true, 1e-3), (false, 1e-5)] {
        let (mut gpu, build) = CudaExecutor::new(&run, &cuda(true, tf32)).unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "{}: {} kernels, {} modules ({} compiled, {} from the cache), {:.1} MiB, built in {:.0} ms",
            build.device,
            build.kernels.kernels,
            build.kernels.modules,
            build.kernels.compiled,
            build.kernels.disk_hits,
            build.device_bytes as f64 / 1048576.0,
            build.compile_time.as_secs_f64() * 1e3
        );
        let got = tiny_losses(&mut gpu, step, &cfg, b, t, steps);
        eprintln!("tf32 {tf32}: cpu {want:?}\n            gpu {got:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.is_finite() && (g - w).abs() <= tol, "tf32 {tf32}, loss {i}: gpu {g} vs cpu {w} (tolerance {tol})");
        }
        // Deterministic: a second run from the same state gives the same bits.
        let again = tiny_losses(&mut gpu, step, &cfg, b, t, steps);
        assert_eq!(got, again, "tf32 {tf32}: two runs differ");
        let p = gpu.profile().unwrap();
        assert!(p.rows().iter().any(|(n, _)| *n == "add_layernorm"), "profile has the fused kernels");
        // Parameters agree after training.
        let (w, g) = (cpu.get("wte").unwrap(), gpu.get("wte").unwrap());
        let worst = w.data.iter().zip(&g.data).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        eprintln!("tf32 {tf32}: wte max abs difference {worst:e}");
        let _ = tiny_losses(&mut cpu, step, &cfg, b, t, steps);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn tiny_gpt2_in_bf16_trains_like_the_interpreter() {
    // The bf16 policy end to end (bf16 activations, bf16 gemm epilogues, bf16 attention, the
    // AdamW-written bf16 weights, the in-place classifier gradient) against the interpreter on
    // the same fused programs (same rounding points: 1e-3 on the loss covers accumulation order,
    // TF32 attention and a bf16 rounding that falls the other way), and on the unfused programs
    // (which round after every op: 2e-2, the numerics target of `--precision bf16`).
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let (b, t, steps) = (4, 64, 3);
    let fwd = build_gpt2(&cfg, "tiny");
    for precision in [fusec_passes::amp::Precision::Bf16, fusec_passes::amp::Precision::Bf16Residual] {
        let bf16 = PipelineOptions { precision, ..PipelineOptions::default() };
        let run = programs_with(&fwd, b, t, &bf16);
        let unfused = programs_with(&fwd, b, t, &PipelineOptions { no_fusion: true, ..bf16.clone() });
        let mut reference = RefExecutor::new(&run, fusec_ir::interp::Rounding::F32);
        let same = tiny_losses(&mut reference, run.step().unwrap(), &cfg, b, t, steps);
        let mut reference = RefExecutor::new(&unfused, fusec_ir::interp::Rounding::F32);
        let per_op = tiny_losses(&mut reference, unfused.step().unwrap(), &cfg, b, t, steps);
        for tf32 in [true, false] {
            let (mut gpu, _) = CudaExecutor::new(&run, &cuda(false, tf32)).unwrap_or_else(|e| panic!("{e}"));
            let got = tiny_losses(&mut gpu, run.step().unwrap(), &cfg, b, t, steps);
            eprintln!("{precision:?}, tf32 {tf32}: interpreter {same:?}\n  unfused {per_op:?}\n  gpu {got:?}");
            for (i, ((g, w), u)) in got.iter().zip(&same).zip(&per_op).enumerate() {
                assert!(g.is_finite() && (g - w).abs() <= 1e-3 * w.abs(), "loss {i}: gpu {g} vs interpreter {w}");
                assert!((g - u).abs() <= 2e-2 * u.abs(), "loss {i}: gpu {g} vs unfused interpreter {u}");
            }
        }
    }
}

/// The loss and every parameter gradient of one Grad run on the first batch of a corpus.
fn loss_and_grads(
    ex: &mut dyn Executor,
    fwd: &Graph,
    step: &Graph,
    cfg: &Gpt2Config,
    b: usize,
    t: usize,
) -> (f64, Vec<(String, Vec<f32>)>) {
    init_state(ex, step, &params_from_checkpoint(fwd, &random_init(cfg, 7).unwrap()).unwrap()).unwrap();
    let data = DataLoader::new(fusec_runtime::corpus::markov_tokens(cfg.vocab, 20_000, 42, 1), b, t).unwrap();
    let (x, y) = data.batch(0);
    ex.set("tokens", Tensor::from_i32(vec![b, t], &x)).unwrap();
    ex.set("targets", Tensor::from_i32(vec![b, t], &y)).unwrap();
    ex.set("dloss", Tensor::scalar(DType::F32, 1.0)).unwrap();
    let loss = ex.run(Program::Grad).unwrap().loss.unwrap();
    let grads = fwd.params().into_iter().map(|(n, _)| (n.to_string(), ex.get(&format!("grad.{n}")).unwrap().to_f32())).collect();
    (loss, grads)
}

/// Worst relative L2 difference over the gradient tensors.
fn worst_grad_error(got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)]) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for ((name, g), (_, w)) in got.iter().zip(want) {
        let diff: f64 = g.iter().zip(w).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>().sqrt();
        let norm: f64 = w.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt().max(1e-30);
        if diff / norm > worst.0 || diff.is_nan() {
            worst = (if diff.is_nan() { f64::NAN } else { diff / norm }, name.clone());
        }
    }
    worst
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn flash_attention_and_cublaslt_epilogues_match_the_cpu_for_several_head_sizes() {
    // Head sizes 64, 32, 16; T = 100 is not a multiple of the 64-row tiles.
    for (heads, channels) in [(2, 128), (3, 96), (4, 64)] {
        let cfg = Gpt2Config { layers: 2, heads, channels, vocab: 256, padded_vocab: 256, max_seq: 128 };
        let (b, t) = (2, 100);
        let fwd = build_gpt2(&cfg, "flash_test");
        let run = programs(&fwd, b, t);
        let step = run.step().unwrap();
        let (mut cpu, _) = CpuExecutor::new(&run, 2, false).unwrap();
        let (want_loss, want) = loss_and_grads(&mut cpu, &fwd, step, &cfg, b, t);
        let mut errs = vec![];
        for flash in [true, false] {
            // Flash attention and cuBLASLt epilogues, or neither (score matrices, epilogue kernels).
            let opts = CudaOptions { flash, lt_epilogues: flash, ..cuda(false, true) };
            let (mut gpu, build) = CudaExecutor::new(&run, &opts).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(build.attention.starts_with("flash"), flash, "{}", build.attention);
            assert_eq!(build.lt_epilogues > 0, flash, "cuBLASLt epilogues: {}", build.lt_epilogues);
            let (loss, got) = loss_and_grads(&mut gpu, &fwd, step, &cfg, b, t);
            let (err, name) = worst_grad_error(&got, &want);
            eprintln!(
                "head size {}: {}, {} cuBLASLt epilogues: loss {loss} vs cpu {want_loss}, worst gradient relative L2 {err:e} ({name})",
                channels / heads,
                build.attention,
                build.lt_epilogues
            );
            assert!((loss - want_loss).abs() <= 1e-3, "flash {flash}: loss {loss} vs {want_loss}");
            assert!(err <= 1e-2, "flash {flash}: gradient of {name}: relative L2 error {err:e}");
            errs.push(err);
        }
        // Flash attention and cuBLASLt epilogues are not less accurate than the score-matrix
        // path with epilogue kernels (both TF32).
        assert!(errs[0] <= 2.0 * errs[1] + 1e-4, "flash {:e} vs score matrices {:e}", errs[0], errs[1]);
    }
}

/// One Grad run of the GPT-2 `cfg` on batch `(b, t)` in `precision`, on the GPU and on the CPU
/// target (`threads` threads): the GPU's loss, the CPU's, and the worst parameter gradient's
/// relative L2 error with its name.
fn gpu_against_cpu(
    cfg: &Gpt2Config,
    name: &str,
    (b, t): (usize, usize),
    precision: fusec_passes::amp::Precision,
    threads: usize,
) -> (f64, f64, f64, String) {
    let fwd = build_gpt2(cfg, name);
    let run = programs_with(&fwd, b, t, &PipelineOptions { precision, ..PipelineOptions::default() });
    let step = run.step().unwrap();
    let (mut cpu, _) = CpuExecutor::new(&run, threads, false).unwrap();
    let (want_loss, want) = loss_and_grads(&mut cpu, &fwd, step, cfg, b, t);
    let (mut gpu, _) = CudaExecutor::new(&run, &cuda(false, false)).unwrap_or_else(|e| panic!("{e}"));
    let (loss, got) = loss_and_grads(&mut gpu, &fwd, step, cfg, b, t);
    let (err, worst) = worst_grad_error(&got, &want);
    (loss, want_loss, err, worst)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn rows_wider_than_a_warp_can_keep_column_partials_for_match_the_cpu() {
    // Rows of 1,600 and 1,040 columns (GPT-2 1.5B's width; neither a multiple of 256): the
    // LayerNorm gradient's column sums go to block-wide teams with tail-guarded 8-wide steps,
    // the LayerNorm forward's unrolled steps end past the row. 256 rows: block-wide teams.
    for (heads, channels) in [(25, 1600), (26, 1040)] {
        let cfg = Gpt2Config { layers: 1, heads, channels, vocab: 256, padded_vocab: 256, max_seq: 64 };
        for precision in [fusec_passes::amp::Precision::F32, fusec_passes::amp::Precision::Bf16] {
            let (loss, want_loss, err, name) = gpu_against_cpu(&cfg, "wide_rows", (4, 64), precision, 2);
            eprintln!("C = {channels}, {precision:?}: loss {loss} vs cpu {want_loss}, worst gradient relative L2 {err:e} ({name})");
            // fp32 without TF32: summation order only; bf16: a rounding may fall the other way.
            let (loss_tol, grad_tol) = if precision.is_bf16() { (1e-3, 2e-2) } else { (1e-5, 1e-4) };
            assert!((loss - want_loss).abs() <= loss_tol * want_loss.abs(), "C = {channels}, {precision:?}: loss {loss} vs {want_loss}");
            assert!(err <= grad_tol, "C = {channels}, {precision:?}: gradient of {name}: relative L2 error {err:e}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn a_classifier_over_gpt2_vocabulary_rows_matches_the_cpu() {
    // bf16 logits of 50,304 columns (100 KiB a row, GPT-2's padded vocabulary), 3,072 rows:
    // the fused classifier's online pass and in-place gradient at the size the 124M step runs
    // them; f32 logits too (on sm_90 a cluster of eight blocks a row, `plan.rs`). Loss and
    // every gradient against the CPU target.
    let cfg = Gpt2Config { layers: 1, heads: 2, channels: 64, vocab: 50257, padded_vocab: 50304, max_seq: 768 };
    for (precision, loss_tol, grad_tol) in [(fusec_passes::amp::Precision::Bf16, 1e-3, 2e-2), (fusec_passes::amp::Precision::F32, 1e-5, 1e-4)] {
        let (loss, want_loss, err, name) = gpu_against_cpu(&cfg, "wide_vocab", (4, 768), precision, 8);
        eprintln!("vocabulary 50304, {precision:?}: loss {loss} vs cpu {want_loss}, worst gradient relative L2 {err:e} ({name})");
        assert!((loss - want_loss).abs() <= loss_tol * want_loss.abs(), "{precision:?}: loss {loss} vs {want_loss}");
        assert!(err <= grad_tol, "{precision:?}: gradient of {name}: relative L2 error {err:e}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn the_hand_written_bf16_classifier_matches_the_cpu_at_odd_vocabularies() {
    // `codegen-cuda/src/classifier.rs` at vocabularies that end inside an 8-column chunk (70 of
    // 72: padding and targets in the last chunk), fill fewer than one chunk (5 of 8), or leave
    // padding chunks (61 of 80); random targets hit the last chunks. Against the CPU target.
    for (vocab, padded_vocab) in [(70, 72), (5, 8), (61, 80)] {
        let cfg = Gpt2Config { layers: 1, heads: 2, channels: 64, vocab, padded_vocab, max_seq: 64 };
        let (loss, want_loss, err, name) = gpu_against_cpu(&cfg, "odd_vocab", (4, 64), fusec_passes::amp::Precision::Bf16, 2);
        eprintln!("vocabulary {vocab} of {padded_vocab}: loss {loss} vs cpu {want_loss}, worst gradient relative L2 {err:e} ({name})");
        assert!((loss - want_loss).abs() <= 1e-3 * want_loss.abs(), "vocabulary {vocab}: loss {loss} vs {want_loss}");
        assert!(err <= 2e-2, "vocabulary {vocab}: gradient of {name}: relative L2 error {err:e}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn nccl_all_reduce_is_exact_across_every_gpu_of_the_host() {
    // One rank per visible GPU (one on a single-GPU machine: the one-rank communicator).
    let r = fusec_runtime::dist::nccl::all_reduce_check(1 << 20, 3).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{r:?}");
    assert!(r.ranks >= 1 && r.ms > 0.0);
}

/// The llm.c reference folder: `../shared/refs/llmc-odd` beside the repository, or
/// `.dev/refs/llmc-odd` inside it (the device copy), or `$FUSEC_LLMC_REFS`.
fn llmc_odd() -> Option<PathBuf> {
    let mut c: Vec<PathBuf> = std::env::var_os("FUSEC_LLMC_REFS").map(PathBuf::from).into_iter().collect();
    c.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/refs/llmc-odd")));
    c.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.dev/refs/llmc-odd")));
    if let Ok(d) = std::env::current_dir() {
        c.push(d.join(".dev/refs/llmc-odd"));
        c.push(d.join("../.dev/refs/llmc-odd"));
    }
    let found = c.into_iter().find(|p| p.join("reference.json").exists());
    if found.is_none() {
        fusec_ir::testkit::skip("cuda llmc-odd", "no llmc-odd reference (../shared/refs/llmc-odd, .dev/refs/llmc-odd or $FUSEC_LLMC_REFS)");
    }
    found
}

fn json_floats(text: &str, key: &str) -> Vec<f64> {
    let at = text.find(&format!("\"{key}\"")).unwrap_or_else(|| panic!("reference.json has no {key}"));
    let rest = &text[at..];
    let (open, close) = (rest.find('[').unwrap(), rest.find(']').unwrap());
    rest[open + 1..close].split(',').map(|x| x.trim().parse().unwrap()).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn llmc_odd_matches_llmc_without_tf32() {
    let Some(dir) = llmc_odd() else { return };
    let json = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let ckpt = Checkpoint::read(&dir.join("gpt2_odd_s4242.bin")).unwrap();
    let cfg = ckpt.config;
    let (b, t) = (3, 48);
    let fwd = build_gpt2(&cfg, "gpt2_odd");
    let run = programs(&fwd, b, t);
    let (mut ex, _) = CudaExecutor::new(&run, &cuda(false, false)).unwrap_or_else(|e| panic!("{e}"));
    init_state(&mut ex, run.step().unwrap(), &params_from_checkpoint(&fwd, &ckpt).unwrap()).unwrap();
    let data = DataLoader::new(read_tokens(&dir.join("tokens_train_s11.bin")).unwrap(), b, t).unwrap();
    let logs = train(&mut ex, &train_config(b, t, 10), &data, None, |_| {}).unwrap();
    let want = json_floats(&json, "losses");
    let mut worst = 0f64;
    for (l, w) in logs.iter().zip(&want) {
        worst = worst.max((l.loss - w).abs());
        assert!((l.loss - w).abs() <= 1e-5, "step {}: loss {} vs llm.c {w}", l.step, l.loss);
    }
    let reference: Vec<f32> = std::fs::read(dir.join("params_step10.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let (mut offset, mut worst_p) = (0, 0f32);
    for (name, shape, _) in ckpt.named_tensors() {
        let n: usize = shape.iter().product();
        for (a, r) in ex.get(&name).unwrap().to_f32().iter().zip(&reference[offset..offset + n]) {
            worst_p = worst_p.max((a - r).abs());
        }
        offset += n;
    }
    eprintln!("cuda (no tf32): worst loss difference {worst:e}, params after 10 steps max abs difference {worst_p:e}");
    assert!(worst_p <= 2e-5, "params after 10 steps differ by {worst_p}");
}

#[test]
#[ignore = "needs an NVIDIA GPU with ~30 GB: run with --ignored on the device"]
fn gpt2_124m_training_step_time() {
    let cfg = Gpt2Config::preset("d12").unwrap();
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (b, t, steps) = (env("FUSEC_B", 16), env("FUSEC_T", 1024), env("FUSEC_STEPS", 10));
    let fwd = build_gpt2(&cfg, "gpt2_124m");
    let run = programs(&fwd, b, t);
    let (mut ex, build) = CudaExecutor::new(&run, &cuda(true, true)).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "{}: {} kernels, {} modules ({} compiled, {} cached), {:.1} GiB allocated, built in {:.2} s",
        build.device,
        build.kernels.kernels,
        build.kernels.modules,
        build.kernels.compiled,
        build.kernels.disk_hits,
        build.device_bytes as f64 / (1u64 << 30) as f64,
        build.compile_time.as_secs_f64()
    );
    let params = params_from_checkpoint(&fwd, &random_init(&cfg, 1337).unwrap()).unwrap();
    init_state(&mut ex, run.step().unwrap(), &params).unwrap();
    let data = DataLoader::new(fusec_runtime::corpus::markov_tokens(cfg.vocab, 400_000, 42, 1), b, t).unwrap();
    let logs = train(&mut ex, &train_config(b, t, steps), &data, None, |r| eprintln!("step {}: loss {:.4} {:.1} ms", r.step, r.loss, r.ms))
        .unwrap();
    let mut ms: Vec<f64> = logs.iter().skip(1).map(|l| l.ms).collect();
    ms.sort_by(f64::total_cmp);
    let med = ms[ms.len() / 2];
    eprintln!(
        "median {med:.1} ms/step, {:.0} tok/s; peak device memory {:.1} GiB",
        (b * t) as f64 / med * 1e3,
        ex.peak_device_bytes() as f64 / (1u64 << 30) as f64
    );
    let p = ex.profile().unwrap();
    let total = p.total().as_secs_f64();
    let mut rows = p.rows();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1.total));
    for (name, s) in rows.iter().take(25) {
        let secs = s.total.as_secs_f64();
        eprintln!(
            "{name:>28} {:>6} calls {:>9.2} ms {:>5.1}%  {:>7.0} GB/s {:>7.1} TFLOP/s",
            s.calls,
            secs * 1e3 / logs.len() as f64,
            100.0 * secs / total,
            s.bytes as f64 / secs / 1e9,
            s.flops as f64 / secs / 1e12
        );
    }
    assert!(logs.iter().all(|l| l.loss.is_finite()));
    // Without profiling: the programs replay as CUDA graphs.
    drop(ex);
    let (mut ex, _) = CudaExecutor::new(&run, &cuda(false, true)).unwrap_or_else(|e| panic!("{e}"));
    init_state(&mut ex, run.step().unwrap(), &params).unwrap();
    let again = train(&mut ex, &train_config(b, t, steps), &data, None, |_| {}).unwrap();
    let mut ms: Vec<f64> = again.iter().skip(1).map(|l| l.ms).collect();
    ms.sort_by(f64::total_cmp);
    let med = ms[ms.len() / 2];
    eprintln!("without profiling (CUDA graphs): median {med:.1} ms/step, {:.0} tok/s", (b * t) as f64 / med * 1e3);
    let (l0, l1): (Vec<f64>, Vec<f64>) = (logs.iter().map(|l| l.loss).collect(), again.iter().map(|l| l.loss).collect());
    assert_eq!(l0, l1, "graph replay gives the same bits as direct launches");
}
