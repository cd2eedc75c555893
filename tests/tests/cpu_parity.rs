//! The CPU target against llm.c's reference (../shared/refs/llmc-odd): 10 training losses
//! within 1e-5 and the parameters after 10 steps, with fused Cranelift kernels and GEMMs; in
//! bf16, every loss within 2e-2 of llm.c's fp32 losses and 1e-3 of the interpreter's on the
//! same programs, on each bf16 product path.

mod common;

use fusec_codegen_cpu::isa::Isa;
use fusec_ir::interp::Rounding;
use fusec_ir::testkit::max_abs_diff;
use fusec_models::build_gpt2;
use fusec_passes::amp::Precision;
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::data::DataLoader;
use fusec_runtime::executor::Executor;
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::tokens::read_tokens;
use fusec_runtime::train::{eval_loss, init_state, train, TrainConfig};

const B: usize = 3;
const T: usize = 48;

#[test]
fn cpu_matches_llmc_for_ten_steps() {
    let Some(dir) = common::llmc_odd() else { return };
    let json = common::reference_json(&dir);
    let ckpt = Checkpoint::read(&dir.join("gpt2_odd_s4242.bin")).unwrap();
    let cfg = ckpt.config;
    let fwd = build_gpt2(&cfg, "gpt2_odd");
    for threads in [1, 2] {
        let (mut ex, step) = common::cpu_executor(&fwd, B, T, threads);
        init_state(&mut ex, &step, &params_from_checkpoint(&fwd, &ckpt).unwrap()).unwrap();
        let val = DataLoader::new(read_tokens(&dir.join("tokens_val_s12.bin")).unwrap(), B, T).unwrap();
        let v = eval_loss(&mut ex, &val, 4, B, T).unwrap();
        let want_val = json["val_loss_before_step0"].as_f64().unwrap();
        assert!((v - want_val).abs() <= 1e-5, "val loss {v} vs llm.c {want_val}");
        let data = DataLoader::new(read_tokens(&dir.join("tokens_train_s11.bin")).unwrap(), B, T).unwrap();
        let tc = TrainConfig::new(B, T, 10, 1e-3);
        let logs = train(&mut ex, &tc, &data, None, |_| {}).unwrap();
        let mut worst_loss = 0f64;
        for (log, want) in logs.iter().zip(json["losses"].as_array().unwrap()) {
            let want = want.as_f64().unwrap();
            worst_loss = worst_loss.max((log.loss - want).abs());
            assert!((log.loss - want).abs() <= 1e-5, "threads {threads}, step {}: loss {} vs llm.c {want}", log.step, log.loss);
        }
        let reference = common::read_f32s(&dir.join("params_step10.f32"));
        let (mut offset, mut worst) = (0, 0f64);
        for (name, shape, _) in ckpt.named_tensors() {
            let n: usize = shape.iter().product();
            worst = worst.max(max_abs_diff(&ex.get(&name).unwrap().to_f32(), &reference[offset..offset + n]));
            offset += n;
        }
        eprintln!("cpu, {threads} thread(s): worst loss difference {worst_loss:e}, params after 10 steps max abs difference {worst:e}");
        assert!(worst <= 1e-5, "params after 10 steps differ by {worst}");
    }
}

#[test]
fn cpu_bf16_stays_within_2e_2_of_llmc_fp32_losses() {
    // The numerics target of `--precision bf16` (and `bf16+residual`), as
    // `llmc_parity::ten_bf16_steps_stay_within_2e_2_of_llmc_fp32_losses` checks it on the
    // interpreter; and the CPU's losses within 1e-3 of the interpreter's on the same fused
    // programs (f32 accumulation order, a bf16 rounding that falls the other way).
    let Some(dir) = common::llmc_odd() else { return };
    let json = common::reference_json(&dir);
    let ckpt = Checkpoint::read(&dir.join("gpt2_odd_s4242.bin")).unwrap();
    let fwd = build_gpt2(&ckpt.config, "gpt2_odd");
    let data = DataLoader::new(read_tokens(&dir.join("tokens_train_s11.bin")).unwrap(), B, T).unwrap();
    let tc = TrainConfig::new(B, T, 10, json["lr"].as_f64().unwrap() as f32);
    let params = params_from_checkpoint(&fwd, &ckpt).unwrap();
    let mut paths = vec![if Isa::Avx2.supported() { Isa::Avx2 } else { Isa::Scalar }];
    if Isa::Avx512Bf16.supported() {
        paths.push(Isa::Avx512Bf16);
    } else {
        fusec_ir::testkit::skip("llm.c parity of bf16 dot products", "this host has no AVX512-BF16 (the widened path is tested)");
    }
    if Isa::Amx.supported() {
        paths.push(Isa::Amx);
    } else {
        fusec_ir::testkit::not_on_this_host("llm.c parity of bf16 products on AMX tiles", "this host has no AMX");
    }
    for precision in [Precision::Bf16, Precision::Bf16Residual] {
        let opts = PipelineOptions { precision, ..PipelineOptions::default() };
        let (mut reference, step) = common::ref_executor(&fwd, &opts, B, T, Rounding::F32);
        init_state(&mut reference, &step, &params).unwrap();
        let want = train(&mut reference, &tc, &data, None, |_| {}).unwrap();
        for &isa in &paths {
            let (mut ex, step) = common::cpu_executor_with(&fwd, &opts, B, T, 2, isa);
            init_state(&mut ex, &step, &params).unwrap();
            let logs = train(&mut ex, &tc, &data, None, |_| {}).unwrap();
            let (mut worst_llmc, mut worst_ref) = (0f64, 0f64);
            for ((log, llmc), interp) in logs.iter().zip(json["losses"].as_array().unwrap()).zip(&want) {
                let (llmc, interp) = (llmc.as_f64().unwrap(), interp.loss);
                let (a, b) = ((log.loss - llmc).abs() / llmc, (log.loss - interp).abs() / interp);
                assert!(a <= 2e-2, "{precision:?} {isa:?}: step {} loss {} vs llm.c {llmc} ({a:e})", log.step, log.loss);
                assert!(b <= 1e-3, "{precision:?} {isa:?}: step {} loss {} vs the interpreter's {interp} ({b:e})", log.step, log.loss);
                (worst_llmc, worst_ref) = (worst_llmc.max(a), worst_ref.max(b));
            }
            assert_eq!(logs.len(), 10);
            eprintln!(
                "{precision:?} {isa:?}: worst relative loss difference from llm.c fp32 {worst_llmc:e}, from the interpreter {worst_ref:e}"
            );
        }
    }
}
