//! Per-op tests of the reference interpreter against independent hand computations (explicit
//! loops and formulas written here), finite differences for every gradient op, and error cases.
// Hand computations read best as index loops over the formulas.
#![allow(clippy::needless_range_loop, clippy::type_complexity, clippy::excessive_precision)]

use std::collections::HashMap;

use fusec_ir::interp::{round_to, run, run_all, InterpError, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::{assert_close_slice, random_feeds};
use fusec_ir::{BinaryOp, Bindings, CmpOp, DType, Dim, Graph, Op, ReduceOp, Shape, Type, UnaryOp};

use Rounding::{F32, F64};

/// A graph with one `Input` per operand (`x0`, `x1`, ..) feeding `op`; every result is an output.
fn graph_of(op: Op, ins: &[&Tensor]) -> Graph {
    let mut g = Graph::new("t", &[]);
    let ids: Vec<_> = ins
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let ty = Type::new(t.dtype, Shape::lits(&t.shape.iter().map(|&d| d as u64).collect::<Vec<_>>()));
            g.add1(Op::Input { name: format!("x{i}"), ty }, &[])
        })
        .collect();
    for (j, r) in g.try_add(op, &ids).expect("well-typed test op").into_iter().enumerate() {
        g.output(&format!("out{j}"), r);
    }
    g
}

fn try_eval(op: Op, ins: &[&Tensor], prec: Rounding) -> Result<Vec<Tensor>, InterpError> {
    let g = graph_of(op, ins);
    let feeds: HashMap<String, Tensor> = ins.iter().enumerate().map(|(i, t)| (format!("x{i}"), (*t).clone())).collect();
    run(&g, &Bindings::default(), &feeds, prec)
}

fn eval(op: Op, ins: &[&Tensor], prec: Rounding) -> Vec<Tensor> {
    try_eval(op, ins, prec).unwrap_or_else(|e| panic!("{e}"))
}

fn eval1(op: Op, ins: &[&Tensor]) -> Tensor {
    eval(op, ins, F64).remove(0)
}

fn rnd(rng: &mut Rng, shape: &[usize]) -> Tensor {
    Tensor::random(rng, shape.to_vec(), DType::F32, 0)
}

fn ints(shape: &[usize], v: &[i32]) -> Tensor {
    Tensor::from_i32(shape.to_vec(), v)
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Central finite differences of `f` with respect to every element of `ins[which]`.
fn fd(f: &dyn Fn(&[Tensor]) -> f64, ins: &[Tensor], which: usize) -> Vec<f64> {
    let eps = 1e-6;
    (0..ins[which].data.len())
        .map(|k| {
            let mut p = ins.to_vec();
            p[which].data[k] += eps;
            let up = f(&p);
            p[which].data[k] -= 2.0 * eps;
            (up - f(&p)) / (2.0 * eps)
        })
        .collect()
}

// ---- sources ---------------------------------------------------------------------------------

#[test]
fn sources_const_iota_param() {
    let mut g = Graph::new("s", &["B"]);
    let bt = |d| Type::new(d, Shape(vec![Dim::sym("B"), Dim::lit(3)].into()));
    let p = g.add1(Op::Param { name: "w".into(), ty: bt(DType::F32) }, &[]);
    let c = g.add1(Op::Const { value: 0.1, ty: bt(DType::F32) }, &[]);
    let cb = g.add1(Op::Const { value: 1.00390625, ty: Type::scalar(DType::BF16) }, &[]);
    let ci = g.add1(Op::Const { value: -7.0, ty: Type::scalar(DType::I32) }, &[]);
    let i0 = g.add1(Op::Iota { axis: 0, ty: bt(DType::I32) }, &[]);
    let i1 = g.add1(Op::Iota { axis: 1, ty: bt(DType::F32) }, &[]);
    for (k, v) in [p, c, cb, ci, i0, i1].into_iter().enumerate() {
        g.output(&format!("o{k}"), v);
    }
    let mut b = Bindings::default();
    b.set("B", 2);
    let w = Tensor::from_f32(vec![2, 3], &[1.5, -2.0, 3.25, 0.5, 7.0, -1.0]);
    let feeds = HashMap::from([("w".to_string(), w.clone())]);
    let o = run(&g, &b, &feeds, F32).unwrap();
    assert_eq!(o[0], w);
    assert_eq!(o[1].data, vec![0.1f32 as f64; 6]);
    assert_eq!(o[2].data, vec![1.0]);
    assert_eq!(o[3].data, vec![-7.0]);
    assert_eq!(o[4].data, vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    assert_eq!(o[5].data, vec![0.0, 1.0, 2.0, 0.0, 1.0, 2.0]);
    assert_eq!(o[5].dtype, DType::F32);
    // F64 keeps the constant exact; run_all agrees with run.
    let all = run_all(&g, &b, &feeds, F64).unwrap();
    assert_eq!(all[c.0 as usize].data, vec![0.1; 6]);
    assert_eq!(all[cb.0 as usize].data, vec![1.00390625]);
}

// ---- elementwise -----------------------------------------------------------------------------

#[test]
fn unary_ops_match_formulas() {
    let mut rng = Rng::new(1);
    let x = Tensor::new(DType::F32, vec![3, 4], (0..12).map(|_| rng.range(0.1, 3.0) as f32 as f64).collect());
    let cases: [(UnaryOp, fn(f64) -> f64); 7] = [
        (UnaryOp::Neg, |v| -v),
        (UnaryOp::Exp, |v| v.exp()),
        (UnaryOp::Log, |v| v.ln()),
        (UnaryOp::Sqrt, |v| v.sqrt()),
        (UnaryOp::Rsqrt, |v| 1.0 / v.sqrt()),
        (UnaryOp::Tanh, |v| v.tanh()),
        (UnaryOp::Recip, |v| 1.0 / v),
    ];
    for (u, f) in cases {
        let want: Vec<f64> = x.data.iter().map(|&v| f(v)).collect();
        assert_close_slice("unary_ops_match_formulas", &eval1(Op::Unary(u), &[&x]).data, &want, 1e-15, 1e-15);
        // F32 rounds each result to f32.
        let want32: Vec<f64> = want.iter().map(|&v| v as f32 as f64).collect();
        assert_eq!(eval(Op::Unary(u), &[&x], F32)[0].data, want32, "{u:?}");
    }
}

#[test]
fn binary_float_and_int() {
    let mut rng = Rng::new(2);
    let (a, b) = (rnd(&mut rng, &[2, 5]), rnd(&mut rng, &[2, 5]));
    let cases: [(BinaryOp, fn(f64, f64) -> f64); 6] = [
        (BinaryOp::Add, |x, y| x + y),
        (BinaryOp::Sub, |x, y| x - y),
        (BinaryOp::Mul, |x, y| x * y),
        (BinaryOp::Div, |x, y| x / y),
        (BinaryOp::Max, |x, y| if x > y { x } else { y }),
        (BinaryOp::Min, |x, y| if x < y { x } else { y }),
    ];
    for (op, f) in cases {
        let want: Vec<f64> = a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect();
        assert_close_slice("binary_float_and_int", &eval1(Op::Binary(op), &[&a, &b]).data, &want, 1e-15, 1e-15);
    }
    // NaN propagates through max and min, on either side.
    let n = Tensor::from_f32(vec![2], &[f32::NAN, 1.0]);
    let m = Tensor::from_f32(vec![2], &[1.0, f32::NAN]);
    for op in [BinaryOp::Max, BinaryOp::Min] {
        assert!(eval1(Op::Binary(op), &[&n, &m]).data.iter().all(|v| v.is_nan()));
    }
    // i32: truncating division, wrapping arithmetic, division by zero is an error.
    let (x, y) = (ints(&[3], &[7, -7, i32::MAX]), ints(&[3], &[2, 2, 1]));
    assert_eq!(eval1(Op::Binary(BinaryOp::Div), &[&x, &y]).data, vec![3.0, -3.0, i32::MAX as f64]);
    assert_eq!(eval1(Op::Binary(BinaryOp::Add), &[&x, &y]).data, vec![9.0, -5.0, i32::MIN as f64]);
    assert_eq!(eval1(Op::Binary(BinaryOp::Mul), &[&x, &y]).data, vec![14.0, -14.0, i32::MAX as f64]);
    let z = ints(&[3], &[1, 0, 1]);
    assert!(try_eval(Op::Binary(BinaryOp::Div), &[&x, &z], F32).is_err());
}

#[test]
fn compare_select_cast() {
    let a = Tensor::from_f32(vec![4], &[1.0, 2.0, 3.0, f32::NAN]);
    let b = Tensor::from_f32(vec![4], &[2.0, 2.0, 2.0, 1.0]);
    let cases = [
        (CmpOp::Lt, [1.0, 0.0, 0.0, 0.0]),
        (CmpOp::Le, [1.0, 1.0, 0.0, 0.0]),
        (CmpOp::Gt, [0.0, 0.0, 1.0, 0.0]),
        (CmpOp::Ge, [0.0, 1.0, 1.0, 0.0]),
        (CmpOp::Eq, [0.0, 1.0, 0.0, 0.0]),
        (CmpOp::Ne, [1.0, 0.0, 1.0, 1.0]),
    ];
    for (c, want) in cases {
        let r = eval1(Op::Compare(c), &[&a, &b]);
        assert_eq!((r.dtype, r.data), (DType::I32, want.to_vec()), "{c:?}");
    }
    let cond = ints(&[4], &[1, 0, 5, 0]);
    assert_eq!(eval1(Op::Select, &[&cond, &a, &b]).data[..3], [1.0, 2.0, 3.0]);
    assert_eq!(eval1(Op::Select, &[&cond, &a, &b]).data[3], 1.0);
    // float -> i32 truncates toward zero; out of range and NaN are errors.
    let f = Tensor::from_f32(vec![4], &[-2.7, 2.7, -0.5, 1e9]);
    assert_eq!(eval1(Op::Cast { to: DType::I32 }, &[&f]).data, vec![-2.0, 2.0, 0.0, 1e9]);
    for bad in [3e9f32, f32::NAN, f32::INFINITY] {
        assert!(try_eval(Op::Cast { to: DType::I32 }, &[&Tensor::from_f32(vec![1], &[bad])], F32).is_err());
    }
    // i32 -> f32 and same-dtype casts.
    let i = ints(&[2], &[16777217, -3]);
    assert_eq!(eval(Op::Cast { to: DType::F32 }, &[&i], F32)[0].data, vec![16777216.0, -3.0]);
    assert_eq!(eval(Op::Cast { to: DType::I32 }, &[&i], F32)[0].data, vec![16777217.0, -3.0]);
}

#[test]
fn cast_rounds_to_nearest_even() {
    // bf16 has 7 fraction bits: 1 + 1/256 is a tie between 1 and 1 + 1/128 (even: 1).
    // The third value is one f32 ulp above the first tie, so it rounds up.
    let above = f32::from_bits(1.00390625f32.to_bits() + 1);
    let x = Tensor::from_f32(vec![4], &[1.00390625, 1.01171875, above, -1.00390625]);
    let bf = eval(Op::Cast { to: DType::BF16 }, &[&x], F32).remove(0);
    assert_eq!(bf.data, vec![1.0, 1.015625, 1.0078125, -1.0]);
    // f16 has 10 fraction bits: 1 + 2^-11 ties to 1; 65520 overflows to infinity.
    let h = Tensor::from_f32(vec![3], &[1.0 + 1.0 / 2048.0, 65519.0, 65520.0]);
    assert_eq!(eval(Op::Cast { to: DType::F16 }, &[&h], F32)[0].data, vec![1.0, 65504.0, f64::INFINITY]);
    // F64 mode does not round.
    assert_eq!(eval(Op::Cast { to: DType::BF16 }, &[&x], F64)[0].data, x.data);
    // Agreement with the `half` crate on random f32 values over a wide exponent range.
    let mut rng = Rng::new(3);
    for _ in 0..20000 {
        let v = (rng.normal() * 2f64.powi(rng.below(80) as i32 - 40)) as f32;
        assert_eq!(round_to(DType::BF16, v as f64), half::bf16::from_f32(v).to_f64(), "bf16 {v:e}");
        assert_eq!(round_to(DType::F16, v as f64), half::f16::from_f32(v).to_f64(), "f16 {v:e}");
    }
}

#[test]
fn gelu_matches_formula_and_grad_matches_fd() {
    let mut rng = Rng::new(4);
    let (x, dy) = (rnd(&mut rng, &[3, 7]), rnd(&mut rng, &[3, 7]));
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let want: Vec<f64> = x.data.iter().map(|&v| 0.5 * v * (1.0 + (k * (v + 0.044715 * v.powi(3))).tanh())).collect();
    assert_close_slice("gelu_matches_formula_and_grad_matches_fd", &eval1(Op::Gelu, &[&x]).data, &want, 1e-15, 1e-15);
    let f = |t: &[Tensor]| dot(&eval1(Op::Gelu, &[&t[0]]).data, &dy.data);
    assert_close_slice(
        "gelu_matches_formula_and_grad_matches_fd",
        &eval1(Op::GeluGrad, &[&x, &dy]).data,
        &fd(&f, std::slice::from_ref(&x), 0),
        1e-6,
        1e-6,
    );
}

// ---- layout ----------------------------------------------------------------------------------

#[test]
fn reshape_broadcast_permute() {
    let mut rng = Rng::new(5);
    let x = rnd(&mut rng, &[2, 1, 3]);
    let r = eval1(Op::Reshape { shape: Shape::lits(&[3, 2]) }, &[&x]);
    assert_eq!((r.shape.clone(), r.data), (vec![3, 2], x.data.clone()));
    // [2, 1, 3] -> [2, 4, 5, 3]: operand axes go to result axes 0, 2, 3; axis 1 (size 1) repeats.
    let b = eval1(Op::Broadcast { dims: vec![0, 2, 3], shape: Shape::lits(&[2, 4, 5, 3]) }, &[&x]);
    for (i, j, k, l) in (0..2).flat_map(|i| (0..4).flat_map(move |j| (0..5).flat_map(move |k| (0..3).map(move |l| (i, j, k, l))))) {
        assert_eq!(b.data[((i * 4 + j) * 5 + k) * 3 + l], x.data[i * 3 + l]);
    }
    let y = rnd(&mut rng, &[2, 3, 4]);
    let p = eval1(Op::Permute { perm: vec![2, 0, 1] }, &[&y]);
    assert_eq!(p.shape, vec![4, 2, 3]);
    for (a, b_, c) in (0..4).flat_map(|a| (0..2).flat_map(move |b| (0..3).map(move |c| (a, b, c)))) {
        // result [a, b, c] = operand [b, c, a]
        assert_eq!(p.data[(a * 2 + b_) * 3 + c], y.data[(b_ * 3 + c) * 4 + a]);
    }
    let s = eval1(Op::Broadcast { dims: vec![], shape: Shape::lits(&[2, 2]) }, &[&Tensor::scalar(DType::F32, 1.5)]);
    assert_eq!(s.data, vec![1.5; 4]);
}

#[test]
fn slice_and_concat() {
    let mut rng = Rng::new(6);
    let x = rnd(&mut rng, &[3, 5, 2]);
    let s = eval1(Op::Slice { axis: 1, start: 1, end: 4 }, &[&x]);
    assert_eq!(s.shape, vec![3, 3, 2]);
    for (i, j, k) in (0..3).flat_map(|i| (0..3).flat_map(move |j| (0..2).map(move |k| (i, j, k)))) {
        assert_eq!(s.data[(i * 3 + j) * 2 + k], x.data[(i * 5 + j + 1) * 2 + k]);
    }
    let (a, b, c) = (rnd(&mut rng, &[2, 1, 3]), rnd(&mut rng, &[2, 2, 3]), rnd(&mut rng, &[2, 3, 3]));
    let r = eval1(Op::Concat { axis: 1 }, &[&a, &b, &c]);
    assert_eq!(r.shape, vec![2, 6, 3]);
    for i in 0..2 {
        for j in 0..6 {
            for k in 0..3 {
                let want = match j {
                    0 => a.data[i * 3 + k],
                    1..=2 => b.data[(i * 2 + j - 1) * 3 + k],
                    _ => c.data[(i * 3 + j - 3) * 3 + k],
                };
                assert_eq!(r.data[(i * 6 + j) * 3 + k], want);
            }
        }
    }
}

#[test]
fn gather_and_scatter_add_are_adjoint() {
    let mut rng = Rng::new(7);
    let table = rnd(&mut rng, &[5, 3]);
    let idx = ints(&[2, 3], &[4, 0, 4, 2, 1, 4]);
    let g = eval1(Op::Gather, &[&table, &idx]);
    assert_eq!(g.shape, vec![2, 3, 3]);
    for s in 0..6 {
        let r = idx.data[s] as usize;
        assert_eq!(g.data[s * 3..s * 3 + 3], table.data[r * 3..r * 3 + 3]);
    }
    let y = rnd(&mut rng, &[2, 3, 3]);
    let sc = eval1(Op::ScatterAdd { rows: Dim::lit(5) }, &[&y, &idx]);
    assert_eq!(sc.shape, vec![5, 3]);
    assert_close_slice("gather_and_scatter_add_are_adjoint", &[dot(&g.data, &y.data)], &[dot(&table.data, &sc.data)], 1e-14, 1e-14);
    // Row 4 gets three contributions, row 3 none.
    for c in 0..3 {
        assert_close_slice(
            "gather_and_scatter_add_are_adjoint",
            &[sc.data[4 * 3 + c]],
            &[y.data[c] + y.data[2 * 3 + c] + y.data[5 * 3 + c]],
            1e-15,
            1e-15,
        );
        assert_eq!(sc.data[3 * 3 + c], 0.0);
    }
}

// ---- reductions and matmul -------------------------------------------------------------------

#[test]
fn reduce_sum_and_max() {
    let mut rng = Rng::new(8);
    let x = rnd(&mut rng, &[3, 4, 5]);
    let s = eval1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 2] }, &[&x]);
    let m = eval1(Op::Reduce { op: ReduceOp::Max, axes: vec![0, 2] }, &[&x]);
    assert_eq!(s.shape, vec![4]);
    for j in 0..4 {
        let vals: Vec<f64> = (0..3).flat_map(|i| (0..5).map(move |k| (i, k))).map(|(i, k)| x.data[(i * 4 + j) * 5 + k]).collect();
        assert_close_slice("reduce_sum_and_max", &[s.data[j]], &[vals.iter().sum()], 1e-14, 1e-14);
        assert_eq!(m.data[j], vals.iter().cloned().fold(f64::MIN, f64::max));
    }
    let all = eval1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1, 2] }, &[&x]);
    assert_eq!(all.shape, Vec::<usize>::new());
    assert_close_slice("reduce_sum_and_max", &all.data, &[x.data.iter().sum()], 1e-14, 1e-14);
    let n = Tensor::from_f32(vec![3], &[1.0, f32::NAN, 2.0]);
    assert!(eval1(Op::Reduce { op: ReduceOp::Max, axes: vec![0] }, &[&n]).data[0].is_nan());
    let i = ints(&[2, 2], &[1, -5, 3, 4]);
    assert_eq!(eval1(Op::Reduce { op: ReduceOp::Sum, axes: vec![1] }, &[&i]).data, vec![-4.0, 7.0]);
}

#[test]
fn matmul_all_transposes_batched_and_shared() {
    let mut rng = Rng::new(9);
    let (batch, m, k, n) = (2 * 3, 4, 5, 3);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        for shared in [false, true] {
            let a_shape = if ta { vec![2, 3, k, m] } else { vec![2, 3, m, k] };
            let mut b_shape = if tb { vec![n, k] } else { vec![k, n] };
            if !shared {
                b_shape.splice(0..0, [2, 3]);
            }
            let (a, b) = (rnd(&mut rng, &a_shape), rnd(&mut rng, &b_shape));
            let r = eval1(Op::MatMul { trans_a: ta, trans_b: tb }, &[&a, &b]);
            assert_eq!(r.shape, vec![2, 3, m, n]);
            for z in 0..batch {
                let bz = if shared { 0 } else { z };
                for i in 0..m {
                    for j in 0..n {
                        let mut s = 0.0;
                        for p in 0..k {
                            let av = if ta { a.data[z * k * m + p * m + i] } else { a.data[z * m * k + i * k + p] };
                            let bv = if tb { b.data[bz * n * k + j * k + p] } else { b.data[bz * k * n + p * n + j] };
                            s += av * bv;
                        }
                        assert_close_slice("matmul_all_transposes_batched_and_shared", &[r.data[(z * m + i) * n + j]], &[s], 1e-14, 1e-14);
                    }
                }
            }
        }
    }
}

// ---- composites ------------------------------------------------------------------------------

#[test]
fn layernorm_forward_and_grad() {
    let mut rng = Rng::new(10);
    let (x, w, b) = (rnd(&mut rng, &[2, 3, 6]), rnd(&mut rng, &[6]), rnd(&mut rng, &[6]));
    let eps = 1e-5;
    let o = eval(Op::LayerNorm { eps }, &[&x, &w, &b], F64);
    for r in 0..6 {
        let row = &x.data[r * 6..r * 6 + 6];
        let mean = row.iter().sum::<f64>() / 6.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 6.0;
        assert_close_slice("layernorm_forward_and_grad", &[o[1].data[r], o[2].data[r]], &[mean, 1.0 / (var + eps).sqrt()], 1e-14, 1e-14);
        for c in 0..6 {
            let want = (row[c] - mean) / (var + eps).sqrt() * w.data[c] + b.data[c];
            assert_close_slice("layernorm_forward_and_grad", &[o[0].data[r * 6 + c]], &[want], 1e-14, 1e-14);
        }
    }
    assert_eq!((o[1].shape.clone(), o[2].shape.clone()), (vec![2, 3], vec![2, 3]));
    let dy = rnd(&mut rng, &[2, 3, 6]);
    let g = eval(Op::LayerNormGrad, &[&dy, &x, &w, &o[1], &o[2]], F64);
    let f = |t: &[Tensor]| dot(&eval1(Op::LayerNorm { eps }, &[&t[0], &t[1], &t[2]]).data, &dy.data);
    let ins = [x.clone(), w.clone(), b.clone()];
    for k in 0..3 {
        assert_close_slice("layernorm_forward_and_grad", &g[k].data, &fd(&f, &ins, k), 1e-6, 1e-6);
    }
}

#[test]
fn softmax_forward_and_grad() {
    let mut rng = Rng::new(11);
    let x = rnd(&mut rng, &[2, 2, 5]);
    let y = eval1(Op::Softmax, &[&x]);
    for r in 0..4 {
        let row = &x.data[r * 5..r * 5 + 5];
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        let want: Vec<f64> = row.iter().map(|v| v.exp() / z).collect();
        assert_close_slice("softmax_forward_and_grad", &y.data[r * 5..r * 5 + 5], &want, 1e-14, 1e-14);
    }
    let dy = rnd(&mut rng, &[2, 2, 5]);
    let f = |t: &[Tensor]| dot(&eval1(Op::Softmax, &[&t[0]]).data, &dy.data);
    assert_close_slice(
        "softmax_forward_and_grad",
        &eval1(Op::SoftmaxGrad, &[&y, &dy]).data,
        &fd(&f, std::slice::from_ref(&x), 0),
        1e-6,
        1e-6,
    );
    // Large inputs do not overflow (max subtraction).
    let big = Tensor::from_f32(vec![2], &[1000.0, 1000.0]);
    assert_eq!(eval1(Op::Softmax, &[&big]).data, vec![0.5, 0.5]);
}

#[test]
fn cross_entropy_forward_and_grad() {
    let mut rng = Rng::new(12);
    let (vocab, vp) = (5usize, 8usize);
    let logits = rnd(&mut rng, &[2, 3, vp]);
    let targets = ints(&[2, 3], &[0, 4, 2, 1, 3, 4]);
    let loss = eval1(Op::CrossEntropy { vocab: vocab as u64 }, &[&logits, &targets]);
    assert_eq!(loss.shape, vec![2, 3]);
    for r in 0..6 {
        let row = &logits.data[r * vp..r * vp + vocab];
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        let want = -(row[targets.data[r] as usize].exp() / z).ln();
        assert_close_slice("cross_entropy_forward_and_grad", &[loss.data[r]], &[want], 1e-14, 1e-14);
    }
    let dloss = rnd(&mut rng, &[2, 3]);
    let d = eval1(Op::CrossEntropyGrad { vocab: vocab as u64 }, &[&logits, &targets, &dloss]);
    let f = |t: &[Tensor]| dot(&eval1(Op::CrossEntropy { vocab: vocab as u64 }, &[&t[0], &targets]).data, &dloss.data);
    assert_close_slice("cross_entropy_forward_and_grad", &d.data, &fd(&f, std::slice::from_ref(&logits), 0), 1e-6, 1e-6);
    for r in 0..6 {
        assert!(d.data[r * vp + vocab..(r + 1) * vp].iter().all(|&v| v == 0.0), "padding columns are zero");
    }
    // A target in the padding (>= vocab) or negative is an error, not a panic.
    for bad in [5, -1] {
        let t = ints(&[2, 3], &[0, 1, bad, 1, 1, 1]);
        assert!(try_eval(Op::CrossEntropy { vocab: 5 }, &[&logits, &t], F32).is_err());
        assert!(try_eval(Op::CrossEntropyGrad { vocab: 5 }, &[&logits, &t, &dloss], F32).is_err());
    }
}

/// Causal attention written out directly on the packed `[S, T, 3C]` layout with an explicit
/// masked score matrix: `(out [S, T, C], lse [S, heads, T])`.
fn attention_ref(qkv: &Tensor, heads: usize, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (s_n, t, c3) = (qkv.shape[0], qkv.shape[1], qkv.shape[2]);
    let c = c3 / 3;
    let d = c / heads;
    let at = |s: usize, i: usize, part: usize, h: usize, k: usize| qkv.data[(s * t + i) * c3 + part * c + h * d + k];
    let (mut out, mut lse) = (vec![0.0; s_n * t * c], vec![]);
    for s in 0..s_n {
        for h in 0..heads {
            for i in 0..t {
                let sc: Vec<f64> = (0..t)
                    .map(|j| {
                        if j <= i {
                            scale * (0..d).map(|k| at(s, i, 0, h, k) * at(s, j, 1, h, k)).sum::<f64>()
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let z: f64 = sc.iter().map(|x| x.exp()).sum();
                lse.push(z.ln());
                for k in 0..d {
                    out[(s * t + i) * c + h * d + k] = (0..t).map(|j| sc[j].exp() / z * at(s, j, 2, h, k)).sum();
                }
            }
        }
    }
    (out, lse)
}

#[test]
fn attention_forward_and_grad() {
    let mut rng = Rng::new(13);
    let (heads, scale) = (2, 1.0 / 3f64.sqrt());
    let qkv = rnd(&mut rng, &[2, 5, 3 * heads * 3]);
    let op = Op::Attention { heads: heads as u64, scale };
    let o = eval(op.clone(), &[&qkv], F64);
    let (out, lse) = attention_ref(&qkv, heads, scale);
    assert_close_slice("attention_forward_and_grad", &o[0].data, &out, 1e-13, 1e-13);
    assert_close_slice("attention_forward_and_grad", &o[1].data, &lse, 1e-13, 1e-13);
    assert_eq!(o[0].shape, vec![2, 5, 6]);
    assert_eq!(o[1].shape, vec![2, 2, 5]);
    let dout = rnd(&mut rng, &[2, 5, 6]);
    let g = eval1(Op::AttentionGrad { heads: heads as u64, scale }, &[&qkv, &o[0], &o[1], &dout]);
    let f = |t: &[Tensor]| dot(&eval(op.clone(), &[&t[0]], F64)[0].data, &dout.data);
    assert_close_slice("attention_forward_and_grad", &g.data, &fd(&f, std::slice::from_ref(&qkv), 0), 1e-6, 1e-6);
}

#[test]
fn adamw_matches_formula() {
    let mut rng = Rng::new(14);
    let (p, g, m) = (rnd(&mut rng, &[3, 4]), rnd(&mut rng, &[3, 4]), rnd(&mut rng, &[3, 4]));
    let v = Tensor::new(DType::F32, vec![3, 4], (0..12).map(|_| rng.range(0.0, 1.0) as f32 as f64).collect());
    let (b1, b2, eps, wd, t) = (0.9, 0.999, 1e-8, 0.01, 3);
    let (lr, bc1, bc2) = (1e-3, 1.0 - 0.9f64.powi(t), 1.0 - 0.999f64.powi(t));
    let s = |x: f64| Tensor::scalar(DType::F32, x);
    let op = Op::AdamW { beta1: b1, beta2: b2, eps, weight_decay: wd };
    let o = eval(op.clone(), &[&p, &g, &m, &v, &s(lr), &s(bc1), &s(bc2)], F64);
    for i in 0..12 {
        let m2 = b1 * m.data[i] + (1.0 - b1) * g.data[i];
        let v2 = b2 * v.data[i] + (1.0 - b2) * g.data[i] * g.data[i];
        let p2 = p.data[i] - lr * ((m2 / bc1) / ((v2 / bc2).sqrt() + eps) + wd * p.data[i]);
        assert_close_slice("adamw_matches_formula", &[o[0].data[i], o[1].data[i], o[2].data[i]], &[p2, m2, v2], 1e-14, 1e-14);
    }
    // F32: every result is an f32 value close to the f64 one.
    let o32 = eval(op, &[&p, &g, &m, &v, &s(lr), &s(bc1), &s(bc2)], F32);
    for (a, b) in o32.iter().zip(&o) {
        assert!(a.data.iter().all(|&x| x == x as f32 as f64));
        assert_close_slice("adamw_matches_formula", &a.data, &b.data, 1e-6, 1e-6);
    }
}

// ---- whole graphs and errors -----------------------------------------------------------------

#[test]
fn symbolic_shapes_and_run_vs_run_all() {
    // y = sum over axis 1 of exp(x) * x, x: f32[B, 4]; the intermediate values are freed by run.
    let mut g = Graph::new("s", &["B"]);
    let ty = Type::new(DType::F32, Shape(vec![Dim::sym("B"), Dim::lit(4)].into()));
    let x = g.add1(Op::Input { name: "x".into(), ty }, &[]);
    let e = g.add1(Op::Unary(UnaryOp::Exp), &[x]);
    let m = g.add1(Op::Binary(BinaryOp::Mul), &[e, x]);
    let y = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![1] }, &[m]);
    g.output("y", y);
    g.output("e", e);
    let mut b = Bindings::default();
    b.set("B", 3);
    let mut rng = Rng::new(15);
    let feeds = random_feeds(&g, &b, &mut rng, 1).unwrap();
    let out = run(&g, &b, &feeds, F64).unwrap();
    let all = run_all(&g, &b, &feeds, F64).unwrap();
    assert_eq!(all.len(), g.values.len());
    assert_eq!(out[0], all[y.0 as usize]);
    assert_eq!(out[1], all[e.0 as usize]);
    let xs = &feeds["x"].data;
    for r in 0..3 {
        let want: f64 = (0..4).map(|c| xs[r * 4 + c].exp() * xs[r * 4 + c]).sum();
        assert_close_slice("symbolic_shapes_and_run_vs_run_all", &[out[0].data[r]], &[want], 1e-14, 1e-14);
    }
    // A missing binding is an error, and so is a binding that makes a tensor empty.
    assert!(run(&g, &Bindings::default(), &feeds, F64).is_err());
    let mut zero = Bindings::default();
    zero.set("B", 0);
    let empty = HashMap::from([("x".to_string(), Tensor::zeros(DType::F32, vec![0, 4]))]);
    assert!(run(&g, &zero, &empty, F64).unwrap_err().msg.contains("zero"));
}

#[test]
fn feed_and_index_errors() {
    let mut rng = Rng::new(16);
    let table = rnd(&mut rng, &[4, 2]);
    let idx = ints(&[3], &[0, 1, 2]);
    let g = graph_of(Op::Gather, &[&table, &idx]);
    let b = Bindings::default();
    let ok = HashMap::from([("x0".to_string(), table.clone()), ("x1".to_string(), idx.clone())]);
    assert!(run(&g, &b, &ok, F32).is_ok());

    let missing = HashMap::from([("x0".to_string(), table.clone())]);
    let e = run(&g, &b, &missing, F32).unwrap_err();
    assert!(e.msg.contains("x1") && e.node == Some(1), "{e}");

    let mut wrong = ok.clone();
    wrong.insert("x0".into(), rnd(&mut rng, &[4, 3]));
    assert!(run(&g, &b, &wrong, F32).unwrap_err().msg.contains("x0"));
    wrong.insert("x0".into(), Tensor::new(DType::BF16, vec![4, 2], table.data.clone()));
    assert!(run(&g, &b, &wrong, F32).unwrap_err().msg.contains("x0"));
    let mut frac = ok.clone();
    frac.insert("x1".into(), Tensor::new(DType::I32, vec![3], vec![0.0, 0.5, 1.0]));
    assert!(run(&g, &b, &frac, F32).is_err());

    for bad in [4, -1] {
        let i = ints(&[3], &[0, bad, 1]);
        let e = try_eval(Op::Gather, &[&table, &i], F32).unwrap_err();
        assert!(e.msg.contains("out of range"), "{e}");
        let src = rnd(&mut rng, &[3, 2]);
        assert!(try_eval(Op::ScatterAdd { rows: Dim::lit(4) }, &[&src, &i], F32).is_err());
    }
    // An ill-formed graph is reported, not run.
    let mut bad = g.clone();
    bad.outputs.push(("out0".into(), bad.outputs[0].1));
    assert!(run(&bad, &b, &ok, F32).is_err());
}

#[test]
fn bf16_rounding_of_f32_values_is_nearest_even() {
    // The fast path of `round_to(BF16, ..)` for f32 values (bit arithmetic, as the CUDA
    // prelude does it) against the definition: the nearest bf16 value, ties to the even one,
    // overflow to infinity, NaN kept. Every 65,537th f32 bit pattern and the edge cases.
    let bf = |bits: u32| f32::from_bits(bits) as f64;
    let mut patterns: Vec<u32> = (0..u32::MAX).step_by(65_537).collect();
    patterns.extend([0, 1, 0x8000, 0x8001, 0x7fff, 0x1_8000, 0x7f7f_8000, 0x7f7f_7fff, 0x7f7f_ffff, 0x7f80_0000, 0x0080_0000]);
    for u in patterns.iter().flat_map(|&u| [u, u | 0x8000_0000]) {
        let x = f32::from_bits(u);
        let got = fusec_ir::interp::round_to(DType::BF16, x as f64);
        if x.is_nan() {
            assert!(got.is_nan());
            continue;
        }
        let (lo, hi) = (u & 0xffff_0000, (u & 0xffff_0000).wrapping_add(0x1_0000));
        // Past the largest bf16 the next value is 2^128 with an unbounded exponent: rounding to
        // it overflows to infinity.
        let overflow = (hi & 0x7f80_0000) == 0x7f80_0000;
        let (a, b) = (bf(lo), if overflow { 2f64.powi(128).copysign(x as f64) } else { bf(hi) });
        let (da, db) = ((x as f64 - a).abs(), (x as f64 - b).abs());
        let want = if da < db || (da == db && (lo >> 16) & 1 == 0) { a } else if overflow { b.signum() * f64::INFINITY } else { b };
        assert!(got == want || (got == 0.0 && want == 0.0), "{u:#x}: {got} vs {want}");
    }
}
