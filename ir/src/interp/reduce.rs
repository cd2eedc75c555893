//! Reductions and matrix products. Float accumulation is in f64 (rounded once by the run loop).

use super::elementwise::max_nan;
use super::{strides, Tensor};
use crate::{DType, ReduceOp};

/// Reduces over `axes` (sorted, distinct), removing them.
pub(super) fn reduce(op: ReduceOp, x: &Tensor, axes: &[usize]) -> Tensor {
    let shape: Vec<usize> = x.shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect();
    // Stride in the output of each input axis (0 for reduced axes).
    let os = strides(&shape);
    let mut st = vec![0usize; x.shape.len()];
    let mut k = 0;
    for (i, s) in st.iter_mut().enumerate() {
        if !axes.contains(&i) {
            *s = os[k];
            k += 1;
        }
    }
    let n: usize = shape.iter().product();
    let int = x.dtype == DType::I32;
    let init = match op {
        ReduceOp::Sum => 0.0,
        ReduceOp::Max if int => i32::MIN as f64,
        ReduceOp::Max => f64::NEG_INFINITY,
    };
    let mut acc = vec![init; n];
    // Walk the input in row-major order, tracking the output offset.
    let mut idx = vec![0usize; x.shape.len()];
    let mut o = 0usize;
    for &v in &x.data {
        let a = &mut acc[o];
        *a = match op {
            ReduceOp::Sum if int => (*a as i32).wrapping_add(v as i32) as f64,
            ReduceOp::Sum => *a + v,
            ReduceOp::Max => max_nan(*a, v),
        };
        for ax in (0..idx.len()).rev() {
            idx[ax] += 1;
            o += st[ax];
            if idx[ax] < x.shape[ax] {
                break;
            }
            o -= st[ax] * idx[ax];
            idx[ax] = 0;
        }
    }
    Tensor { dtype: x.dtype, shape, data: acc }
}

/// Batched `op(a) @ op(b)` over the last two axes; `b` of rank 2 is shared across the batch.
/// Each product is a dot product of a row of `op(a)` and a column of `op(b)`, both first copied
/// to contiguous rows (so the inner loop is a plain dot product).
pub(super) fn matmul(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool, shape: Vec<usize>) -> Tensor {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k) = if trans_a { (a.shape[ra - 1], a.shape[ra - 2]) } else { (a.shape[ra - 2], a.shape[ra - 1]) };
    let n = if trans_b { b.shape[rb - 2] } else { b.shape[rb - 1] };
    let batch: usize = a.shape[..ra - 2].iter().product();
    let b_batch = if rb == 2 { 0 } else { k * n };
    let mut data = Vec::with_capacity(batch * m * n);
    let mut bt = Vec::new(); // op(b) transposed: row j is column j of op(b).
    for z in 0..batch {
        // Rows of op(a): [M, K]; rows of op(b)^T: [N, K].
        let ar = rows(&a.data[z * m * k..(z + 1) * m * k], m, k, trans_a);
        if z == 0 || b_batch != 0 {
            bt = rows(&b.data[z * b_batch..z * b_batch + k * n], n, k, !trans_b);
        }
        for i in 0..m {
            let arow = &ar[i * k..(i + 1) * k];
            for j in 0..n {
                let bcol = &bt[j * k..(j + 1) * k];
                data.push(arow.iter().zip(bcol).map(|(x, y)| x * y).sum::<f64>());
            }
        }
    }
    Tensor { dtype: a.dtype, shape, data }
}

/// `x` as an `[r, c]` row-major matrix: a copy of `x` if it is stored `[r, c]` (`transposed`
/// false), else the transpose of `x` stored `[c, r]`.
fn rows(x: &[f64], r: usize, c: usize, transposed: bool) -> Vec<f64> {
    if !transposed {
        return x.to_vec();
    }
    let mut out = Vec::with_capacity(r * c);
    for i in 0..r {
        out.extend((0..c).map(|p| x[p * r + i]));
    }
    out
}
