//! Verifier rules of the fused ops: kernel bodies are verified recursively (errors name the
//! kernel node and the inner node), hold no params and no kernels, share the graph's symbols,
//! and type-check against their operands; gemm results are floats; garbage never panics.

use fusec_ir::rng::Rng;
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, DType, Dim, Gemm, Graph, Kernel, Node, NodeId, Op, Shape, Type, UnaryOp, ValueId};

fn bt() -> Type {
    Type::new(DType::F32, Shape(vec![Dim::sym("B"), Dim::lit(4)].into()))
}

/// A body over `B`: inputs `x0`, `x1` of [`bt`], `y = tanh(x0 + x1)`.
fn body() -> Graph {
    let mut b = Graph::new("add_tanh", &["B"]);
    let x0 = b.add1(Op::Input { name: "x0".into(), ty: bt() }, &[]);
    let x1 = b.add1(Op::Input { name: "x1".into(), ty: bt() }, &[]);
    let s = b.add1(Op::Binary(BinaryOp::Add), &[x0, x1]);
    let y = b.add1(Op::Unary(UnaryOp::Tanh), &[s]);
    b.output("y", y);
    b
}

/// `p: f32[B, 4]`, `w: f32[4, 4]`, `g = gemm(p, w)`, then node 3 `kernel(p, g)` with `body`.
fn with_body(body: Graph) -> Graph {
    let mut g = Graph::new("g", &["B"]);
    let p = g.add1(Op::Param { name: "p".into(), ty: bt() }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: Type::new(DType::F32, Shape::lits(&[4, 4])) }, &[]);
    let gm = Gemm { trans_a: false, trans_b: false, bias: false, gelu: false, out: DType::F32, accumulate: false };
    let h = g.add1(Op::Gemm(gm), &[p, w]);
    let k = Op::Kernel(Box::new(Kernel { name: body.name.clone(), body }));
    // (Not `result_types`: it trusts the body to be well formed, which the verifier checks.)
    let r = g.push_unchecked(k, &[p, h], vec![bt()]);
    g.output("y", r[0]);
    g
}

#[track_caller]
fn rejects(g: &Graph, needles: &[&str]) -> String {
    let s = verify(g).expect_err("graph should be rejected").to_string();
    for n in needles {
        assert!(s.contains(n), "error `{s}` does not mention `{n}`");
    }
    s
}

#[test]
fn accepts_gemm_and_kernel() {
    verify(&with_body(body())).unwrap();
}

#[test]
fn rejects_operands_that_do_not_match_the_body_inputs() {
    // A body input retyped: the body's own add no longer type-checks.
    let mut b = body();
    let f4 = Type::new(DType::F32, Shape::lits(&[4]));
    b.values[1].ty = f4.clone();
    b.nodes[1].op = Op::Input { name: "x1".into(), ty: f4 };
    // Only the interface differs.
    let mut b2 = Graph::new("add_tanh", &["B"]);
    let x0 = b2.add1(Op::Input { name: "x0".into(), ty: bt() }, &[]);
    b2.add1(Op::Input { name: "x1".into(), ty: Type::new(DType::BF16, Shape::lits(&[4])) }, &[]);
    let y = b2.add1(Op::Unary(UnaryOp::Tanh), &[x0]);
    b2.output("y", y);
    let s = rejects(&with_body(b2), &["node 3 (`kernel`)", "kernel `add_tanh` operand 1 (`x1`) must be bf16[4], found f32[B, 4]"]);
    assert!(!s.contains("in the body"), "{s}");
    // Inside the (now ill-typed) body the error names the inner node.
    rejects(&with_body(b), &["node 3 (`kernel`): in the body of kernel `add_tanh`: node 2 (`add`)", "operand types differ"]);
    // Too few operands for the body's inputs.
    let mut g = with_body(body());
    g.nodes[3].inputs.pop();
    rejects(&g, &["kernel `add_tanh` takes 2 operand(s), found 1"]);
}

#[test]
fn rejects_params_and_kernels_inside_bodies() {
    let mut b = body();
    b.nodes[1].op = Op::Param { name: "x1".into(), ty: bt() };
    rejects(&with_body(b), &["node 3 (`kernel`): in the body of kernel `add_tanh`: node 1 (`param`)", "cannot hold a `param`"]);
    // A kernel nested in a body (itself well formed).
    let mut b = body();
    let inner = Op::Kernel(Box::new(Kernel { name: "inner".into(), body: body() }));
    let (x0, x1) = (b.nodes[0].results[0], b.nodes[1].results[0]);
    let r = b.add1(inner, &[x0, x1]);
    b.outputs[0].1 = r;
    rejects(
        &with_body(b),
        &["node 3 (`kernel`): in the body of kernel `add_tanh`: node 4 (`kernel`)", "kernel `inner` is nested in a kernel body"],
    );
}

#[test]
fn rejects_body_symbols_other_than_the_graphs() {
    for syms in [vec![], vec!["B".to_string(), "T".to_string()], vec!["T".to_string()]] {
        let mut b = body();
        b.syms = syms;
        rejects(&with_body(b), &["node 3 (`kernel`)", "the body of kernel `add_tanh` declares symbols", "but the graph declares (B)"]);
    }
}

#[test]
fn rejects_other_body_faults_naming_both_nodes() {
    // Duplicate input names, a missing output, a dangling output, a wrong declared type.
    let mut b = body();
    b.nodes[1].op = Op::Input { name: "x0".into(), ty: bt() };
    rejects(&with_body(b), &["in the body of kernel `add_tanh`: node 1 (`input`)", "name `x0` is already used by node 0"]);
    let mut b = body();
    b.outputs.clear();
    rejects(&with_body(b), &["node 3 (`kernel`)", "kernel `add_tanh` has no outputs"]);
    let mut b = body();
    b.outputs[0].1 = ValueId(77);
    rejects(&with_body(b), &["in the body of kernel `add_tanh`: output `y` refers to a value that does not exist"]);
    let mut b = body();
    b.values[3].ty = Type::new(DType::F32, Shape::lits(&[4, 4]));
    rejects(&with_body(b), &["in the body of kernel `add_tanh`: node 3 (`tanh`): result 0 (%3) is declared f32[4, 4], expected f32[B, 4]"]);
    // A body with no inputs leaves the kernel without operands.
    let mut b = Graph::new("c", &["B"]);
    let c = b.add1(Op::Const { value: 1.0, ty: bt() }, &[]);
    b.output("y", c);
    let mut g = with_body(b);
    g.nodes[3].inputs.clear();
    rejects(&g, &["`kernel` takes at least one operand"]);
}

#[test]
fn rejects_integer_gemm_results() {
    let mut g = with_body(body());
    let Op::Gemm(gm) = &mut g.nodes[2].op else { unreachable!() };
    gm.out = DType::I32;
    g.values[2].ty = g.values[2].ty.with_dtype(DType::I32);
    rejects(&g, &["node 2 (`gemm`)", "gemm result dtype must be a float type, found i32"]);
}

/// Random edits inside kernel bodies: verify must return, never panic.
#[test]
fn never_panics_on_garbage_bodies() {
    let mut rng = Rng::new(7);
    let tys =
        [bt(), Type::new(DType::I32, Shape::lits(&[4])), Type::new(DType::F32, Shape::lits(&[u64::MAX, 2])), Type::scalar(DType::F32)];
    let mut rejected = 0;
    for _ in 0..3000 {
        let mut b = body();
        for _ in 0..=rng.below(3) {
            let n = b.nodes.len() as u64;
            match rng.below(7) {
                0 if n > 0 => {
                    let k = rng.below(n) as usize;
                    b.nodes[k].inputs.push(ValueId(rng.below(20) as u32));
                }
                1 if n > 0 => {
                    let k = rng.below(n) as usize;
                    b.nodes[k].results.clear();
                }
                2 => {
                    let k = rng.below(b.values.len() as u64) as usize;
                    b.values[k].ty = tys[rng.below(tys.len() as u64) as usize].clone();
                }
                3 => {
                    let k = rng.below(b.values.len() as u64) as usize;
                    b.values[k].node = NodeId(rng.below(100) as u32);
                }
                4 => b.outputs.push((String::new(), ValueId(u32::MAX))),
                5 if n > 0 => {
                    b.nodes.remove(rng.below(n) as usize);
                }
                _ => {
                    let k = rng.below(n + 1) as usize;
                    let op = if rng.chance(0.5) { Op::Kernel(Box::new(Kernel { name: "z".into(), body: body() })) } else { Op::Gelu };
                    let results = vec![ValueId(rng.below(8) as u32)].into();
                    b.nodes.insert(k, Node { op, inputs: vec![ValueId(rng.below(5) as u32)].into(), results });
                }
            }
        }
        if verify(&with_body(b)).is_err() {
            rejected += 1;
        }
    }
    assert!(rejected > 2000, "most edits break the body ({rejected})");
}
