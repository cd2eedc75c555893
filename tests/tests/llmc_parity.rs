//! Parity with llm.c's CPU trainer on ../shared/refs/llmc-odd, through the reference
//! interpreter: forward and validation losses, step-0 gradients, 10 training losses and the
//! parameters after 10 steps. Expected numbers are read from the reference files.

mod common;

use fusec_ir::interp::{Rounding, Tensor};
use fusec_ir::testkit::{max_abs_diff, rel_l2};
use fusec_ir::DType;
use fusec_models::build_gpt2;
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::data::DataLoader;
use fusec_runtime::executor::Executor;
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::programs::Program;
use fusec_runtime::tokens::read_tokens;
use fusec_runtime::train::{eval_loss, init_state, train, TrainConfig};

const B: usize = 3;
const T: usize = 48;

struct Setup {
    dir: std::path::PathBuf,
    json: serde_json::Value,
    ckpt: Checkpoint,
    ex: fusec_runtime::executor::RefExecutor,
}

/// The unfused programs (the oracle) and the fully fused ones, both through the interpreter.
fn variants() -> [(&'static str, PipelineOptions); 2] {
    [("unfused", common::unfused()), ("fused", PipelineOptions::default())]
}

fn setup(opts: &PipelineOptions) -> Option<Setup> {
    let dir = common::llmc_odd()?;
    let json = common::reference_json(&dir);
    let ckpt = Checkpoint::read(&dir.join("gpt2_odd_s4242.bin")).unwrap();
    let cfg = ckpt.config;
    let fwd = build_gpt2(&cfg, "gpt2_odd");
    let (mut ex, step) = common::ref_executor(&fwd, opts, B, T, Rounding::F32);
    init_state(&mut ex, &step, &params_from_checkpoint(&fwd, &ckpt).unwrap()).unwrap();
    Some(Setup { dir, json, ckpt, ex })
}

fn loader(dir: &std::path::Path, file: &str) -> DataLoader {
    DataLoader::new(read_tokens(&dir.join(file)).unwrap(), B, T).unwrap()
}

#[test]
fn forward_and_val_loss_match_llmc() {
    for (variant, opts) in variants() {
        eprintln!("{variant}:");
        let Some(mut s) = setup(&opts) else { return };
        let want = s.json["losses"][0].as_f64().unwrap();
        let got = eval_loss(&mut s.ex, &loader(&s.dir, "tokens_train_s11.bin"), 1, B, T).unwrap();
        assert!((got - want).abs() <= 1e-5, "step-0 loss {got} vs llm.c {want}");
        let want_val = s.json["val_loss_before_step0"].as_f64().unwrap();
        let got_val = eval_loss(&mut s.ex, &loader(&s.dir, "tokens_val_s12.bin"), 4, B, T).unwrap();
        assert!((got_val - want_val).abs() <= 1e-5, "val loss {got_val} vs llm.c {want_val}");
    }
}

#[test]
fn step0_gradients_match_llmc() {
    for (variant, opts) in variants() {
        eprintln!("{variant}:");
        let Some(mut s) = setup(&opts) else { return };
        let data = loader(&s.dir, "tokens_train_s11.bin");
        let (x, y) = data.batch(0);
        s.ex.set("tokens", Tensor::from_i32(vec![B, T], &x)).unwrap();
        s.ex.set("targets", Tensor::from_i32(vec![B, T], &y)).unwrap();
        s.ex.set("dloss", Tensor::scalar(DType::F32, 1.0)).unwrap();
        s.ex.run(Program::Grad).unwrap();
        let reference = common::read_f32s(&s.dir.join("grads_step0.f32"));
        let mut offset = 0;
        let mut worst = (0.0f64, String::new());
        for (name, shape, _) in s.ckpt.named_tensors() {
            let n: usize = shape.iter().product();
            let got = s.ex.get(&format!("grad.{name}")).unwrap().to_f32();
            let want = &reference[offset..offset + n];
            offset += n;
            let rel = rel_l2(&got, want);
            assert!(rel <= 3e-6, "grad of {name}: relative L2 error {rel:e}");
            if rel > worst.0 {
                worst = (rel, name);
            }
        }
        assert_eq!(offset, reference.len());
        eprintln!("worst per-tensor relative L2 error: {:e} ({})", worst.0, worst.1);
        let wte = s.ex.get("grad.wte").unwrap().to_f32();
        assert!(wte[500 * 32..].iter().all(|&g| g == 0.0), "padding rows of wte must get exactly zero gradient");
    }
}

#[test]
fn ten_steps_match_llmc_losses_and_parameters() {
    for (variant, opts) in variants() {
        eprintln!("{variant}:");
        let Some(mut s) = setup(&opts) else { return };
        let cfg = TrainConfig::new(B, T, 10, s.json["lr"].as_f64().unwrap() as f32);
        let logs = train(&mut s.ex, &cfg, &loader(&s.dir, "tokens_train_s11.bin"), None, |_| {}).unwrap();
        for (log, want) in logs.iter().zip(s.json["losses"].as_array().unwrap()) {
            let want = want.as_f64().unwrap();
            assert!((log.loss - want).abs() <= 1e-5, "step {} loss {} vs llm.c {want}", log.step, log.loss);
        }
        let reference = common::read_f32s(&s.dir.join("params_step10.f32"));
        let mut offset = 0;
        let mut worst = 0.0f64;
        for (name, shape, _) in s.ckpt.named_tensors() {
            let n: usize = shape.iter().product();
            let got = s.ex.get(&name).unwrap().to_f32();
            worst = worst.max(max_abs_diff(&got, &reference[offset..offset + n]));
            offset += n;
        }
        eprintln!("params after 10 steps: max abs difference {worst:e}");
        assert!(worst <= 1e-5, "params after 10 steps differ by {worst}");
    }
}

#[test]
fn ten_bf16_steps_stay_within_2e_2_of_llmc_fp32_losses() {
    // The numerics target of `--precision bf16` (and `bf16+residual`): every step's loss within
    // 2e-2 relative of llm.c's fp32 loss, on the unfused programs (a rounding after every op)
    // and the fused ones (the rounding points the GPU runs), with gradient accumulators and
    // with fresh gradients as `fusec run` compiles them (bf16 weight gradients under
    // `bf16+residual`).
    use fusec_passes::amp::Precision;
    for precision in [Precision::Bf16, Precision::Bf16Residual] {
        for ((variant, opts), fresh_grads) in variants().into_iter().flat_map(|v| [(v.clone(), false), (v, true)]) {
            let adamw = fusec_passes::optimizer::AdamWConfig { fresh_grads, ..opts.adamw.clone() };
            let opts = PipelineOptions { precision, adamw, ..opts };
            let variant = format!("{variant}{}", if fresh_grads { ", fresh gradients" } else { "" });
            let Some(mut s) = setup(&opts) else { return };
            let cfg = TrainConfig::new(B, T, 10, s.json["lr"].as_f64().unwrap() as f32);
            let logs = train(&mut s.ex, &cfg, &loader(&s.dir, "tokens_train_s11.bin"), None, |_| {}).unwrap();
            let mut worst = 0.0f64;
            for (log, want) in logs.iter().zip(s.json["losses"].as_array().unwrap()) {
                let rel = (log.loss - want.as_f64().unwrap()).abs() / want.as_f64().unwrap().abs();
                assert!(rel <= 2e-2, "{precision:?} {variant}: step {} loss {} vs llm.c {want} ({rel:e})", log.step, log.loss);
                worst = worst.max(rel);
            }
            assert_eq!(logs.len(), 10);
            eprintln!("{precision:?} {variant}: worst relative loss difference from llm.c fp32 {worst:e}");
        }
    }
}
