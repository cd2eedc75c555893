//! `fuse-epilogue`, `fuse-grad-accum` and `amp`: each rule fires and keeps values, and refuses
//! near-misses with a named predicate.

use std::collections::HashMap;

use fusec_ir::interp::{self, random_feeds, Precision, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::{BinaryOp, Bindings, DType, Graph, Op, ReduceOp, Shape, Type, ValueId};
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
    interp::run(g, &bind(), f, Precision::F32).unwrap()
}

fn count(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.nodes.iter().filter(|n| pred(&n.op)).count()
}

fn assert_same(a: &[Tensor], b: &[Tensor], rtol: f64) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        x.check_close(y, 1e-30, rtol).unwrap();
    }
}

/// `gelu(x @ w^T + b)` plus an optional extra reader of the matmul result.
fn mlp(extra_reader: bool, bias_axis_last: bool) -> Graph {
    let mut g = Graph::new("mlp", &[]);
    let f = |d: &[u64]| Type::new(DType::F32, Shape::lits(d));
    let x = g.add1(Op::Param { name: "x".into(), ty: f(&[4, 3, 5]) }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: f(&[6, 5]) }, &[]);
    let y = g.add1(Op::MatMul { trans_a: false, trans_b: true }, &[x, w]);
    let b = if bias_axis_last {
        let b = g.add1(Op::Param { name: "b".into(), ty: f(&[6]) }, &[]);
        g.add1(Op::Broadcast { dims: vec![2], shape: Shape::lits(&[4, 3, 6]) }, &[b])
    } else {
        let b = g.add1(Op::Param { name: "b".into(), ty: f(&[3]) }, &[]);
        g.add1(Op::Broadcast { dims: vec![1], shape: Shape::lits(&[4, 3, 6]) }, &[b])
    };
    let z = g.add1(Op::Binary(BinaryOp::Add), &[y, b]);
    let a = g.add1(Op::Gelu, &[z]);
    let mut loss = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1, 2] }, &[a]);
    if extra_reader {
        let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1, 2] }, &[y]);
        loss = g.add1(Op::Binary(BinaryOp::Add), &[loss, s]);
    }
    g.output("loss", loss);
    g
}

#[test]
fn bias_and_gelu_fold_into_the_matmul_and_keep_values() {
    let g = mlp(false, true);
    let mut log = FusionLog::default();
    let fused = fuse_epilogue(&g, &mut log).unwrap();
    assert_eq!(count(&fused, |o| matches!(o, Op::Gemm(gm) if gm.bias && gm.gelu)), 1);
    assert_eq!(count(&fused, |o| matches!(o, Op::MatMul { .. } | Op::Gelu)), 0);
    let f = feeds(&g, 1, 1);
    assert_same(&outputs(&fused, &f), &outputs(&g, &f), 0.0);
    // Through autodiff: the backward reads the pre-GELU value, now the gemm's second result.
    let train = autodiff(&g).unwrap();
    let fused = fuse_epilogue(&train, &mut log).unwrap();
    assert_eq!(count(&fused, |o| matches!(o, Op::Gemm(gm) if gm.gelu)), 1);
    let f = feeds(&train, 2, 1);
    assert_same(&outputs(&fused, &f), &outputs(&train, &f), 0.0);
}

#[test]
fn bias_on_the_wrong_axis_or_a_shared_product_is_refused() {
    for (g, rule) in [(mlp(false, false), "bias-is-row-vector"), (mlp(true, true), "bias-is-row-vector")] {
        let mut log = FusionLog::default();
        let fused = fuse_epilogue(&g, &mut log).unwrap();
        assert_eq!(count(&fused, |o| matches!(o, Op::Gemm(_))), 0, "{}", fusec_ir::text::print(&fused));
        assert!(log.refusals.iter().any(|r| r.rule == rule), "{:?}", log.refusals);
    }
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
    assert_same(&outputs(&fused, &f), &outputs(&g, &f), 0.0);
    assert!(fusec_ir::verify::verify(&fused).is_ok());
}

#[test]
fn accumulator_read_elsewhere_is_refused() {
    let mut g = Graph::new("acc", &[]);
    let f = |d: &[u64]| Type::new(DType::F32, Shape::lits(d));
    let a = g.add1(Op::Param { name: "a".into(), ty: f(&[3, 4]) }, &[]);
    let b = g.add1(Op::Param { name: "b".into(), ty: f(&[4, 5]) }, &[]);
    let acc = g.add1(Op::Input { name: "grad.w".into(), ty: f(&[3, 5]) }, &[]);
    let p = g.add1(Op::MatMul { trans_a: false, trans_b: false }, &[a, b]);
    let s = g.add1(Op::Binary(BinaryOp::Add), &[acc, p]);
    let peek: ValueId = g.add1(Op::Unary(fusec_ir::UnaryOp::Exp), &[acc]);
    g.output("grad.w", s);
    g.output("peek", peek);
    let mut log = FusionLog::default();
    let fused = fuse_grad_accum(&g, &mut log).unwrap();
    assert_eq!(count(&fused, |o| matches!(o, Op::Gemm(_))), 0);
    assert!(log.refusals.iter().any(|r| r.rule == "acc-has-other-users"), "{:?}", log.refusals);
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
    assert_same(&outputs(&fused, &f), &a, 0.0);
}
