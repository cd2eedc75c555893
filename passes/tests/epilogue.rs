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
fn amp_follows_its_policy_table() {
    let (g, vocab) = tiny_train();
    let mixed = amp(&g, Policy::Bf16).unwrap();
    assert!(fusec_ir::verify::verify(&mixed).is_ok());
    // Products are bf16; the parameter gradients (4 matrices per block and the tied LM head,
    // accumulated into f32) are f32 gemms: f32 accumulation, never rounded to bf16.
    let matmuls = count(&g, |o| matches!(o, Op::MatMul { .. }));
    let f32_gemms = count(&mixed, |o| matches!(o, Op::Gemm(gm) if gm.out == DType::F32 && !gm.bias && !gm.accumulate));
    assert_eq!(count(&mixed, |o| matches!(o, Op::MatMul { .. })) + f32_gemms, matmuls);
    assert_eq!(f32_gemms, 4 * 2 + 1);
    for n in mixed.nodes.iter().filter(|n| matches!(n.op, Op::MatMul { .. })) {
        assert_eq!(mixed.ty(n.results[0]).dtype, DType::BF16);
    }
    // Statistics, the loss and the optimizer are f32; attention's tensors bf16, its lse f32.
    for n in &mixed.nodes {
        let d = |i: usize| mixed.ty(n.results[i]).dtype;
        match n.op {
            Op::LayerNorm { .. } | Op::LayerNormGrad | Op::CrossEntropy { .. } | Op::Reduce { .. } => {
                assert!(n.results.iter().all(|&r| mixed.ty(r).dtype == DType::F32), "{}", n.op.mnemonic())
            }
            // Master weights and moments f32; an update whose weights the products read writes
            // their bf16 copy too.
            Op::AdamW { .. } => {
                assert_eq!((d(0), d(1), d(2)), (DType::F32, DType::F32, DType::F32));
                if let Some(&copy) = n.results.get(3) {
                    assert_eq!(mixed.ty(copy).dtype, DType::BF16);
                    assert!(mixed.outputs.iter().any(|(name, v)| *v == copy && name.starts_with("bf16.")));
                }
            }
            Op::Attention { .. } => assert_eq!((d(0), d(1)), (DType::BF16, DType::F32), "{}", fusec_ir::text::print(&mixed)),
            Op::AttentionGrad { .. } | Op::Gelu | Op::GeluGrad => assert_eq!(d(0), DType::BF16, "{}", n.op.mnemonic()),
            _ => {}
        }
    }
    // The step casts no weight: the products read the copies AdamW writes.
    assert_eq!(count(&mixed, |o| matches!(o, Op::AdamW { .. })), count(&g, |o| matches!(o, Op::AdamW { .. })));
    assert!(mixed.nodes.iter().all(|n| n.op != Op::Cast { to: DType::BF16 } || !matches!(mixed.producer(n.inputs[0]).op, Op::Param { .. })));
    // One cast per value: no value is narrowed twice.
    let mut seen = std::collections::HashSet::new();
    for n in mixed.nodes.iter().filter(|n| n.op == Op::Cast { to: DType::BF16 }) {
        assert!(seen.insert(n.inputs[0]), "value cast twice");
    }
    // Outputs keep their dtypes; bf16 tolerance on the loss; the policy is off by default.
    for ((_, a), (_, b)) in mixed.outputs.iter().zip(&g.outputs) {
        assert_eq!(mixed.ty(*a).dtype, g.ty(*b).dtype);
    }
    let f = feeds(&g, 4, vocab);
    // The bf16 weight copies hold the rounded parameters (what the runtime's init_state sets).
    let mut fm = f.clone();
    for (name, t) in &f {
        if mixed.inputs().iter().any(|(n, _)| *n == format!("bf16.{name}")) {
            let data = t.data.iter().map(|&x| interp::round_to(DType::BF16, x)).collect();
            fm.insert(format!("bf16.{name}"), Tensor { dtype: DType::BF16, shape: t.shape.clone(), data });
        }
    }
    let (a, b) = (outputs(&mixed, &fm), outputs(&g, &f));
    assert!((a[0].data[0] - b[0].data[0]).abs() <= 1e-2 * b[0].data[0].abs());
    assert_eq!(amp(&g, Policy::F32).unwrap(), g);
    // Bias adds and GELU on bf16 products become bf16 gemm epilogues; the fused step rounds
    // once per gemm instead of once per op, so it agrees to bf16 precision.
    let mut log = FusionLog::default();
    let fused = fuse_epilogue(&mixed, &mut log).unwrap();
    assert!(count(&fused, |o| matches!(o, Op::Gemm(gm) if gm.out == DType::BF16 && gm.bias && gm.gelu)) > 0);
    assert!(count(&fused, |o| matches!(o, Op::Gemm(gm) if gm.out == DType::F32)) > 0);
    let loss = |o: &[fusec_ir::interp::Tensor]| o[0].data[0];
    let (lf, lm) = (loss(&outputs(&fused, &fm)), loss(&a));
    assert!((lf - lm).abs() <= 1e-2 * lm.abs(), "fused loss {lf} vs unfused {lm}");
}
