//! Verifier tests: well-formed graphs pass; each class of malformed graph is rejected with a
//! message naming the node and value; garbage never panics.

use fusec_ir::rng::Rng;
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, DType, Dim, Graph, Node, NodeId, Op, ReduceOp, Shape, Type, UnaryOp, ValueId, ValueInfo};

fn f32s(dims: &[u64]) -> Type {
    Type::new(DType::F32, Shape::lits(dims))
}

/// A small well-formed graph over `B`: x: f32[B, 4], w: f32[4, 4] -> y = sum(tanh(x @ w) + x),
/// plus a layernorm of x.
fn good() -> Graph {
    let mut g = Graph::new("good", &["B"]);
    let bt = Type::new(DType::F32, Shape(vec![Dim::sym("B"), Dim::lit(4)].into()));
    let x = g.add1(Op::Input { name: "x".into(), ty: bt }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: f32s(&[4, 4]) }, &[]);
    let m = g.add1(Op::MatMul { trans_a: false, trans_b: false }, &[x, w]);
    let t = g.add1(Op::Unary(UnaryOp::Tanh), &[m]);
    let s = g.add1(Op::Binary(BinaryOp::Add), &[t, x]);
    let y = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1] }, &[s]);
    let lw = g.add1(Op::Param { name: "lw".into(), ty: f32s(&[4]) }, &[]);
    let ln = g.add(Op::LayerNorm { eps: 1e-5 }, &[x, lw, lw]);
    g.output("rstd", ln[2]);
    g.output("y", y);
    g.output("t", t);
    g
}

#[track_caller]
fn rejects(g: &Graph, needle: &str) -> String {
    let e = verify(g).expect_err("graph should be rejected");
    let s = e.to_string();
    assert!(s.contains(needle), "error `{s}` does not mention `{needle}`");
    s
}

#[test]
fn accepts_well_formed() {
    verify(&good()).unwrap();
    verify(&Graph::new("empty", &[])).unwrap();
}

#[test]
fn rejects_use_before_def() {
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2]) }, &[]);
    let y = g.add1(Op::Unary(UnaryOp::Neg), &[x]);
    // Swap the two nodes (and fix the back pointers) so the use comes first.
    g.nodes.swap(0, 1);
    g.values[x.0 as usize].node = NodeId(1);
    g.values[y.0 as usize].node = NodeId(0);
    let s = rejects(&g, "before it is defined");
    assert!(s.starts_with("node 0 (`neg`)"), "{s}");
    // A node using its own result.
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2]) }, &[]);
    let _ = x;
    g.push_unchecked(Op::Unary(UnaryOp::Neg), &[ValueId(1)], vec![f32s(&[2])]);
    rejects(&g, "before it is defined");
}

#[test]
fn rejects_wrong_declared_type() {
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2, 3]) }, &[]);
    g.push_unchecked(Op::Unary(UnaryOp::Exp), &[x], vec![f32s(&[3, 2])]);
    let s = rejects(&g, "declared f32[3, 2], expected f32[2, 3]");
    assert!(s.contains("%1") && s.contains("`exp`"), "{s}");
    // Wrong result count.
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2, 3]) }, &[]);
    let w = g.add1(Op::Input { name: "w".into(), ty: f32s(&[3]) }, &[]);
    g.push_unchecked(Op::LayerNorm { eps: 1e-5 }, &[x, w, w], vec![f32s(&[2, 3])]);
    rejects(&g, "produces 3 result(s), node has 1");
    // Wrong arity and ill-typed operands.
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2, 3]) }, &[]);
    g.push_unchecked(Op::Binary(BinaryOp::Add), &[x], vec![f32s(&[2, 3])]);
    rejects(&g, "takes 2 operand(s)");
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2, 3]) }, &[]);
    let i = g.add1(Op::Input { name: "i".into(), ty: Type::new(DType::I32, Shape::lits(&[2, 3])) }, &[]);
    g.push_unchecked(Op::Binary(BinaryOp::Add), &[x, i], vec![f32s(&[2, 3])]);
    rejects(&g, "differ");
}

#[test]
fn rejects_bad_dims_and_consts() {
    let mut g = Graph::new("g", &["B"]);
    g.add1(Op::Input { name: "x".into(), ty: Type::new(DType::F32, Shape(vec![Dim::sym("T")].into())) }, &[]);
    rejects(&g, "`T` is not declared");

    let mut g = Graph::new("g", &[]);
    g.add1(Op::Input { name: "x".into(), ty: f32s(&[2, 0]) }, &[]);
    rejects(&g, "zero");

    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2, 3]) }, &[]);
    let q = Type::new(DType::F32, Shape(vec![Dim::sym("Q")].into()));
    g.push_unchecked(Op::Reshape { shape: q.shape.clone() }, &[x], vec![q]);
    rejects(&g, "`Q` is not declared");

    let mut g = Graph::new("g", &[]);
    g.add1(Op::Const { value: f64::NAN, ty: f32s(&[2]) }, &[]);
    rejects(&g, "NaN");
    let mut g = Graph::new("g", &[]);
    g.add1(Op::Const { value: f64::INFINITY, ty: f32s(&[2]) }, &[]);
    verify(&g).unwrap();
    g.add1(Op::Const { value: f64::INFINITY, ty: Type::scalar(DType::I32) }, &[]);
    rejects(&g, "does not fit");

    let mut g = Graph::new("g", &["B", "B"]);
    g.add1(Op::Const { value: 1.0, ty: f32s(&[2]) }, &[]);
    rejects(&g, "declared twice");

    // Cast to the same dtype is fine.
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32s(&[2]) }, &[]);
    g.add1(Op::Cast { to: DType::F32 }, &[x]);
    verify(&g).unwrap();
}

#[test]
fn rejects_duplicate_names() {
    let mut g = Graph::new("g", &[]);
    g.add1(Op::Param { name: "w".into(), ty: f32s(&[2]) }, &[]);
    g.add1(Op::Param { name: "w".into(), ty: f32s(&[3]) }, &[]);
    let s = rejects(&g, "`w` is already used by node 0");
    assert!(s.starts_with("node 1 (`param`)"), "{s}");

    let mut g = Graph::new("g", &[]);
    g.add1(Op::Input { name: "t".into(), ty: f32s(&[2]) }, &[]);
    g.add1(Op::Input { name: "t".into(), ty: f32s(&[2]) }, &[]);
    rejects(&g, "already used");

    let mut g = Graph::new("g", &[]);
    g.add1(Op::Param { name: "t".into(), ty: f32s(&[2]) }, &[]);
    g.add1(Op::Input { name: "t".into(), ty: f32s(&[2]) }, &[]);
    rejects(&g, "share one namespace");

    let mut g = good();
    let v = g.outputs[0].1;
    g.output("y", v);
    rejects(&g, "output name `y` is used twice");

    let mut g = good();
    g.output("", v);
    rejects(&g, "empty name");

    let mut g = good();
    g.output("z", ValueId(999));
    rejects(&g, "does not exist");
}

#[test]
fn rejects_broken_bookkeeping() {
    // A value whose info points at the wrong node.
    let mut g = good();
    g.values[2].node = NodeId(0);
    rejects(&g, "records its producer");
    // A value produced by no node.
    let mut g = good();
    g.values.push(ValueInfo { ty: f32s(&[1]), node: NodeId(0), index: 0 });
    rejects(&g, "not produced by any node");
    // A value defined twice.
    let mut g = good();
    let r = g.nodes[1].results[0];
    g.nodes[2].results[0] = r;
    rejects(&g, "defined more than once");
}

/// A kernel body over `B`: `y = neg(x)` for `x: f32[B, 4]`.
fn kernel_body() -> Graph {
    let mut b = Graph::new("neg", &["B"]);
    let x = b.add1(Op::Input { name: "x".into(), ty: Type::new(DType::F32, Shape(vec![Dim::sym("B"), Dim::lit(4)].into())) }, &[]);
    let y = b.add1(Op::Unary(UnaryOp::Neg), &[x]);
    b.output("y", y);
    b
}

/// Random edits of well-formed graphs (ids, types, ops, outputs): verify must return, never panic.
#[test]
fn never_panics_on_garbage() {
    let mut rng = Rng::new(99);
    let ops = [
        Op::Unary(UnaryOp::Exp),
        Op::Binary(BinaryOp::Mul),
        Op::Gather,
        Op::ScatterAdd { rows: Dim::lit(0) },
        Op::Concat { axis: 0 },
        Op::Slice { axis: 3, start: 5, end: 2 },
        Op::MatMul { trans_a: true, trans_b: true },
        Op::AttentionGrad { heads: 1, scale: f64::NAN },
        Op::AdamW { beta1: 2.0, beta2: 0.5, eps: -1.0, weight_decay: 0.0 },
        Op::CrossEntropy { vocab: u64::MAX },
        Op::Reshape { shape: Shape::lits(&[u64::MAX, u64::MAX]) },
        Op::Broadcast { dims: vec![5, 1], shape: Shape::lits(&[2]) },
        Op::Permute { perm: vec![0, 0, 9] },
        Op::Reduce { op: ReduceOp::Max, axes: vec![] },
        Op::Iota { axis: 7, ty: f32s(&[2]) },
        Op::LayerNormGrad,
        Op::Gemm(fusec_ir::Gemm { trans_a: true, trans_b: false, bias: true, gelu: true, out: DType::BF16, accumulate: true }),
        Op::Kernel(Box::new(fusec_ir::Kernel { name: "k".into(), body: kernel_body() })),
        Op::Kernel(Box::new(fusec_ir::Kernel {
            name: "bad".into(),
            body: {
                let mut b = kernel_body();
                b.outputs[0].1 = ValueId(9);
                b
            },
        })),
    ];
    let tys = [f32s(&[]), f32s(&[u64::MAX, u64::MAX]), Type::new(DType::I32, Shape::lits(&[4])), f32s(&[4, 4]), f32s(&[0])];
    let mut rejected = 0;
    for _ in 0..3000 {
        let mut g = good();
        for _ in 0..=rng.below(3) {
            let n = g.nodes.len() as u64;
            match rng.below(8) {
                0 => {
                    let k = rng.below(n) as usize;
                    g.nodes[k].inputs.push(ValueId(rng.below(20) as u32));
                }
                1 => {
                    let k = rng.below(n) as usize;
                    g.nodes[k].op = ops[rng.below(ops.len() as u64) as usize].clone();
                }
                2 => {
                    let k = rng.below(g.values.len() as u64) as usize;
                    g.values[k].ty = tys[rng.below(tys.len() as u64) as usize].clone();
                }
                3 => {
                    let k = rng.below(n) as usize;
                    g.nodes[k].results.push(ValueId(u32::MAX - 40 + rng.below(40) as u32));
                }
                4 => {
                    let k = rng.below(g.values.len() as u64) as usize;
                    g.values[k].index = rng.below(256) as u16;
                    g.values[k].node = NodeId(rng.below(1000) as u32);
                }
                5 => g.outputs.push((String::new(), ValueId(u32::MAX))),
                6 => {
                    let k = rng.below(n) as usize;
                    g.nodes.remove(k);
                }
                _ => {
                    let k = rng.below(n) as usize;
                    let ins: Vec<_> = (0..rng.below(8)).map(|_| ValueId(rng.below(12) as u32)).collect();
                    let op = ops[rng.below(ops.len() as u64) as usize].clone();
                    g.nodes.insert(k, Node { op, inputs: ins.into(), results: Default::default() });
                }
            }
        }
        if let Err(e) = verify(&g) {
            rejected += 1;
            let _ = e.to_string();
        }
    }
    assert!(rejected > 2000, "most edits break the graph ({rejected})");
}
