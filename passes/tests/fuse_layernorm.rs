//! `fuse-layernorm`: on GPT-2 tiny (and the shipped graphs) every LayerNorm and the
//! cross-entropy fuse and the loss and the whole training step's gradients match the unfused
//! graph; every filetest input (`filetests/fuse-layernorm`, where each rule fires and refuses
//! its near misses) keeps its values; random graphs never break the pass, and random LayerNorm
//! variants fuse only when legal.

use std::collections::HashMap;

use fusec_ir::interp::{self, round_to, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::testkit::{assert_close, max_abs, random_feeds, read_graphs};
use fusec_ir::text::{parse, print};
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, Bindings, DType, Dim, Graph, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::autodiff::{autodiff, DLOSS};
use fusec_passes::canonicalize::canonicalize;
use fusec_passes::explain::FusionLog;
use fusec_passes::fuse_layernorm::{fuse_layernorm, PASS};

fn count(g: &Graph, mnemonic: &str) -> usize {
    g.nodes.iter().filter(|n| n.op.mnemonic() == mnemonic).count()
}

fn fuse(g: &Graph) -> (Graph, FusionLog) {
    let mut log = FusionLog::default();
    let h = fuse_layernorm(g, &mut log).expect("fuse_layernorm");
    verify(&h).unwrap_or_else(|e| panic!("{e}\n{}", print(&h)));
    (h, log)
}

// ---- GPT-2 tiny ----------------------------------------------------------------------------

fn tiny() -> (Gpt2Config, Graph, Bindings) {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let g = build_gpt2(&cfg, "t");
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 8);
    (cfg, g, b)
}

/// Random feeds: float tensors N(0, 0.3^2) rounded to f32 (LayerNorm weights around 1), token
/// ids below the vocabulary, `dloss = 1` and zero gradient accumulators.
fn feeds(g: &Graph, b: &Bindings, vocab: u64, seed: u64) -> HashMap<String, Tensor> {
    let mut f = random_feeds(g, b, &mut Rng::new(seed), vocab).unwrap();
    for (name, t) in f.iter_mut() {
        if t.dtype != DType::F32 {
            continue;
        }
        let is_ln_w = name.starts_with("ln") && name.contains('w');
        for x in &mut t.data {
            *x = round_to(DType::F32, if is_ln_w { 1.0 + 0.1 * *x } else { 0.3 * *x });
        }
        if name == DLOSS {
            t.data[0] = 1.0;
        } else if name.starts_with("grad.") {
            t.data.iter_mut().for_each(|x| *x = 0.0);
        }
    }
    f
}

#[test]
fn gpt2_tiny_fuses_every_layernorm_and_the_loss() {
    let (cfg, g, b) = tiny();
    for (label, src) in [("raw", g.clone()), ("canonicalized", canonicalize(&g).unwrap())] {
        let (h, log) = fuse(&src);
        assert_eq!(count(&h, "layernorm"), 2 * cfg.layers + 1, "{label}");
        assert_eq!((count(&h, "cross_entropy"), count(&h, "rsqrt"), count(&h, "softmax")), (1, 0, 0), "{label}");
        assert!(log.of(PASS).is_empty(), "{label}: {:?}", log.refusals);
        let f = feeds(&g, &b, cfg.vocab as u64, 3);
        let want = interp::run(&src, &b, &f, Rounding::F32).unwrap();
        let got = interp::run(&h, &b, &f, Rounding::F32).unwrap();
        assert_close(&format!("{label} loss"), &got[0], &want[0], 0.0, 1e-6);
        // Fusing again finds nothing: the pass is idempotent.
        assert_eq!(print(&fuse(&h).0), print(&h));
    }
}

#[test]
fn gpt2_tiny_training_step_gradients_match() {
    let (cfg, g, b) = tiny();
    let (fused, _) = fuse(&canonicalize(&g).unwrap());
    let (ref_step, step) = (autodiff(&g).unwrap(), autodiff(&fused).unwrap());
    assert_eq!((count(&step, "layernorm_grad"), count(&step, "cross_entropy_grad")), (2 * cfg.layers + 1, 1));
    let f = feeds(&ref_step, &b, cfg.vocab as u64, 11);
    for (prec, rtol) in [(Rounding::F32, 1e-5), (Rounding::F64, 1e-9)] {
        let want = interp::run(&ref_step, &b, &f, prec).unwrap();
        let got = interp::run(&step, &b, &f, prec).unwrap();
        for (((name, _), x), y) in ref_step.outputs.iter().zip(&got).zip(&want) {
            // Relative to the tensor's scale: elements near zero carry the absolute error of
            // their larger neighbours (sums of products of the same terms, reassociated).
            assert_close(&format!("{prec:?} {name}"), x, y, rtol * max_abs(&y.data), rtol);
        }
    }
}

// ---- filetest inputs -------------------------------------------------------------------------

#[test]
fn every_filetest_input_keeps_its_values() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/filetests/fuse-layernorm");
    let mut b = Bindings::default();
    b.set("V", 10);
    let files = read_graphs(std::path::Path::new(dir));
    assert!(files.len() >= 20, "{} files in {dir}", files.len());
    for (name, g) in &files {
        let (h, _) = fuse(g);
        // Targets below the vocabulary (at least 10 wide in every file); a positive eps.
        let mut f = random_feeds(g, &b, &mut Rng::new(5), 4).unwrap();
        if let Some(e) = f.get_mut("eps") {
            e.data.iter_mut().for_each(|x| *x = 1e-5);
        }
        let want = interp::run(g, &b, &f, Rounding::F32).unwrap();
        let got = interp::run(&h, &b, &f, Rounding::F32).unwrap();
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            // An element that is a difference of larger terms (`norm * w + b` near 0) carries
            // their rounding error, so the absolute slack scales with the largest element.
            assert_close(&format!("{name}, output {i}"), x, y, 1e-6 * max_abs(&y.data), 1e-6);
        }
    }
}

#[test]
fn random_graphs_never_break_the_pass() {
    let opts = GenOpts { extreme_consts: false, ..GenOpts::default() };
    for seed in 0..2000u64 {
        let g = random_graph_with(&mut Rng::new(seed), &opts);
        let mut log = FusionLog::default();
        let h = fuse_layernorm(&g, &mut log).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        verify(&h).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", print(&h)));
    }
}

/// A LayerNorm-shaped graph with random shapes (rank 1 to 3, a symbolic leading dim), operand
/// orders, reduction axis, mean scale, eps, weight axis, dtype and escaping intermediates;
/// `None` when the combination is ill-typed.
fn random_ln(rng: &mut Rng) -> Option<Graph> {
    let r = 1 + rng.below(3) as usize;
    let mut dims: Vec<Dim> = (0..r).map(|_| Dim::lit(1 + rng.below(5))).collect();
    if r > 1 && rng.chance(0.5) {
        dims[0] = Dim::sym("B");
    }
    let axis = if rng.chance(0.8) { r - 1 } else { rng.below(r as u64) as usize };
    let dt = if rng.chance(0.85) { DType::F32 } else { DType::BF16 };
    let xs = Shape::from(dims.clone());
    let keep: Vec<usize> = (0..r).filter(|&i| i != axis).collect();
    let stat = Type::new(dt, Shape::from(keep.iter().map(|&i| dims[i].clone()).collect::<Vec<_>>()));
    let n = dims[axis].as_lit().unwrap_or(2);
    let scale = if rng.chance(0.85) { 1.0 / n as f64 } else { 1.0 / (n + 1) as f64 };
    let w_axis = if rng.chance(0.85) { r - 1 } else { rng.below(r as u64) as usize };
    let mut g = Graph::new("ln", &["B"]);
    let mut op = |g: &mut Graph, o: Op, ins: &[ValueId]| -> Option<ValueId> {
        let mut ins = ins.to_vec();
        if matches!(o, Op::Binary(BinaryOp::Add | BinaryOp::Mul)) && rng.chance(0.5) {
            ins.reverse();
        }
        g.try_add(o, &ins).ok().map(|r| r[0])
    };
    let x = g.add1(Op::Param { name: "x".into(), ty: Type::new(dt, xs.clone()) }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: Type::new(dt, Shape::from(vec![dims[w_axis].clone()])) }, &[]);
    let b = g.add1(Op::Param { name: "b".into(), ty: Type::new(dt, Shape::from(vec![dims[w_axis].clone()])) }, &[]);
    let k = g.add1(Op::Const { value: scale, ty: stat.clone() }, &[]);
    let s1 = op(&mut g, Op::Reduce { op: ReduceOp::Sum, axes: vec![axis] }, &[x])?;
    let mean = op(&mut g, Op::Binary(BinaryOp::Mul), &[s1, k])?;
    let mean_b = op(&mut g, Op::Broadcast { dims: keep.clone(), shape: xs.clone() }, &[mean])?;
    let xc = op(&mut g, Op::Binary(BinaryOp::Sub), &[x, mean_b])?;
    let sq = op(&mut g, Op::Binary(BinaryOp::Mul), &[xc, xc])?;
    let s2 = op(&mut g, Op::Reduce { op: ReduceOp::Sum, axes: vec![axis] }, &[sq])?;
    let var = op(&mut g, Op::Binary(BinaryOp::Mul), &[s2, k])?;
    let eps = g.add1(Op::Const { value: 1e-5, ty: stat }, &[]);
    let ve = op(&mut g, Op::Binary(BinaryOp::Add), &[var, eps])?;
    let rstd = op(&mut g, Op::Unary(UnaryOp::Rsqrt), &[ve])?;
    let rstd_b = op(&mut g, Op::Broadcast { dims: keep, shape: xs.clone() }, &[rstd])?;
    let norm = op(&mut g, Op::Binary(BinaryOp::Mul), &[xc, rstd_b])?;
    let w_b = op(&mut g, Op::Broadcast { dims: vec![w_axis], shape: xs.clone() }, &[w])?;
    let scaled = op(&mut g, Op::Binary(BinaryOp::Mul), &[norm, w_b])?;
    let b_b = op(&mut g, Op::Broadcast { dims: vec![w_axis], shape: xs }, &[b])?;
    let y = op(&mut g, Op::Binary(BinaryOp::Add), &[scaled, b_b])?;
    g.output("y", y);
    if rng.chance(0.15) {
        let inner = [s1, mean, xc, var, rstd, norm, scaled];
        g.output("inner", inner[rng.below(inner.len() as u64) as usize]);
    }
    Some(g)
}

#[test]
fn random_layernorm_variants_fuse_only_when_legal_and_keep_values() {
    let (mut fused, mut refused) = (0, 0);
    let mut b = Bindings::default();
    b.set("B", 2);
    for seed in 0..400u64 {
        let mut rng = Rng::new(seed);
        let Some(g) = random_ln(&mut rng) else {
            continue;
        };
        let (h, log) = fuse(&g);
        if count(&h, "layernorm") == 0 {
            assert_eq!(print(&h), print(&g), "seed {seed}");
            assert_eq!(log.refusals.len(), 1, "seed {seed}: a candidate is refused once\n{}", print(&g));
            refused += 1;
            continue;
        }
        fused += 1;
        let r = g.ty(g.nodes[0].results[0]).shape.rank();
        let ln = h.nodes.iter().find(|n| n.op.mnemonic() == "layernorm").unwrap();
        assert_eq!(g.ty(ln.inputs[0]).dtype, DType::F32, "seed {seed}");
        assert!(r >= 1 && g.outputs.len() == 1, "seed {seed}: an escaping intermediate was fused");
        // The reference is the primitive graph in F64: with two near-equal elements in a row the
        // primitive f32 chain loses digits to cancellation in `x - mean` (relative error
        // ulp(x)/|x - mean|), while the composite computes the row in f64 and rounds once.
        let f = random_feeds(&g, &b, &mut rng, 2).unwrap();
        let want = interp::run(&g, &b, &f, Rounding::F64).unwrap();
        let scale = max_abs(&want[0].data);
        for (prec, tol) in [(Rounding::F32, 1e-6), (Rounding::F64, 1e-12)] {
            let got = interp::run(&h, &b, &f, prec).unwrap();
            assert_close(&format!("seed {seed} {prec:?}"), &got[0], &want[0], tol * scale, tol);
        }
    }
    assert!(fused > 100 && refused > 100, "fused {fused}, refused {refused}");
}

/// The shipped tiny and 124M graphs: after `canonicalize`, every LayerNorm (two per block and
/// the final one) and the loss fuse, nothing is refused, and the graph shrinks.
#[test]
fn shipped_graphs_fuse_every_layernorm_and_the_loss() {
    for (file, layers) in [("gpt2-tiny.graph", 2), ("gpt2-124m.graph", 12)] {
        let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
        let src = std::fs::read_to_string(&path).unwrap();
        let g = parse(&src, &path).unwrap();
        let c = canonicalize(&g).unwrap();
        let (f, log) = fuse(&c);
        assert_eq!((count(&f, "layernorm"), count(&f, "cross_entropy")), (2 * layers + 1, 1), "{file}");
        assert!(log.refusals.is_empty(), "{file}: {:?}", log.refusals);
        assert!(f.nodes.len() < c.nodes.len() && c.nodes.len() <= g.nodes.len(), "{file}");
    }
}
