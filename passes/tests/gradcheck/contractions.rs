//! Gradient checks of reductions, products and indexing (gather, scatter-add).

use super::*;

// ---- reductions and contractions -----------------------------------------------------------

#[test]
fn reduce_sum() {
    let axes_list: Vec<Vec<usize>> = vec![vec![0], vec![1], vec![2], vec![0, 2], vec![1, 2], vec![0, 1], vec![0, 1, 2]];
    for (k, axes) in axes_list.into_iter().enumerate() {
        let mut c = Case::new(&format!("reduce_sum_{k}"), 110 + k as u64);
        let x = c.param("x", ls(&[2, 3, 4]), Init::Normal(1.0));
        let y = c.op(Op::Reduce { op: ReduceOp::Sum, axes }, &[x]);
        // A nonlinearity after the reduction so that the adjoint is not a constant.
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    let mut c = Case::new("reduce_sum_symbolic", 118);
    let x = c.param("x", shp(&[sym("B"), sym("T"), lit(2)]), Init::Normal(1.0));
    let y = c.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 2] }, &[x]);
    let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
    gradcheck(&c.finish(z));
}

#[test]
fn reduce_max() {
    let axes_list: Vec<Vec<usize>> = vec![vec![0], vec![1], vec![2], vec![0, 2], vec![0, 1, 2]];
    for (k, axes) in axes_list.into_iter().enumerate() {
        let mut c = Case::new(&format!("reduce_max_{k}"), 130 + k as u64);
        let x = c.param("x", ls(&[2, 3, 4]), Init::Distinct);
        let y = c.op(Op::Reduce { op: ReduceOp::Max, axes: axes.clone() }, &[x]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        let groups: usize = [2usize, 3, 4].iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, d)| *d).product();
        let grads = gradcheck(&c.finish(z));
        // Exactly one element per reduced group gets a gradient.
        assert_eq!(grads["x"].data.iter().filter(|v| **v != 0.0).count(), groups);
    }
}

#[test]
fn matmul_all_transposes() {
    let (m, k, n) = (3u64, 4u64, 5u64);
    for batch in [vec![], vec![2u64], vec![2, 2]] {
        for ta in [false, true] {
            for tb in [false, true] {
                let mut c = Case::new(&format!("matmul_{batch:?}_{ta}_{tb}"), 150);
                let mut sa = batch.clone();
                sa.extend(if ta { [k, m] } else { [m, k] });
                let mut sb = batch.clone();
                sb.extend(if tb { [n, k] } else { [k, n] });
                let a = c.param("a", ls(&sa), Init::Normal(1.0));
                let b = c.param("b", ls(&sb), Init::Normal(1.0));
                let y = c.op(Op::MatMul { trans_a: ta, trans_b: tb }, &[a, b]);
                gradcheck(&c.finish(y));
            }
        }
    }
}

#[test]
fn matmul_shared_rank2_b() {
    // a: [..batch, M, K] with b rank 2 shared across the batch, trans_b false and true.
    let (m, k, n) = (3u64, 4u64, 5u64);
    let batches: Vec<Vec<Dim>> = vec![vec![lit(2)], vec![lit(2), lit(3)], vec![sym("B")], vec![sym("B"), sym("T")]];
    for (bi, batch) in batches.into_iter().enumerate() {
        for tb in [false, true] {
            let mut c = Case::new(&format!("matmul_shared_{bi}_{tb}"), 160 + bi as u64);
            let mut sa = batch.clone();
            sa.extend([lit(m), lit(k)]);
            let a = c.param("a", shp(&sa), Init::Normal(1.0));
            let b = c.param("b", if tb { ls(&[n, k]) } else { ls(&[k, n]) }, Init::Normal(1.0));
            let y = c.op(Op::MatMul { trans_a: false, trans_b: tb }, &[a, b]);
            gradcheck(&c.finish(y));
        }
    }
}

#[test]
fn matmul_shared_rank2_b_with_transposed_a() {
    // op(a) = a^T per batch with b shared: the forward is well-typed; autodiff must either
    // differentiate it correctly or return an error, never panic.
    let (m, k, n) = (3u64, 4u64, 5u64);
    for tb in [false, true] {
        let mut c = Case::new(&format!("matmul_shared_ta_{tb}"), 170);
        let a = c.param("a", ls(&[2, k, m]), Init::Normal(1.0));
        let b = c.param("b", if tb { ls(&[n, k]) } else { ls(&[k, n]) }, Init::Normal(1.0));
        let y = c.op(Op::MatMul { trans_a: true, trans_b: tb }, &[a, b]);
        let c = c.finish(y);
        let r = catch_unwind(AssertUnwindSafe(|| autodiff(&c.g)));
        match r {
            Ok(Err(_)) => {}
            Ok(Ok(_)) => {
                gradcheck(&c);
            }
            Err(p) => {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                panic!("autodiff panicked on matmul(trans_a, trans_b={tb}) with a shared rank-2 b instead of returning Err: {msg}");
            }
        }
    }
}

#[test]
fn matmul_operands_from_one_param() {
    // x @ x^T: both operand contributions reach the same accumulator.
    let mut c = Case::new("matmul_xxt", 171);
    let x = c.param("x", ls(&[3, 4]), Init::Normal(1.0));
    let y = c.op(Op::MatMul { trans_a: false, trans_b: true }, &[x, x]);
    gradcheck(&c.finish(y));
}

// ---- indexing ------------------------------------------------------------------------------

#[test]
fn gather() {
    {
        let mut c = Case::new("gather", 180);
        let t = c.param("table", ls(&[5, 3]), Init::Normal(1.0));
        // Repeated rows (accumulation) and a row never used (row 4: zero gradient).
        let idx = c.ints("idx", ls(&[2, 4]), &[0, 2, 2, 1, 3, 0, 2, 1]);
        let y = c.op(Op::Gather, &[t, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        let g = gradcheck(&c.finish(z));
        assert!(g["table"].data[12..15].iter().all(|v| *v == 0.0), "unused rows get zero gradient");
    }
    {
        let mut c = Case::new("gather_symbolic", 181);
        let t = c.param("table", ls(&[7, 2]), Init::Normal(1.0));
        let idx = c.rand_ints("idx", shp(&[sym("B"), sym("T")]), 7);
        let y = c.op(Op::Gather, &[t, idx]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn scatter_add() {
    {
        let mut c = Case::new("scatter_add", 190);
        let src = c.param("src", ls(&[6, 3]), Init::Normal(1.0));
        let idx = c.ints("idx", ls(&[6]), &[1, 3, 1, 0, 3, 1]);
        let y = c.op(Op::ScatterAdd { rows: lit(4) }, &[src, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    {
        let mut c = Case::new("scatter_add_rank3", 191);
        let src = c.param("src", ls(&[2, 3, 2]), Init::Normal(1.0));
        let idx = c.rand_ints("idx", ls(&[2, 3]), 5);
        let y = c.op(Op::ScatterAdd { rows: lit(5) }, &[src, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    {
        let mut c = Case::new("scatter_add_symbolic_rows", 192);
        let src = c.param("src", ls(&[4, 2]), Init::Normal(1.0));
        let idx = c.ints("idx", ls(&[4]), &[1, 0, 1, 1]);
        let y = c.op(Op::ScatterAdd { rows: sym("B") }, &[src, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
}
