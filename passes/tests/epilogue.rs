//! `fuse-epilogue`, `fuse-grad-accum` and `amp` keep values: on every filetest input of the two
//! fusion passes (`filetests/fuse-epilogue`, `filetests/fuse-grad-accum`, where each rule fires
//! and refuses its near misses), through autodiff, and on GPT-2 training graphs.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::{assert_outputs_close, random_feeds, read_graphs};
use fusec_ir::{Bindings, DType, Graph, Op};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::amp::{amp, Precision as Policy};
use fusec_passes::autodiff::autodiff;
use fusec_passes::explain::FusionLog;
use fusec_passes::fuse_epilogue::fuse_epilogue;
use fusec_passes::fuse_grad_accum::fuse_grad_accum;
use fusec_passes::optimizer::{optimizer, AdamWConfig};

fn bind() -> Bindings {
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 8);
    b
}

/// Random feeds with valid optimizer state: `v.*` non-negative, bias corrections in (0, 1].
fn feeds(g: &Graph, seed: u64, int_hi: u64) -> HashMap<String, Tensor> {
    let mut f = random_feeds(g, &bind(), &mut Rng::new(seed), int_hi).unwrap();
    for (name, t) in f.iter_mut() {
        match name.as_str() {
            "lr" => t.data[0] = 1e-3,
            "bc1" => t.data[0] = 0.1,
            "bc2" => t.data[0] = 0.001,
            n if n.starts_with("v.") => t.data.iter_mut().for_each(|x| *x = x.abs()),
            _ => {}
        }
    }
    f
}

fn outputs(g: &Graph, f: &HashMap<String, Tensor>) -> Vec<Tensor> {
    interp::run(g, &bind(), f, Rounding::F32).unwrap()
}

fn count(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.nodes.iter().filter(|n| pred(&n.op)).count()
}

/// The filetest input `file` of `pass`.
fn filetest(pass: &str, file: &str) -> Graph {
    let path = format!("{}/tests/filetests/{pass}/{file}", env!("CARGO_MANIFEST_DIR"));
    fusec_ir::text::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap()
}

#[test]
fn every_filetest_input_keeps_its_values_exactly() {
    type Pass = fn(&Graph, &mut FusionLog) -> Result<Graph, String>;
    let passes: [(&str, Pass); 2] = [("fuse-epilogue", fuse_epilogue), ("fuse-grad-accum", fuse_grad_accum)];
    for (pass, run) in passes {
        let dir = format!("{}/tests/filetests/{pass}", env!("CARGO_MANIFEST_DIR"));
        let files = read_graphs(std::path::Path::new(&dir));
        assert!(files.len() >= 5, "{} files in {dir}", files.len());
        for (name, g) in &files {
            let fused = run(g, &mut FusionLog::default()).unwrap();
            let f = feeds(g, 1, 1);
            assert_outputs_close(name, &outputs(&fused, &f), &outputs(g, &f), 0.0, 0.0);
        }
    }
}

#[test]
fn gelu_epilogue_keeps_the_values_of_the_backward() {
    // The backward reads the pre-GELU value, which becomes the gemm's second result.
    let train = autodiff(&filetest("fuse-epilogue", "bias-gelu-fires.graph")).unwrap();
    let fused = fuse_epilogue(&train, &mut FusionLog::default()).unwrap();
    assert_eq!(count(&fused, |o| matches!(o, Op::Gemm(gm) if gm.gelu)), 1);
    let f = feeds(&train, 2, 1);
    assert_outputs_close("training graph", &outputs(&fused, &f), &outputs(&train, &f), 0.0, 0.0);
}

fn tiny_train() -> (Graph, u64) {
    let cfg = Gpt2Config { layers: 2, heads: 2, channels: 16, vocab: 30, padded_vocab: 32, max_seq: 8 };
    let g = optimizer(&autodiff(&build_gpt2(&cfg, "t")).unwrap(), &AdamWConfig::default()).unwrap();
    (g, cfg.vocab as u64)
}

#[test]
fn weight_gradients_accumulate_in_place_into_the_matmul() {
    let (g, vocab) = tiny_train();
    let mut log = FusionLog::default();
    let e = fuse_epilogue(&g, &mut log).unwrap();
    let fused = fuse_grad_accum(&e, &mut log).unwrap();
    // Every weight matrix's gradient (4 per block and the tied LM head) is a beta = 1 gemm.
    assert_eq!(count(&fused, |o| matches!(o, Op::Gemm(gm) if gm.accumulate)), 4 * 2 + 1);
    let f = feeds(&g, 3, vocab);
    assert_outputs_close("training step", &outputs(&fused, &f), &outputs(&g, &f), 0.0, 0.0);
    assert!(fusec_ir::verify::verify(&fused).is_ok());
}

#[test]
fn amp_casts_matmul_operands_once_and_keeps_the_rest_f32() {
    let (g, vocab) = tiny_train();
    let mixed = amp(&g, Policy::Bf16).unwrap();
    assert!(fusec_ir::verify::verify(&mixed).is_ok());
    let matmuls = count(&g, |o| matches!(o, Op::MatMul { .. }));
    assert_eq!(count(&mixed, |o| matches!(o, Op::MatMul { .. })), matmuls);
    for n in mixed.nodes.iter().filter(|n| matches!(n.op, Op::MatMul { .. })) {
        assert_eq!(mixed.ty(n.results[0]).dtype, DType::BF16);
    }
    for n in mixed.nodes.iter().filter(|n| matches!(n.op, Op::LayerNorm { .. } | Op::Attention { .. } | Op::AdamW { .. })) {
        assert_eq!(mixed.ty(n.results[0]).dtype, DType::F32);
    }
    // One cast per value: no value is cast to bf16 twice.
    let mut seen = std::collections::HashSet::new();
    for n in mixed.nodes.iter().filter(|n| n.op == Op::Cast { to: DType::BF16 }) {
        assert!(seen.insert(n.inputs[0]), "value cast twice");
    }
    // bf16 tolerance on the loss; the policy is off by default.
    let f = feeds(&g, 4, vocab);
    let (a, b) = (outputs(&mixed, &f), outputs(&g, &f));
    assert!((a[0].data[0] - b[0].data[0]).abs() <= 1e-2 * b[0].data[0].abs());
    assert_eq!(amp(&g, Policy::F32).unwrap(), g);
    // Casts of products become the gemm's out dtype.
    let mut log = FusionLog::default();
    let fused = fuse_epilogue(&mixed, &mut log).unwrap();
    assert!(count(&fused, |o| matches!(o, Op::Gemm(gm) if gm.out == DType::F32)) > 0);
    assert_outputs_close("bf16 training step", &outputs(&fused, &f), &a, 0.0, 0.0);
}
