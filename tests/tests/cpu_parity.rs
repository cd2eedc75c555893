//! The CPU target against llm.c's reference (../shared/refs/llmc-odd): 10 training losses
//! within 1e-5 and the parameters after 10 steps, with fused Cranelift kernels and GEMMs.

mod common;

use fusec_ir::testkit::max_abs_diff;
use fusec_models::build_gpt2;
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
