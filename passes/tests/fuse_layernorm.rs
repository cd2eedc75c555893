//! `fuse-layernorm`: on GPT-2 tiny every LayerNorm and the cross-entropy fuse and the loss and
//! the whole training step's gradients match the unfused graph; each legality predicate refuses
//! its near-miss (graph unchanged, rule named in the `FusionLog`); random graphs never break it.

use std::collections::HashMap;
use std::time::Instant;

use fusec_ir::interp::{self, round_to, Precision, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::text::{parse, print};
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, Bindings, CmpOp, DType, Dim, Graph, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};
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

/// `|a - b| <= rtol * |b| + atol` everywhere; the error names the worst element.
fn assert_close(what: &str, a: &Tensor, b: &Tensor, rtol: f64, atol: f64) {
    if let Err(e) = a.check_close(b, atol, rtol) {
        panic!("{what}: {e}");
    }
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
    let mut f = interp::random_feeds(g, b, &mut Rng::new(seed), vocab).unwrap();
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
        let want = interp::run(&src, &b, &f, Precision::F32).unwrap();
        let got = interp::run(&h, &b, &f, Precision::F32).unwrap();
        assert_close(&format!("{label} loss"), &got[0], &want[0], 1e-6, 0.0);
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
    for (prec, rtol) in [(Precision::F32, 1e-5), (Precision::F64, 1e-9)] {
        let want = interp::run(&ref_step, &b, &f, prec).unwrap();
        let got = interp::run(&step, &b, &f, prec).unwrap();
        for (((name, _), x), y) in ref_step.outputs.iter().zip(&got).zip(&want) {
            // Relative to the tensor's scale: elements near zero carry the absolute error of
            // their larger neighbours (sums of products of the same terms, reassociated).
            let scale = y.data.iter().fold(0f64, |m, v| m.max(v.abs()));
            assert_close(&format!("{prec:?} {name}"), x, y, rtol, rtol * scale);
        }
    }
}

// ---- hand-built patterns ---------------------------------------------------------------------

/// Knobs that turn the builder's LayerNorm into one near miss each.
#[derive(Clone, Copy, Default)]
struct LnKnobs {
    /// Normalize over axis 0 instead of the last axis.
    first_axis: bool,
    /// Use this mean scale instead of 1/C.
    scale: Option<f64>,
    /// eps is an input rather than a constant.
    eps_input: bool,
    /// Broadcast the weight along axis 0 (the input is square).
    w_wrong_axis: bool,
    /// Also output `mean`.
    mean_escapes: bool,
    /// Use `mean` in a dead node only.
    mean_dead_use: bool,
    /// bf16 throughout.
    bf16: bool,
}

/// `y = layernorm(x)` over `x: [R, C]` from primitives, as `Builder::layernorm` emits it.
fn ln_graph(k: LnKnobs) -> Graph {
    let dt = if k.bf16 { DType::BF16 } else { DType::F32 };
    let (rows, c) = if k.w_wrong_axis { (8, 8) } else { (6, 8) };
    let (red, keep) = if k.first_axis { (0usize, 1usize) } else { (1, 0) };
    let n = if k.first_axis { rows } else { c };
    let t = |d: &[u64]| Type::new(dt, Shape::lits(d));
    let mut g = Graph::new("ln", &[]);
    let x = g.add1(Op::Param { name: "x".into(), ty: t(&[rows, c]) }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: t(&[c]) }, &[]);
    let bias = g.add1(Op::Param { name: "b".into(), ty: t(&[c]) }, &[]);
    let xs = Shape::lits(&[rows, c]);
    let stat = t(&[if k.first_axis { c } else { rows }]);
    let scale = k.scale.unwrap_or(1.0 / n as f64);
    let mean_of = |g: &mut Graph, v: ValueId| {
        let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![red] }, &[v]);
        let inv = g.add1(Op::Const { value: scale, ty: stat.clone() }, &[]);
        g.add1(Op::Binary(BinaryOp::Mul), &[s, inv])
    };
    let mean = mean_of(&mut g, x);
    let mean_b = g.add1(Op::Broadcast { dims: vec![keep], shape: xs.clone() }, &[mean]);
    let xc = g.add1(Op::Binary(BinaryOp::Sub), &[x, mean_b]);
    let sq = g.add1(Op::Binary(BinaryOp::Mul), &[xc, xc]);
    let var = mean_of(&mut g, sq);
    let eps = if k.eps_input {
        g.add1(Op::Input { name: "eps".into(), ty: g.ty(var).clone() }, &[])
    } else {
        g.add1(Op::Const { value: 1e-5, ty: g.ty(var).clone() }, &[])
    };
    let ve = g.add1(Op::Binary(BinaryOp::Add), &[var, eps]);
    let rstd = g.add1(Op::Unary(UnaryOp::Rsqrt), &[ve]);
    let rstd_b = g.add1(Op::Broadcast { dims: vec![keep], shape: xs.clone() }, &[rstd]);
    let norm = g.add1(Op::Binary(BinaryOp::Mul), &[xc, rstd_b]);
    let w_dims = if k.w_wrong_axis { vec![0] } else { vec![1] };
    let w_b = g.add1(Op::Broadcast { dims: w_dims, shape: xs.clone() }, &[w]);
    let scaled = g.add1(Op::Binary(BinaryOp::Mul), &[norm, w_b]);
    let b_b = g.add1(Op::Broadcast { dims: vec![1], shape: xs }, &[bias]);
    let y = g.add1(Op::Binary(BinaryOp::Add), &[scaled, b_b]);
    if k.mean_dead_use {
        g.add1(Op::Unary(UnaryOp::Exp), &[mean]);
    }
    g.output("y", y);
    if k.mean_escapes {
        g.output("mean", mean);
    }
    g
}

/// Runs both graphs on the same random feeds (F32) and compares every output within `rtol`
/// relative to the element and to the tensor's largest element.
fn assert_same_values(g: &Graph, h: &Graph, rtol: f64) {
    let b = Bindings::default();
    let mut f = interp::random_feeds(g, &b, &mut Rng::new(5), 4).unwrap();
    if let Some(e) = f.get_mut("eps") {
        e.data.iter_mut().for_each(|x| *x = 1e-5);
    }
    let want = interp::run(g, &b, &f, Precision::F32).unwrap();
    let got = interp::run(h, &b, &f, Precision::F32).unwrap();
    for (i, (x, y)) in got.iter().zip(&want).enumerate() {
        // An element that is a difference of larger terms (`norm * w + b` near 0) carries
        // their rounding error, so the absolute slack scales with the largest element.
        let scale = y.data.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert_close(&format!("output {i}"), x, y, rtol, rtol * scale);
    }
}

/// The pass leaves `g` as it is and names `rule` in the log.
fn assert_refused(g: &Graph, rule: &str) {
    let (h, log) = fuse(g);
    assert_eq!(print(&h), print(g), "near miss for `{rule}` was fused");
    let rules: Vec<&str> = log.of(PASS).iter().map(|r| r.rule).collect();
    assert!(rules.contains(&rule), "expected a `{rule}` refusal, got {:?}", log.refusals);
    for r in log.of(PASS) {
        assert!(r.at.starts_with('%') && !r.detail.is_empty(), "{r}");
    }
}

#[test]
fn layernorm_fires_and_matches() {
    for knobs in [LnKnobs::default(), LnKnobs { mean_dead_use: true, ..LnKnobs::default() }] {
        let g = ln_graph(knobs);
        let (h, log) = fuse(&g);
        assert!(log.refusals.is_empty(), "{:?}", log.refusals);
        assert_eq!((count(&h, "layernorm"), count(&h, "rsqrt"), count(&h, "reduce_sum")), (1, 0, 0), "{}", print(&h));
        assert!(print(&h).contains("{eps = 1e-5}"), "{}", print(&h));
        assert_same_values(&g, &h, 1e-6);
    }
}

#[test]
fn layernorm_over_a_non_last_axis_is_refused() {
    assert_refused(&ln_graph(LnKnobs { first_axis: true, ..LnKnobs::default() }), "axis-is-last");
}

#[test]
fn layernorm_with_a_wrong_mean_scale_is_refused() {
    assert_refused(&ln_graph(LnKnobs { scale: Some(1.0 / 7.0), ..LnKnobs::default() }), "mean-scale-matches-width");
}

#[test]
fn layernorm_with_a_variable_eps_is_refused() {
    assert_refused(&ln_graph(LnKnobs { eps_input: true, ..LnKnobs::default() }), "eps-constant");
}

#[test]
fn layernorm_with_the_weight_on_the_wrong_axis_is_refused() {
    assert_refused(&ln_graph(LnKnobs { w_wrong_axis: true, ..LnKnobs::default() }), "broadcast-shapes");
}

#[test]
fn layernorm_whose_mean_is_used_elsewhere_is_refused() {
    assert_refused(&ln_graph(LnKnobs { mean_escapes: true, ..LnKnobs::default() }), "no-outside-uses");
}

#[test]
fn bf16_layernorm_is_refused() {
    assert_refused(&ln_graph(LnKnobs { bf16: true, ..LnKnobs::default() }), "dtype-f32");
}

/// `softmax(x)` over `axis` of `x: f32[5, 7]` from primitives.
fn softmax_graph(axis: usize) -> Graph {
    let mut g = Graph::new("sm", &[]);
    let xs = Shape::lits(&[5, 7]);
    let x = g.add1(Op::Param { name: "x".into(), ty: Type::new(DType::F32, xs.clone()) }, &[]);
    let keep = 1 - axis;
    let mx = g.add1(Op::Reduce { op: ReduceOp::Max, axes: vec![axis] }, &[x]);
    let mx_b = g.add1(Op::Broadcast { dims: vec![keep], shape: xs.clone() }, &[mx]);
    let d = g.add1(Op::Binary(BinaryOp::Sub), &[x, mx_b]);
    let e = g.add1(Op::Unary(UnaryOp::Exp), &[d]);
    let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![axis] }, &[e]);
    let s_b = g.add1(Op::Broadcast { dims: vec![keep], shape: xs }, &[s]);
    let y = g.add1(Op::Binary(BinaryOp::Div), &[e, s_b]);
    g.output("y", y);
    g
}

#[test]
fn softmax_fires_and_matches() {
    let g = softmax_graph(1);
    let (h, log) = fuse(&g);
    assert!(log.refusals.is_empty(), "{:?}", log.refusals);
    assert_eq!((count(&h, "softmax"), count(&h, "exp"), h.nodes.len()), (1, 0, 2), "{}", print(&h));
    assert_same_values(&g, &h, 1e-6);
}

#[test]
fn softmax_over_a_non_last_axis_is_refused() {
    assert_refused(&softmax_graph(0), "axis-is-last");
}

/// Per-position cross-entropy of `logits: f32[2, 3, 12]` over the columns `start..start+10`,
/// with the one-hot iota along `iota_axis`, as `Builder::mean_cross_entropy` emits it.
fn ce_graph(start: u64, iota_axis: usize) -> Graph {
    let mut g = Graph::new("ce", &[]);
    let logits = g.add1(Op::Param { name: "logits".into(), ty: Type::new(DType::F32, Shape::lits(&[2, 3, 12])) }, &[]);
    let targets = g.add1(Op::Input { name: "targets".into(), ty: Type::new(DType::I32, Shape::lits(&[2, 3])) }, &[]);
    let lv = g.add1(Op::Slice { axis: 2, start, end: start + 10 }, &[logits]);
    let ls = g.ty(lv).shape.clone();
    let mx = g.add1(Op::Reduce { op: ReduceOp::Max, axes: vec![2] }, &[lv]);
    let mx_b = g.add1(Op::Broadcast { dims: vec![0, 1], shape: ls.clone() }, &[mx]);
    let shifted = g.add1(Op::Binary(BinaryOp::Sub), &[lv, mx_b]);
    let e = g.add1(Op::Unary(UnaryOp::Exp), &[shifted]);
    let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![2] }, &[e]);
    let lse = g.add1(Op::Unary(UnaryOp::Log), &[s]);
    let ids = g.add1(Op::Iota { axis: iota_axis, ty: Type::new(DType::I32, ls.clone()) }, &[]);
    let t_b = g.add1(Op::Broadcast { dims: vec![0, 1], shape: ls.clone() }, &[targets]);
    let hit = g.add1(Op::Compare(CmpOp::Eq), &[ids, t_b]);
    let zero = g.add1(Op::Const { value: 0.0, ty: Type::new(DType::F32, ls) }, &[]);
    let picked_all = g.add1(Op::Select, &[hit, shifted, zero]);
    let picked = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![2] }, &[picked_all]);
    let loss = g.add1(Op::Binary(BinaryOp::Sub), &[lse, picked]);
    g.output("loss", loss);
    g
}

#[test]
fn cross_entropy_fires_and_matches() {
    let g = ce_graph(0, 2);
    let (h, log) = fuse(&g);
    assert!(log.refusals.is_empty(), "{:?}", log.refusals);
    assert_eq!((count(&h, "cross_entropy"), h.nodes.len()), (1, 3), "{}", print(&h));
    assert!(print(&h).contains("vocab = 10"), "{}", print(&h));
    assert_same_values(&g, &h, 1e-6);
}

#[test]
fn cross_entropy_with_a_shifted_slice_is_refused() {
    assert_refused(&ce_graph(1, 2), "slice-from-zero");
}

#[test]
fn cross_entropy_with_the_onehot_on_the_wrong_axis_is_refused() {
    assert_refused(&ce_graph(0, 1), "onehot-axis");
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
        let f = interp::random_feeds(&g, &b, &mut rng, 2).unwrap();
        let want = interp::run(&g, &b, &f, Precision::F64).unwrap();
        let scale = want[0].data.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (prec, tol) in [(Precision::F32, 1e-6), (Precision::F64, 1e-12)] {
            let got = interp::run(&h, &b, &f, prec).unwrap();
            assert_close(&format!("seed {seed} {prec:?}"), &got[0], &want[0], tol, tol * scale);
        }
    }
    assert!(fused > 100 && refused > 100, "fused {fused}, refused {refused}");
}

/// Node counts before and after each pass, and the time of each, on the shipped tiny and 124M
/// graphs (release: `cargo test --release -p fusec-passes --test fuse_layernorm -- --ignored
/// --nocapture`).
#[test]
#[ignore]
fn report_node_counts_and_times() {
    for file in ["gpt2-tiny.graph", "gpt2-124m.graph"] {
        let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
        let src = std::fs::read_to_string(&path).unwrap();
        let g = parse(&src, &path).unwrap();
        let t0 = Instant::now();
        let c = canonicalize(&g).unwrap();
        let t1 = Instant::now();
        let mut log = FusionLog::default();
        let f = fuse_layernorm(&c, &mut log).unwrap();
        let t2 = Instant::now();
        println!(
            "{file}: {} nodes -> canonicalize {} ({:.2?}) -> fuse-layernorm {} ({:.2?}); {} layernorm, {} cross_entropy, {} refusals",
            g.nodes.len(),
            c.nodes.len(),
            t1 - t0,
            f.nodes.len(),
            t2 - t1,
            count(&f, "layernorm"),
            count(&f, "cross_entropy"),
            log.refusals.len()
        );
    }
}
