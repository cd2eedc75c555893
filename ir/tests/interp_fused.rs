//! The fused ops in the interpreter: `gemm` with every epilogue and `kernel` give exactly (bit
//! for bit, in both precisions) what the unfused op sequences they stand for give, on hand-made
//! cases and on every generated graph; plus a hand formula check and error reporting.
#![allow(clippy::needless_range_loop)]

use std::collections::HashMap;

use fusec_ir::interp::{run, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::random_graph;
use fusec_ir::testkit::{assert_same_bits, random_feeds};
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, Bindings, DType, Dim, Gemm, Graph, Kernel, Op, Shape, Type, ValueId};

use Rounding::{F32, F64};

/// The unfused ops a gemm stands for: matmul, add of the broadcast bias, GELU, cast, add of
/// the accumulator. Returns the results `[y]` or `[y, pre_gelu]`.
fn expand_gemm(h: &mut Graph, gm: &Gemm, ins: &[ValueId]) -> Vec<ValueId> {
    let mut y = h.add1(Op::MatMul { trans_a: gm.trans_a, trans_b: gm.trans_b }, &ins[..2]);
    let mut next = 2;
    if gm.bias {
        let shape = h.ty(y).shape.clone();
        let b = h.add1(Op::Broadcast { dims: vec![shape.rank() - 1], shape }, &[ins[next]]);
        next += 1;
        y = h.add1(Op::Binary(BinaryOp::Add), &[y, b]);
    }
    let pre = y;
    if gm.gelu {
        y = h.add1(Op::Gelu, &[y]);
    }
    if gm.out != h.ty(y).dtype {
        y = h.add1(Op::Cast { to: gm.out }, &[y]);
    }
    if gm.accumulate {
        y = h.add1(Op::Binary(BinaryOp::Add), &[ins[next], y]);
    }
    if gm.gelu {
        vec![y, pre]
    } else {
        vec![y]
    }
}

/// Copies the nodes of `g` into `h` with fused ops expanded; `inputs`, when given, replaces
/// `g`'s `input` nodes in order (inlining a kernel body). Returns the values of `g`'s outputs.
fn copy_unfused(h: &mut Graph, g: &Graph, inputs: Option<&[ValueId]>) -> Vec<ValueId> {
    let mut map = vec![ValueId(u32::MAX); g.values.len()];
    let mut next_input = 0;
    for n in &g.nodes {
        let ins: Vec<ValueId> = n.inputs.iter().map(|v| map[v.0 as usize]).collect();
        let outs = match (&n.op, inputs) {
            (Op::Input { .. }, Some(given)) => {
                next_input += 1;
                vec![given[next_input - 1]]
            }
            (Op::Gemm(gm), _) => expand_gemm(h, gm, &ins),
            (Op::Kernel(k), _) => copy_unfused(h, &k.body, Some(&ins)),
            (op, _) => h.add(op.clone(), &ins).to_vec(),
        };
        for (r, o) in n.results.iter().zip(outs) {
            map[r.0 as usize] = o;
        }
    }
    g.outputs.iter().map(|(_, v)| map[v.0 as usize]).collect()
}

/// `g` with every gemm expanded and every kernel inlined; same sources and outputs.
fn unfuse(g: &Graph) -> Graph {
    let mut h = Graph { name: g.name.clone(), syms: g.syms.clone(), ..Graph::default() };
    let outs = copy_unfused(&mut h, g, None);
    for ((name, _), v) in g.outputs.iter().zip(outs) {
        h.output(name, v);
    }
    h
}

/// A graph with one input per type (`x0`, `x1`, ..) feeding `op`; every result is an output.
fn graph_of(op: Op, tys: &[Type]) -> Graph {
    let mut g = Graph::new("t", &["B"]);
    let ids: Vec<_> = tys.iter().enumerate().map(|(i, t)| g.add1(Op::Input { name: format!("x{i}"), ty: t.clone() }, &[])).collect();
    for (j, r) in g.add(op, &ids).into_iter().enumerate() {
        g.output(&format!("out{j}"), r);
    }
    g
}

/// Runs `g` and its unfused form on the same feeds in both precisions; asserts equality and
/// returns the F32 outputs.
fn check_against_unfused(g: &Graph, b: &Bindings, feeds: &HashMap<String, Tensor>, what: &str) -> Vec<Tensor> {
    let h = unfuse(g);
    verify(&h).unwrap_or_else(|e| panic!("{what}: unfused graph does not verify: {e}"));
    for prec in [F32, F64] {
        let fused = run(g, b, feeds, prec).unwrap_or_else(|e| panic!("{what}: {e}"));
        let plain = run(&h, b, feeds, prec).unwrap_or_else(|e| panic!("{what}: unfused: {e}"));
        assert_same_bits(&format!("{what} ({prec:?})"), &fused, &plain);
    }
    run(g, b, feeds, F32).unwrap()
}

#[test]
fn gemm_every_epilogue_equals_the_unfused_sequence() {
    let mut rng = Rng::new(11);
    let mut b = Bindings::default();
    b.set("B", 2);
    let (m, k, n) = (Dim::lit(3), Dim::lit(5), Dim::lit(4));
    let mut cases = 0;
    for dtype in [DType::F32, DType::BF16] {
        for out in [DType::F32, DType::BF16, DType::F16] {
            for flags in 0..32u32 {
                let bit = |i: u32| flags >> i & 1 == 1;
                let (trans_a, trans_b, bias, gelu, accumulate) = (bit(0), bit(1), bit(2), bit(3), bit(4));
                let gm = Gemm { trans_a, trans_b, bias, gelu, out, accumulate };
                let shared = flags % 3 == 0;
                let mat = |x: &Dim, y: &Dim, t: bool, batch: bool| {
                    let mut d = if batch { vec![Dim::sym("B")] } else { vec![] };
                    d.extend(if t { [y.clone(), x.clone()] } else { [x.clone(), y.clone()] });
                    Type::new(dtype, Shape::from(d))
                };
                let mut tys = vec![mat(&m, &k, trans_a, true), mat(&k, &n, trans_b, !shared)];
                if bias {
                    tys.push(Type::new(dtype, Shape::from(vec![n.clone()])));
                }
                if accumulate {
                    tys.push(Type::new(out, Shape::from(vec![Dim::sym("B"), m.clone(), n.clone()])));
                }
                let g = graph_of(Op::Gemm(gm.clone()), &tys);
                verify(&g).unwrap();
                let feeds = random_feeds(&g, &b, &mut rng, 1).unwrap();
                let what = format!("{gm:?} on {dtype}, shared b {shared}");
                let outs = check_against_unfused(&g, &b, &feeds, &what);
                assert_eq!(outs.len(), 1 + gelu as usize);
                assert_eq!(outs[0].dtype, out);
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 2 * 3 * 32);
}

#[test]
fn gemm_matches_the_formula_and_rounds_between_steps() {
    // y = acc + cast(gelu(a @ b^T + bias)), pre = a @ b^T + bias, checked against f64 formulas.
    let mut rng = Rng::new(5);
    let (m, k, n) = (3, 7, 4);
    let a = Tensor::random(&mut rng, vec![m, k], DType::F32, 0);
    let w = Tensor::random(&mut rng, vec![n, k], DType::F32, 0);
    let bias = Tensor::random(&mut rng, vec![n], DType::F32, 0);
    let acc = Tensor::random(&mut rng, vec![m, n], DType::BF16, 0);
    let gm = Gemm { trans_a: false, trans_b: true, bias: true, gelu: true, out: DType::BF16, accumulate: true };
    let tys: Vec<Type> = [&a, &w, &bias, &acc]
        .iter()
        .map(|t| Type::new(t.dtype, Shape::lits(&t.shape.iter().map(|&d| d as u64).collect::<Vec<_>>())))
        .collect();
    let g = graph_of(Op::Gemm(gm), &tys);
    let feeds: HashMap<String, Tensor> =
        [a.clone(), w.clone(), bias.clone(), acc.clone()].into_iter().enumerate().map(|(i, t)| (format!("x{i}"), t)).collect();
    let gelu = |x: f64| 0.5 * x * (1.0 + (0.7978845608028654 * (x + 0.044715 * x * x * x)).tanh());
    let bf = |x: f64| fusec_ir::interp::round_to(DType::BF16, x);
    let f = |x: f64| x as f32 as f64;
    for prec in [F64, F32] {
        let o = run(&g, &Bindings::default(), &feeds, prec).unwrap();
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k).map(|p| a.data[i * k + p] * w.data[j * k + p]).sum();
                let (pre, y) = if prec == F64 {
                    let pre = dot + bias.data[j];
                    (pre, acc.data[i * n + j] + gelu(pre))
                } else {
                    let pre = f(f(dot) + bias.data[j]);
                    (pre, bf(acc.data[i * n + j] + bf(f(gelu(pre)))))
                };
                assert_eq!(o[1].data[i * n + j].to_bits(), pre.to_bits(), "{prec:?} pre_gelu [{i}, {j}]");
                let tol = if prec == F64 { 1e-12 } else { 0.0 };
                assert!((o[0].data[i * n + j] - y).abs() <= tol * y.abs(), "{prec:?} y [{i}, {j}]: {} vs {y}", o[0].data[i * n + j]);
            }
        }
    }
}

/// An `add_layernorm` kernel (residual add, then layernorm) over `x: f32[B, 8]`.
fn add_layernorm() -> Graph {
    let t = |s: Shape| Type::new(DType::F32, s);
    let bt = Shape::from(vec![Dim::sym("B"), Dim::lit(8)]);
    let mut body = Graph::new("add_layernorm", &["B"]);
    let x0 = body.add1(Op::Input { name: "x0".into(), ty: t(bt.clone()) }, &[]);
    let x1 = body.add1(Op::Input { name: "x1".into(), ty: t(bt.clone()) }, &[]);
    let w = body.add1(Op::Input { name: "w".into(), ty: t(Shape::lits(&[8])) }, &[]);
    let s = body.add1(Op::Binary(BinaryOp::Add), &[x0, x1]);
    let c = body.add1(Op::Const { value: 0.1, ty: t(Shape::lits(&[8])) }, &[]);
    let ln = body.add(Op::LayerNorm { eps: 1e-5 }, &[s, w, c]);
    let e = body.add1(Op::Unary(fusec_ir::UnaryOp::Exp), &[ln[2]]);
    body.output("y", ln[0]);
    body.output("s", s);
    body.output("e", e);
    body.output("x0", x0);
    let mut g = Graph::new("k", &["B"]);
    let a = g.add1(Op::Input { name: "a".into(), ty: t(bt.clone()) }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: t(Shape::lits(&[8])) }, &[]);
    let b = g.add1(Op::Param { name: "b".into(), ty: t(bt) }, &[]);
    let r = g.add(Op::Kernel(Box::new(Kernel { name: "add_layernorm".into(), body })), &[b, a, w]);
    for (i, v) in r.into_iter().enumerate() {
        g.output(&format!("r{i}"), v);
    }
    g
}

#[test]
fn kernel_equals_its_body_inlined() {
    let g = add_layernorm();
    verify(&g).unwrap();
    let mut b = Bindings::default();
    b.set("B", 3);
    for seed in 0..20 {
        let feeds = random_feeds(&g, &b, &mut Rng::new(seed), 1).unwrap();
        let o = check_against_unfused(&g, &b, &feeds, "add_layernorm");
        // The pass-through output is the operand bound to the body's first input (`b`).
        assert_eq!(o[3], feeds["b"]);
        assert_eq!(o[1].data, feeds["b"].data.iter().zip(&feeds["a"].data).map(|(x, y)| (x + y) as f32 as f64).collect::<Vec<_>>());
    }
}

#[test]
fn kernel_errors_name_the_kernel_and_the_inner_node() {
    let t = Type::new(DType::I32, Shape::lits(&[2]));
    let mut body = Graph::new("div", &[]);
    let x = body.add1(Op::Input { name: "x".into(), ty: t.clone() }, &[]);
    let z = body.add1(Op::Const { value: 0.0, ty: t.clone() }, &[]);
    let d = body.add1(Op::Binary(BinaryOp::Div), &[x, z]);
    body.output("y", d);
    let g = graph_of(Op::Kernel(Box::new(Kernel { name: "div".into(), body })), &[t]);
    let mut g = g;
    g.syms.clear();
    let feeds = HashMap::from([("x0".to_string(), Tensor::from_i32(vec![2], &[1, 2]))]);
    let e = run(&g, &Bindings::default(), &feeds, F32).unwrap_err();
    assert_eq!(e.node, Some(1));
    let s = e.to_string();
    assert!(s.contains("`kernel`") && s.contains("kernel `div`") && s.contains("node 2: `div`: i32 division by zero"), "{s}");
}

#[test]
fn generated_graphs_equal_their_unfused_form() {
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 3).set("N", 2);
    let (mut fused, mut compared) = (0, 0);
    for seed in 0..1500 {
        let g = random_graph(&mut Rng::new(seed));
        if !g.nodes.iter().any(|n| matches!(n.op, Op::Gemm(_) | Op::Kernel(_))) {
            continue;
        }
        fused += 1;
        let h = unfuse(&g);
        verify(&h).unwrap_or_else(|e| panic!("seed {seed}: unfused graph does not verify: {e}"));
        let Ok(feeds) = random_feeds(&g, &b, &mut Rng::new(seed), 2) else {
            continue;
        };
        for prec in [F32, F64] {
            // Both fail (e.g. an i32 division by zero) or both give the same bits.
            match (run(&g, &b, &feeds, prec), run(&h, &b, &feeds, prec)) {
                (Ok(x), Ok(y)) => {
                    assert_same_bits(&format!("seed {seed} ({prec:?})"), &x, &y);
                    compared += 1;
                }
                (Err(_), Err(_)) => {}
                (x, y) => panic!("seed {seed} ({prec:?}): fused {:?} but unfused {:?}", x.err(), y.err()),
            }
        }
    }
    assert!(fused > 300 && compared > 400, "{fused} graphs with fused ops, {compared} runs compared");
}
