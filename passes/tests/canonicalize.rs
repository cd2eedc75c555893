//! `canonicalize`: each rule fires on a small graph and keeps the interpreter's outputs bit for
//! bit; rules that would be wrong under IEEE (`x * 0`, `x + 0.0`) do not fire; on random graphs
//! the result verifies and computes the same outputs, and the pass is idempotent.

use std::collections::HashMap;

use fusec_ir::interp::{self, Precision, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::text::print;
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, Bindings, CmpOp, DType, Dim, Graph, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::canonicalize::canonicalize;

fn f32t(d: &[u64]) -> Type {
    Type::new(DType::F32, Shape::lits(d))
}

fn count(g: &Graph, mnemonic: &str) -> usize {
    g.nodes.iter().filter(|n| n.op.mnemonic() == mnemonic).count()
}

fn konst(g: &mut Graph, value: f64, ty: &Type) -> ValueId {
    g.add1(Op::Const { value, ty: ty.clone() }, &[])
}

fn bin(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
    g.add1(Op::Binary(op), &[a, b])
}

fn bindings() -> Bindings {
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 3).set("N", 2);
    b
}

/// Both graphs' outputs on the same random feeds (F32), plus `extra` feeds overriding them.
fn run_pair(g: &Graph, h: &Graph, seed: u64, extra: &[(&str, Tensor)]) -> Result<(Vec<Tensor>, Vec<Tensor>), String> {
    let b = bindings();
    let mut feeds = interp::random_feeds(g, &b, &mut Rng::new(seed), 2)?;
    for (k, t) in extra {
        feeds.insert(k.to_string(), t.clone());
    }
    let before = interp::run(g, &b, &feeds, Precision::F32).map_err(|e| format!("before: {e}"))?;
    let after = interp::run(h, &b, &feeds, Precision::F32).map_err(|e| format!("after: {e}\n{}", print(h)))?;
    Ok((before, after))
}

/// Canonicalizes `g`, checks that the result verifies and gives bit-identical outputs, and
/// returns it.
fn canon_exact(g: &Graph, extra: &[(&str, Tensor)]) -> Graph {
    verify(g).expect("test graph verifies");
    let h = canonicalize(g).expect("canonicalize");
    verify(&h).unwrap_or_else(|e| panic!("{e}\n{}", print(&h)));
    let (a, b) = run_pair(g, &h, 7, extra).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.dtype, &x.shape), (y.dtype, &y.shape));
        for (p, q) in x.data.iter().zip(&y.data) {
            assert!(p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()), "{p} vs {q}\n{}\n{}", print(g), print(&h));
        }
    }
    h
}

/// `x: f32[4, 3]` as a parameter.
fn with_x(name: &str) -> (Graph, ValueId) {
    let mut g = Graph::new(name, &[]);
    let x = g.add1(Op::Param { name: "x".into(), ty: f32t(&[4, 3]) }, &[]);
    (g, x)
}

#[test]
fn dce_removes_dead_nodes_and_keeps_the_interface() {
    let (mut g, x) = with_x("dce");
    let _unused = g.add1(Op::Input { name: "unused".into(), ty: f32t(&[2]) }, &[]);
    let _dead = g.add1(Op::Unary(UnaryOp::Exp), &[x]);
    let y = g.add1(Op::Unary(UnaryOp::Tanh), &[x]);
    g.output("y", y);
    let h = canon_exact(&g, &[]);
    assert_eq!((h.nodes.len(), count(&h, "exp"), count(&h, "input")), (3, 0, 1));
}

#[test]
fn cse_merges_identical_nodes_and_constants_but_not_the_interface() {
    let (mut g, x) = with_x("cse");
    let x2 = g.add1(Op::Input { name: "x2".into(), ty: f32t(&[4, 3]) }, &[]);
    let x3 = g.add1(Op::Input { name: "x3".into(), ty: f32t(&[4, 3]) }, &[]);
    let a = g.add1(Op::Unary(UnaryOp::Exp), &[x]);
    let b = g.add1(Op::Unary(UnaryOp::Exp), &[x]);
    let c1 = konst(&mut g, 2.0, &f32t(&[4, 3]));
    let c2 = konst(&mut g, 2.0, &f32t(&[4, 3]));
    let s = bin(&mut g, BinaryOp::Add, a, c1);
    let t = bin(&mut g, BinaryOp::Add, b, c2);
    let u = bin(&mut g, BinaryOp::Mul, s, t);
    let u = bin(&mut g, BinaryOp::Mul, u, x2);
    let u = bin(&mut g, BinaryOp::Mul, u, x3);
    g.output("u", u);
    let h = canon_exact(&g, &[]);
    assert_eq!((count(&h, "exp"), count(&h, "add"), count(&h, "const")), (1, 1, 1), "{}", print(&h));
    assert_eq!(count(&h, "param") + count(&h, "input"), 3);
}

#[test]
fn signed_zero_constants_are_not_merged() {
    let (mut g, x) = with_x("zeros");
    let z1 = konst(&mut g, 0.0, &f32t(&[4, 3]));
    let z2 = konst(&mut g, -0.0, &f32t(&[4, 3]));
    let a = bin(&mut g, BinaryOp::Max, x, z1);
    let b = bin(&mut g, BinaryOp::Min, x, z2);
    g.output("a", a);
    g.output("b", b);
    let h = canon_exact(&g, &[]);
    assert_eq!(count(&h, "const"), 2, "{}", print(&h));
}

#[test]
fn folds_elementwise_ops_exactly_as_the_interpreter_rounds() {
    let mut g = Graph::new("fold", &[]);
    let t = f32t(&[2, 3]);
    let a = konst(&mut g, 0.1, &t);
    let b = konst(&mut g, 0.2, &t);
    let s = bin(&mut g, BinaryOp::Add, a, b);
    let e = g.add1(Op::Unary(UnaryOp::Exp), &[s]);
    let q = bin(&mut g, BinaryOp::Div, e, b);
    let lt = g.add1(Op::Compare(CmpOp::Lt), &[a, b]);
    let sel = g.add1(Op::Select, &[lt, q, a]);
    let h16 = g.add1(Op::Cast { to: DType::BF16 }, &[sel]);
    let back = g.add1(Op::Cast { to: DType::F32 }, &[h16]);
    let i = g.add1(Op::Cast { to: DType::I32 }, &[back]);
    let i7 = konst(&mut g, 7.0, &t.with_dtype(DType::I32));
    let idiv = bin(&mut g, BinaryOp::Div, i7, i);
    g.output("back", back);
    g.output("idiv", idiv);
    let h = canon_exact(&g, &[]);
    assert_eq!(h.nodes.len(), 2, "{}", print(&h));
    assert!(h.nodes.iter().all(|n| matches!(n.op, Op::Const { .. })));
}

#[test]
fn does_not_fold_what_the_interpreter_rejects() {
    // i32 division by zero and an out-of-range cast stay (the interpreter reports them at run time).
    let mut g = Graph::new("nofold", &[]);
    let it = Type::new(DType::I32, Shape::lits(&[2]));
    let a = konst(&mut g, 7.0, &it);
    let z = konst(&mut g, 0.0, &it);
    let d = bin(&mut g, BinaryOp::Div, a, z);
    let big = konst(&mut g, 1e20, &f32t(&[2]));
    let c = g.add1(Op::Cast { to: DType::I32 }, &[big]);
    g.output("d", d);
    g.output("c", c);
    let h = canonicalize(&g).unwrap();
    verify(&h).unwrap();
    assert_eq!((count(&h, "div"), count(&h, "cast")), (1, 1));
}

#[test]
fn folds_layout_ops_and_reductions_of_splats() {
    let mut g = Graph::new("layout", &["B"]);
    let c = konst(&mut g, 0.3, &f32t(&[3]));
    let bc = g.add1(Op::Broadcast { dims: vec![1], shape: Shape::lits(&[5, 3]) }, &[c]);
    let r = g.add1(Op::Reshape { shape: Shape::lits(&[15]) }, &[bc]);
    let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[r]);
    let sym = Type::new(DType::F32, Shape::from(vec![Dim::sym("B"), Dim::lit(4)]));
    let ones = konst(&mut g, 1.0, &sym);
    let mx = g.add1(Op::Reduce { op: ReduceOp::Max, axes: vec![0] }, &[ones]);
    let n = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1] }, &[ones]);
    let negz = konst(&mut g, -0.0, &f32t(&[4]));
    let zsum = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[negz]);
    let iv = konst(&mut g, 2e9, &Type::new(DType::I32, Shape::lits(&[3])));
    let isum = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[iv]);
    for (name, v) in [("s", s), ("mx", mx), ("n", n), ("zsum", zsum), ("isum", isum)] {
        g.output(name, v);
    }
    let h = canon_exact(&g, &[]);
    // Everything folds except the sum over the symbolic `B`, which keeps its splat operand.
    assert_eq!((count(&h, "reduce_sum"), count(&h, "broadcast"), count(&h, "reshape"), count(&h, "reduce_max")), (1, 0, 0, 0));
}

#[test]
fn algebraic_identities_fire() {
    let (mut g, x) = with_x("ident");
    let t = f32t(&[4, 3]);
    let one = konst(&mut g, 1.0, &t);
    let nz = konst(&mut g, -0.0, &t);
    let pz = konst(&mut g, 0.0, &t);
    let mut y = bin(&mut g, BinaryOp::Mul, x, one);
    y = bin(&mut g, BinaryOp::Mul, one, y);
    y = bin(&mut g, BinaryOp::Add, y, nz);
    y = bin(&mut g, BinaryOp::Add, nz, y);
    y = bin(&mut g, BinaryOp::Sub, y, pz);
    y = bin(&mut g, BinaryOp::Div, y, one);
    y = g.add1(Op::Unary(UnaryOp::Neg), &[y]);
    y = g.add1(Op::Unary(UnaryOp::Neg), &[y]);
    y = g.add1(Op::Reshape { shape: Shape::lits(&[4, 3]) }, &[y]);
    y = g.add1(Op::Broadcast { dims: vec![0, 1], shape: Shape::lits(&[4, 3]) }, &[y]);
    y = g.add1(Op::Permute { perm: vec![0, 1] }, &[y]);
    y = g.add1(Op::Cast { to: DType::F32 }, &[y]);
    y = g.add1(Op::Reshape { shape: Shape::lits(&[12]) }, &[y]);
    y = g.add1(Op::Reshape { shape: Shape::lits(&[4, 3]) }, &[y]);
    y = g.add1(Op::Permute { perm: vec![1, 0] }, &[y]);
    y = g.add1(Op::Permute { perm: vec![1, 0] }, &[y]);
    let cond = konst(&mut g, 1.0, &t.with_dtype(DType::I32));
    y = g.add1(Op::Select, &[cond, y, pz]);
    g.output("y", y);
    let h = canon_exact(&g, &[]);
    assert_eq!(h.nodes.len(), 1, "{}", print(&h));
    assert_eq!(h.outputs[0].1, h.nodes[0].results[0]);
}

#[test]
fn composed_permutes_and_reshapes_become_one() {
    let mut g = Graph::new("perm", &[]);
    let x = g.add1(Op::Param { name: "x".into(), ty: f32t(&[2, 3, 4]) }, &[]);
    let p = g.add1(Op::Permute { perm: vec![1, 2, 0] }, &[x]);
    let p = g.add1(Op::Permute { perm: vec![2, 0, 1] }, &[p]);
    let p = g.add1(Op::Permute { perm: vec![0, 2, 1] }, &[p]);
    let r = g.add1(Op::Reshape { shape: Shape::lits(&[6, 4]) }, &[x]);
    let r = g.add1(Op::Reshape { shape: Shape::lits(&[24]) }, &[r]);
    let r = g.add1(Op::Reshape { shape: Shape::lits(&[4, 6]) }, &[r]);
    g.output("p", p);
    g.output("r", r);
    let h = canon_exact(&g, &[]);
    assert_eq!((count(&h, "permute"), count(&h, "reshape")), (1, 1), "{}", print(&h));
}

#[test]
fn ieee_unsafe_identities_do_not_fire() {
    let (mut g, x) = with_x("unsafe");
    let t = f32t(&[4, 3]);
    let zero = konst(&mut g, 0.0, &t);
    let m = bin(&mut g, BinaryOp::Mul, x, zero);
    let a = bin(&mut g, BinaryOp::Add, x, zero);
    let nz = konst(&mut g, -0.0, &t);
    let s = bin(&mut g, BinaryOp::Sub, x, nz);
    g.output("m", m);
    g.output("a", a);
    g.output("s", s);
    // x holds inf, -inf, NaN and -0.0: x*0 is NaN there, x+0 is +0.0 for -0.0.
    let mut v = vec![f64::INFINITY, f64::NEG_INFINITY, f64::NAN, -0.0];
    v.extend((0..8).map(|i| i as f64 - 3.5));
    let feed = Tensor::new(DType::F32, vec![4, 3], v);
    let h = canon_exact(&g, &[("x", feed)]);
    assert_eq!((count(&h, "mul"), count(&h, "add"), count(&h, "sub")), (1, 1, 1), "{}", print(&h));
}

/// Within 1e-6 relative (NaN where the reference is NaN).
fn close(a: &Tensor, b: &Tensor) -> bool {
    a.shape == b.shape
        && a.dtype == b.dtype
        && a.data.iter().zip(&b.data).all(|(&p, &q)| p == q || (p.is_nan() && q.is_nan()) || (p - q).abs() <= 1e-6 * q.abs() + 1e-30)
}

#[test]
fn random_graphs_verify_keep_their_values_and_are_idempotent() {
    let (mut compared, mut changed) = (0, 0);
    for seed in 0..3000u64 {
        // Half the graphs also hold extreme constants (infinities, subnormals, -0.0, 1e300).
        let opts = GenOpts { extreme_consts: seed % 2 == 1, ..GenOpts::default() };
        let g = random_graph_with(&mut Rng::new(seed), &opts);
        let h = canonicalize(&g).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        verify(&h).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", print(&h)));
        let h2 = canonicalize(&h).unwrap();
        assert_eq!(print(&h2), print(&h), "seed {seed}: not idempotent\n{}", print(&g));
        changed += (print(&h) != print(&g)) as usize;
        // Graphs the interpreter rejects (bad gather indices, i32 division by zero) are skipped.
        let b = bindings();
        let Ok(feeds) = interp::random_feeds(&g, &b, &mut Rng::new(seed), 2) else {
            continue;
        };
        let Ok(before) = interp::run(&g, &b, &feeds, Precision::F32) else {
            continue;
        };
        let after = interp::run(&h, &b, &feeds, Precision::F32).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", print(&h)));
        for (i, (x, y)) in after.iter().zip(&before).enumerate() {
            assert!(close(x, y), "seed {seed}, output {i}:\n{}\n{}", print(&g), print(&h));
        }
        compared += 1;
    }
    assert!(compared > 1000 && changed > 600, "compared {compared}, changed {changed}");
}

#[test]
fn gpt2_tiny_is_canonical_after_one_run() {
    let g = build_gpt2(&Gpt2Config::preset("tiny").unwrap(), "t");
    let h = canonicalize(&g).unwrap();
    verify(&h).unwrap();
    assert!(h.nodes.len() < g.nodes.len());
    assert_eq!(print(&canonicalize(&h).unwrap()), print(&h));
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 4);
    let feeds: HashMap<String, Tensor> = interp::random_feeds(&g, &b, &mut Rng::new(1), 250).unwrap();
    let x = interp::run(&g, &b, &feeds, Precision::F32).unwrap();
    let y = interp::run(&h, &b, &feeds, Precision::F32).unwrap();
    assert_eq!(x[0].data[0].to_bits(), y[0].data[0].to_bits());
}
