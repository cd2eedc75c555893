//! The fused ops, `gemm` and `kernel`, defined by the unfused ops they replace.
//!
//! A fused op must give exactly what its unfused sequence gives, bit for bit, in both
//! precisions: `gemm` is evaluated as matmul, bias add, GELU, cast and accumulate, rounding
//! after each step exactly where the run loop would round the separate nodes' results (in
//! [`Rounding::F32`]), and `kernel` runs its body through the ordinary run loop.

use super::{elementwise, reduce, round_slice, run_body, Rounding, Tensor};
use crate::{BinaryOp, Bindings, DType, Gemm, Kernel};

/// `t` rounded to its dtype as a node result is in `prec`.
fn rounded(mut t: Tensor, prec: Rounding) -> Tensor {
    if prec == Rounding::F32 && t.dtype.is_float() {
        round_slice(t.dtype, &mut t.data);
    }
    t
}

/// `gemm`: `y = op(a) op(b)`, then `+ bias` over the last axis, then GELU (keeping the value
/// before it as the second result), then a cast to `out`, then `acc + y`, each step rounded
/// like the result of the corresponding unfused node. Results: `y`, then `pre_gelu` if `gelu`.
pub(super) fn gemm(gm: &Gemm, ins: &[&Tensor], outs: &[(DType, Vec<usize>)], prec: Rounding) -> Result<Vec<Tensor>, String> {
    let shape = outs[0].1.clone();
    let mut y = rounded(reduce::matmul(ins[0], ins[1], gm.trans_a, gm.trans_b, shape), prec);
    let mut next = 2;
    if gm.bias {
        // `add(y, broadcast(bias))`.
        let bias = ins[next];
        next += 1;
        let n = bias.data.len();
        for (k, v) in y.data.iter_mut().enumerate() {
            *v += bias.data[k % n];
        }
        y = rounded(y, prec);
    }
    let pre_gelu = gm.gelu.then(|| y.clone());
    if gm.gelu {
        y = rounded(elementwise::gelu(&y), prec);
    }
    if gm.out != y.dtype {
        y = rounded(elementwise::cast(&y, gm.out)?, prec);
    }
    if gm.accumulate {
        y = rounded(elementwise::binary(BinaryOp::Add, ins[next], &y)?, prec);
    }
    Ok(std::iter::once(y).chain(pre_gelu).collect())
}

/// `kernel`: its body run on the operands (the `k`-th `input` node receives operand `k`) with
/// the same bindings and precision; the results are the body's outputs in order.
pub(super) fn kernel(k: &Kernel, ins: &[&Tensor], bindings: &Bindings, prec: Rounding) -> Result<Vec<Tensor>, String> {
    run_body(&k.body, bindings, ins, prec).map_err(|e| format!("in the body of kernel `{}`: {e}", k.name))
}
