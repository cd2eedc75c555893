//! The cached decoder (`RunPrograms::decoder`, `Decoder`) against the interpreter's whole
//! forward: its logits equal the full forward's at every position, on the interpreter (`ref`)
//! and the CPU target, for random small GPT-2s, after prefills of several lengths. The CUDA
//! version is `cuda_decoder.rs` (`--ignored`, on a GPU).

mod decoder_common;

use decoder_common::*;
use fusec_ir::interp::Rounding;
use fusec_ir::rng::Rng;
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::executor::RefExecutor;
use fusec_runtime::programs::RunPrograms;

#[test]
fn cached_logits_equal_the_full_forward_at_every_position_on_the_interpreter() {
    let mut rng = Rng::new(17);
    for case in 0..3 {
        let Case { cfg, params, tokens, full } = random_case(&mut rng, 100 + case);
        let opts = PipelineOptions { no_fusion: true, ..PipelineOptions::default() };
        for p in [1, 3] {
            let run = RunPrograms::decoder(&cfg, p, &opts).unwrap();
            let mut d = decoder(Box::new(RefExecutor::new(&run, Rounding::F32)), &cfg, p, &params);
            check_positions(&format!("ref {cfg}"), &mut d, &cfg, &tokens, p, &full);
        }
    }
}

#[test]
fn cached_logits_equal_the_full_forward_at_every_position_on_the_cpu() {
    let mut rng = Rng::new(23);
    for case in 0..4 {
        let Case { cfg, params, tokens, full } = random_case(&mut rng, 200 + case);
        let opts = PipelineOptions::default();
        for p in [1, 2, cfg.max_seq / 2, cfg.max_seq] {
            let run = RunPrograms::decoder(&cfg, p, &opts).unwrap();
            let (ex, _) = CpuExecutor::new(&run, 2, false).unwrap();
            let mut d = decoder(Box::new(ex), &cfg, p, &params);
            check_positions(&format!("cpu {cfg}"), &mut d, &cfg, &tokens, p, &full);
            // The same decoder again from an empty cache: nothing is left from the first pass.
            check_positions(&format!("cpu {cfg}, second prompt"), &mut d, &cfg, &tokens, p, &full);
        }
    }
}

#[test]
fn a_full_cache_is_an_error_not_a_wrap_around() {
    let mut rng = Rng::new(5);
    let cfg = random_config(&mut rng);
    let params = random_params(&cfg, 9);
    let run = RunPrograms::decoder(&cfg, 1, &PipelineOptions::default()).unwrap();
    let (ex, _) = CpuExecutor::new(&run, 1, false).unwrap();
    let mut d = decoder(Box::new(ex), &cfg, 1, &params);
    d.prefill(&[0]).unwrap();
    for _ in 1..cfg.max_seq {
        d.step(1).unwrap();
    }
    assert!(d.step(1).unwrap_err().contains("cache is full"));
    assert!(d.prefill(&vec![0; cfg.max_seq + 1]).unwrap_err().contains(&format!("1..={}", cfg.max_seq)));
    assert!(d.prefill(&[cfg.vocab as u16]).unwrap_err().contains("outside the vocabulary"));
}
