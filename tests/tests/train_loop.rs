//! The training loop on the interpreter: gradient accumulation, divergence, JSON logs.

mod common;

use fusec_ir::interp::Rounding;
use fusec_ir::rng::Rng;
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::random_init;
use fusec_runtime::data::DataLoader;
use fusec_runtime::executor::Executor;
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::train::{init_state, train, StepLog, TrainConfig};

fn model() -> Gpt2Config {
    Gpt2Config { layers: 2, heads: 2, channels: 16, vocab: 37, padded_vocab: 40, max_seq: 16 }
}

fn tokens(n: usize, seed: u64) -> Vec<u16> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.below(37) as u16).collect()
}

fn config(batch: usize, steps: usize, grad_accum: usize) -> TrainConfig {
    TrainConfig { grad_accum, val_batches: 1, ..TrainConfig::new(batch, 8, steps, 1e-2) }
}

/// Trains and returns the logs and the final parameters.
fn run(cfg: &TrainConfig, nan_param: bool) -> Result<(Vec<StepLog>, Vec<Vec<f32>>), String> {
    let gcfg = model();
    let fwd = build_gpt2(&gcfg, "t");
    let (mut ex, step) = common::ref_executor(&fwd, &PipelineOptions::default(), cfg.batch, cfg.seq, Rounding::F32);
    let mut params = params_from_checkpoint(&fwd, &random_init(&gcfg, 7).unwrap()).unwrap();
    if nan_param {
        params.get_mut("lnfw").unwrap().data[3] = f64::NAN;
    }
    init_state(&mut ex, &step, &params).unwrap();
    let data = DataLoader::new(tokens(4000, 3), cfg.batch, cfg.seq).unwrap();
    let logs = train(&mut ex, cfg, &data, None, |_| {})?;
    let finals = fwd.params().iter().map(|(n, _)| ex.get(n).unwrap().to_f32()).collect();
    Ok((logs, finals))
}

#[test]
fn k_micro_steps_of_batch_b_equal_one_step_of_batch_kb() {
    let (big, p_big) = run(&config(4, 3, 1), false).unwrap();
    let (small, p_small) = run(&config(2, 3, 2), false).unwrap();
    for (a, b) in big.iter().zip(&small) {
        assert!((a.loss - b.loss).abs() <= 1e-5 * a.loss.abs(), "step {}: loss {} vs {}", a.step, a.loss, b.loss);
    }
    for (pa, pb) in p_big.iter().zip(&p_small) {
        for (x, y) in pa.iter().zip(pb) {
            assert!((x - y).abs() <= 1e-5 + 1e-4 * x.abs(), "parameters differ: {x} vs {y}");
        }
    }
    assert!(big[2].loss < big[0].loss, "loss should fall: {:?}", big.iter().map(|l| l.loss).collect::<Vec<_>>());
}

#[test]
fn nan_loss_stops_the_run_naming_the_step() {
    let err = run(&config(2, 3, 1), true).unwrap_err();
    // 1-based, as the progress shows steps: the first step diverged.
    assert!(err.contains("at step 1 ") && err.contains("NaN"), "{err}");
}

#[test]
fn json_log_has_one_object_per_step() {
    let path = std::env::temp_dir().join(format!("fusec-log-{}.jsonl", std::process::id()));
    let mut cfg = config(2, 3, 1);
    cfg.log_json = Some(path.clone());
    let (logs, _) = run(&cfg, false).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    for (l, rec) in lines.iter().zip(&logs) {
        assert_eq!(l["step"].as_u64().unwrap() as usize, rec.step);
        assert!((l["loss"].as_f64().unwrap() - rec.loss).abs() < 1e-12);
        assert!(l["lr"].as_f64().is_some() && l["ms"].as_f64().is_some());
        assert_eq!(l["tokens"].as_u64().unwrap() as usize, (rec.step + 1) * cfg.batch * cfg.seq, "tokens through this step");
    }
    let _ = std::fs::remove_file(path);
}

#[test]
fn three_fused_steps_agree_with_unfused_steps() {
    let gcfg = model();
    let fwd = build_gpt2(&gcfg, "t");
    let cfg = config(2, 3, 1);
    let data = DataLoader::new(tokens(4000, 5), cfg.batch, cfg.seq).unwrap();
    let mut finals = vec![];
    for opts in [common::unfused(), PipelineOptions::default()] {
        let (mut ex, step) = common::ref_executor(&fwd, &opts, cfg.batch, cfg.seq, Rounding::F32);
        init_state(&mut ex, &step, &params_from_checkpoint(&fwd, &random_init(&gcfg, 9).unwrap()).unwrap()).unwrap();
        let logs = train(&mut ex, &cfg, &data, None, |_| {}).unwrap();
        let params: Vec<Vec<f32>> = fwd.params().iter().map(|(n, _)| ex.get(n).unwrap().to_f32()).collect();
        finals.push((logs, params));
    }
    let ((la, pa), (lb, pb)) = (&finals[0], &finals[1]);
    for (a, b) in la.iter().zip(lb) {
        assert!((a.loss - b.loss).abs() <= 1e-6 * a.loss.abs(), "step {}: unfused {} fused {}", a.step, a.loss, b.loss);
    }
    // Adam divides by sqrt(v): a gradient that is rounding noise (the key part of qkvb has a
    // true gradient of exactly 0) becomes an update of up to lr in either direction. The floor
    // is 1% of one step (lr = 1e-2); a real mistake moves parameters by about lr.
    for (x, y) in pa.iter().flatten().zip(pb.iter().flatten()) {
        assert!((x - y).abs() <= 1e-4 + 1e-5 * x.abs(), "parameters differ: {x} vs {y}");
    }
}

#[test]
fn an_exploding_loss_stops_the_run_unless_the_check_is_off() {
    // lr 1e6 sends the loss far above its start at step 2 (finite: only the factor sees it).
    let exploding = TrainConfig { lr: 1e6, divergence_factor: Some(10.0), ..config(2, 4, 1) };
    let err = run(&exploding, false).unwrap_err();
    assert!(err.contains("more than 10x the first step's") && err.contains("at step 2"), "{err}");
    let unchecked = TrainConfig { divergence_factor: None, ..exploding };
    match run(&unchecked, false) {
        Ok((logs, _)) => assert!(logs[1].loss > 10.0 * logs[0].loss, "{logs:?}"),
        Err(e) => assert!(e.contains("NaN") || e.contains("inf"), "only a non-finite loss may stop it: {e}"),
    }
}
