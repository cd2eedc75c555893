//! Gradient checks of the elementwise ops.

use super::*;

// ---- elementwise ---------------------------------------------------------------------------

#[test]
fn unary_ops() {
    for (k, u) in Op::UNARY.into_iter().enumerate() {
        let init = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => Init::Pos,
            _ => Init::Normal(1.0),
        };
        let mut c = Case::new(&format!("unary_{u:?}"), 100 + k as u64);
        let x = c.param("x", ls(&[2, 3]), init);
        let y = c.op(Op::Unary(u), &[x]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn unary_on_negative_inputs() {
    // recip on negative values (away from zero).
    let mut c = Case::new("recip_neg", 7);
    let data: Vec<f64> = (0..6).map(|i| if i % 2 == 0 { -0.5 - 0.25 * i as f64 } else { 0.7 + 0.1 * i as f64 }).collect();
    let x = c.param_data("x", ls(&[6]), data);
    let y = c.op(Op::Unary(UnaryOp::Recip), &[x]);
    gradcheck(&c.finish(y));
}

#[test]
fn binary_ops() {
    for (k, op) in Op::BINARY.into_iter().enumerate() {
        let mut c = Case::new(&format!("binary_{op:?}"), 200 + k as u64);
        let a = c.param("a", ls(&[3, 4]), Init::Normal(1.0));
        let b = match op {
            BinaryOp::Div => {
                // Divisors of both signs, |b| in [0.5, 2].
                let data: Vec<f64> = (0..12).map(|i| if i % 3 == 0 { -c.rng.range(0.5, 2.0) } else { c.rng.range(0.5, 2.0) }).collect();
                c.param_data("b", ls(&[3, 4]), data)
            }
            BinaryOp::Max | BinaryOp::Min => {
                // b = a +- [0.1, 1]: no ties, and each side wins somewhere.
                let a0 = c.feeds["a"].data.clone();
                let data: Vec<f64> =
                    a0.iter().enumerate().map(|(i, &x)| x + if i % 2 == 0 { 1.0 } else { -1.0 } * c.rng.range(0.1, 1.0)).collect();
                c.param_data("b", ls(&[3, 4]), data)
            }
            _ => c.param("b", ls(&[3, 4]), Init::Normal(1.0)),
        };
        let y = c.bin(op, a, b);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn binary_ops_with_one_operand_an_input() {
    // Only one side needs a gradient; the other is a per-step input.
    for (k, op) in Op::BINARY.into_iter().enumerate() {
        for param_first in [true, false] {
            let mut c = Case::new(&format!("binary_half_{op:?}_{param_first}"), 300 + k as u64);
            let p = c.param("p", ls(&[5]), Init::Pos);
            let data: Vec<f64> = (0..5).map(|i| 0.3 * i as f64 + 0.55 + if i % 2 == 0 { 2.0 } else { 0.0 }).collect();
            c.feeds.insert("x".into(), Tensor::new(DType::F32, vec![5], data));
            let x = c.g.add1(Op::Input { name: "x".into(), ty: Type::new(DType::F32, ls(&[5])) }, &[]);
            let y = if param_first { c.bin(op, p, x) } else { c.bin(op, x, p) };
            gradcheck(&c.finish(y));
        }
    }
}

#[test]
fn same_operand_twice() {
    // x * x, x / x, x - x, max(x, x) style uses: both contributions reach the accumulator.
    for op in [BinaryOp::Mul, BinaryOp::Add, BinaryOp::Sub, BinaryOp::Div] {
        let mut c = Case::new(&format!("twice_{op:?}"), 11);
        let x = c.param("x", ls(&[2, 3]), Init::Pos);
        let y = c.bin(op, x, x);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn intermediate_used_many_times() {
    // y = exp(x); z = y * tanh(y) + y / x: adjoints of y and x are sums of several contributions.
    let mut c = Case::new("fanout", 12);
    let x = c.param("x", ls(&[4]), Init::Pos);
    let y = c.op(Op::Unary(UnaryOp::Exp), &[x]);
    let t = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
    let a = c.bin(BinaryOp::Mul, y, t);
    let d = c.bin(BinaryOp::Div, y, x);
    let z = c.bin(BinaryOp::Add, a, d);
    gradcheck(&c.finish(z));
}

#[test]
fn select() {
    let mut c = Case::new("select", 13);
    let cond = c.ints("cond", ls(&[3, 4]), &[1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1]);
    let a = c.param("a", ls(&[3, 4]), Init::Normal(1.0));
    let b = c.param("b", ls(&[3, 4]), Init::Normal(1.0));
    let y = c.op(Op::Select, &[cond, a, b]);
    gradcheck(&c.finish(y));
}

#[test]
fn select_with_condition_computed_from_a_param() {
    // cond = x > 0 depends on a parameter but has no gradient (i32); x still gets its
    // gradient through the selected branch.
    let mut c = Case::new("select_cmp", 14);
    let data = vec![0.7, -0.4, 1.2, -1.5, 0.3, -0.9];
    let x = c.param_data("x", ls(&[6]), data);
    let zero = c.op(Op::Const { value: 0.0, ty: Type::new(DType::F32, ls(&[6])) }, &[]);
    let cond = c.op(Op::Compare(CmpOp::Gt), &[x, zero]);
    let e = c.op(Op::Unary(UnaryOp::Exp), &[x]);
    let n = c.op(Op::Unary(UnaryOp::Neg), &[x]);
    let y = c.op(Op::Select, &[cond, e, n]);
    gradcheck(&c.finish(y));
}

#[test]
fn cast_to_same_dtype() {
    let mut c = Case::new("cast", 15);
    let x = c.param("x", ls(&[2, 3]), Init::Normal(1.0));
    let y = c.op(Op::Cast { to: DType::F32 }, &[x]);
    let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
    gradcheck(&c.finish(z));
}

#[test]
fn cast_round_trip_through_bf16() {
    // F64 mode never rounds floats, so f32 -> bf16 -> f32 is the identity there; the backward
    // casts the adjoint back through each dtype.
    let mut c = Case::new("cast_bf16", 16);
    let x = c.param("x", ls(&[5]), Init::Normal(1.0));
    let y = c.op(Op::Cast { to: DType::BF16 }, &[x]);
    let y = c.op(Op::Unary(UnaryOp::Exp), &[y]);
    let z = c.op(Op::Cast { to: DType::F32 }, &[y]);
    gradcheck(&c.finish(z));
}

#[test]
fn gelu() {
    let mut c = Case::new("gelu", 17);
    let x = c.param("x", ls(&[3, 4]), Init::Normal(1.5));
    let y = c.op(Op::Gelu, &[x]);
    gradcheck(&c.finish(y));
}
