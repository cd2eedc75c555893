//! Composite ops expanded into primitive row-program operations.
//!
//! Each expansion follows the interpreter's formula (ir/src/interp/composite.rs, elementwise.rs)
//! and llm.c's CPU code for the order of operations, computing in f32 with one rounding per
//! operation (no FMA contraction). Row statistics are row reductions; the LayerNorm weight and
//! bias gradients are column reductions; cross-entropy masks the padding columns with a
//! comparison against the column index, and picks the target's logit with a masked row sum
//! (exact: every other term is zero).

use fusec_ir::rows::NodeId;
use fusec_ir::{BinaryOp, CmpOp, Op, ReduceOp, UnaryOp};

use super::Lowerer;

type R<T> = Result<T, String>;

/// `sqrt(2 / pi)`, the GELU tanh-form constant.
const GELU_SCALE: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh-form GELU.
const GELU_CUBE: f32 = 0.044715;

/// Lowers the composite (or AdamW) node `ni` of the body: its results, in order.
pub(crate) fn composite(l: &mut Lowerer, ni: usize) -> R<Vec<NodeId>> {
    let node = &l.b.g.nodes[ni];
    let ins = node.inputs.to_vec();
    let op = node.op.clone();
    let (e, row, col) = (l.elem_ctx(), l.row_ctx(), l.col_ctx());
    match op {
        Op::LayerNorm { eps } => {
            let (x, w, b) = (l.lower(ins[0], &e)?, l.lower(ins[1], &col)?, l.lower(ins[2], &col)?);
            layernorm(l, x, w, b, eps as f32)
        }
        Op::LayerNormGrad => {
            let (dy, x, w) = (l.lower(ins[0], &e)?, l.lower(ins[1], &e)?, l.lower(ins[2], &col)?);
            let (mean, rstd) = (l.lower(ins[3], &row)?, l.lower(ins[4], &row)?);
            layernorm_grad(l, dy, x, w, mean, rstd)
        }
        Op::Softmax => {
            let x = l.lower(ins[0], &e)?;
            Ok(vec![softmax(l, x)?])
        }
        Op::SoftmaxGrad => {
            let (y, dy) = (l.lower(ins[0], &e)?, l.lower(ins[1], &e)?);
            let dot = {
                let p = l.mul(y, dy)?;
                l.row_reduce(ReduceOp::Sum, p)?
            };
            let d = l.sub(dy, dot)?;
            Ok(vec![l.mul(y, d)?])
        }
        Op::CrossEntropy { vocab } => {
            let (x, t) = (l.lower(ins[0], &e)?, l.lower(ins[1], &row)?);
            Ok(vec![cross_entropy(l, x, t, vocab)?])
        }
        Op::CrossEntropyGrad { vocab } => {
            let (x, t, dl) = (l.lower(ins[0], &e)?, l.lower(ins[1], &row)?, l.lower(ins[2], &row)?);
            Ok(vec![cross_entropy_grad(l, x, t, dl, vocab)?])
        }
        Op::CrossEntropyWithGrad { vocab } => {
            // Both from one row: the max and the sum of exponentials are shared (the builder
            // merges equal nodes), so the pair costs the passes of the gradient alone.
            let (x, t, dl) = (l.lower(ins[0], &e)?, l.lower(ins[1], &row)?, l.lower(ins[2], &row)?);
            Ok(vec![cross_entropy(l, x, t, vocab)?, cross_entropy_grad(l, x, t, dl, vocab)?])
        }
        Op::AdamW { beta1, beta2, eps, weight_decay } => {
            let mut v = Vec::new();
            for &i in &ins[..4] {
                v.push(l.lower(i, &e)?);
            }
            for &i in &ins[4..7] {
                v.push(l.lower(i, &[])?);
            }
            let mut rs = adamw(l, &v, [beta1, beta2, eps, weight_decay])?;
            if ins.len() == 8 {
                // The low-precision copy: `p'` again, rounded to the copy's dtype by the caller.
                rs.push(rs[0]);
            }
            Ok(rs)
        }
        op => Err(format!("`{}` is not a composite", op.mnemonic())),
    }
}

/// The tanh-form GELU: `0.5 x (1 + tanh(s (x + 0.044715 x^3)))` (llm.c's order).
pub(crate) fn gelu(l: &mut Lowerer, x: NodeId) -> R<NodeId> {
    let (t, _) = gelu_tanh(l, x)?;
    let half = l.constf(0.5)?;
    let one = l.constf(1.0)?;
    let hx = l.mul(half, x)?;
    let onet = l.add(one, t)?;
    l.mul(hx, onet)
}

/// `tanh(s (x + 0.044715 x^3))` and its argument.
fn gelu_tanh(l: &mut Lowerer, x: NodeId) -> R<(NodeId, NodeId)> {
    let k = l.constf(GELU_CUBE)?;
    let s = l.constf(GELU_SCALE)?;
    let kx = l.mul(k, x)?;
    let kxx = l.mul(kx, x)?;
    let cube = l.mul(kxx, x)?;
    let inner = l.add(x, cube)?;
    let arg = l.mul(s, inner)?;
    Ok((l.un(UnaryOp::Tanh, arg)?, arg))
}

/// `dy` times the GELU derivative (llm.c's `gelu_backward`, with `sech^2 = (1 - t)(1 + t)`).
pub(crate) fn gelu_grad(l: &mut Lowerer, x: NodeId, dy: NodeId) -> R<NodeId> {
    let (t, _) = gelu_tanh(l, x)?;
    let (half, one) = (l.constf(0.5)?, l.constf(1.0)?);
    let s = l.constf(GELU_SCALE)?;
    let k3 = l.constf(3.0 * GELU_CUBE)?;
    let one_m = l.sub(one, t)?;
    let one_p = l.add(one, t)?;
    let sech2 = l.mul(one_m, one_p)?;
    let a = l.mul(half, one_p)?;
    let xh = l.mul(x, half)?;
    let b1 = l.mul(xh, sech2)?;
    let b2 = l.mul(b1, s)?;
    let k3x = l.mul(k3, x)?;
    let k3xx = l.mul(k3x, x)?;
    let poly = l.add(one, k3xx)?;
    let b = l.mul(b2, poly)?;
    let local = l.add(a, b)?;
    l.mul(local, dy)
}

/// The row mean `sum / C`: a division, as the interpreter computes it (`1 / C` is inexact).
fn row_mean(l: &mut Lowerer, x: NodeId) -> R<NodeId> {
    let s = l.row_reduce(ReduceOp::Sum, x)?;
    let c = l.constf(l.cols as f32)?;
    l.div(s, c)
}

/// LayerNorm with two-pass statistics: `[y, mean, rstd]`.
fn layernorm(l: &mut Lowerer, x: NodeId, w: NodeId, b: NodeId, eps: f32) -> R<Vec<NodeId>> {
    let mean = row_mean(l, x)?;
    let d = l.sub(x, mean)?;
    let d2 = l.mul(d, d)?;
    let var = row_mean(l, d2)?;
    let e = l.constf(eps)?;
    let ve = l.add(var, e)?;
    let rstd = l.un(UnaryOp::Rsqrt, ve)?;
    let n = l.mul(d, rstd)?;
    let nw = l.mul(n, w)?;
    let y = l.add(nw, b)?;
    Ok(vec![y, mean, rstd])
}

/// llm.c's `layernorm_backward`: `[dx, dw, db]` (dw, db summed over all rows).
fn layernorm_grad(l: &mut Lowerer, dy: NodeId, x: NodeId, w: NodeId, mean: NodeId, rstd: NodeId) -> R<Vec<NodeId>> {
    let xm = l.sub(x, mean)?;
    let norm = l.mul(xm, rstd)?;
    let dnorm = l.mul(dy, w)?;
    let m1 = row_mean(l, dnorm)?;
    let dn = l.mul(dnorm, norm)?;
    let m2 = row_mean(l, dn)?;
    let a = l.sub(dnorm, m1)?;
    let nm = l.mul(norm, m2)?;
    let b = l.sub(a, nm)?;
    let dx = l.mul(b, rstd)?;
    let dyn_ = l.mul(dy, norm)?;
    let dw = l.col_reduce(ReduceOp::Sum, dyn_)?;
    let db = l.col_reduce(ReduceOp::Sum, dy)?;
    Ok(vec![dx, dw, db])
}

/// NaN-propagating max of a row, then `exp(x - max)` and its row sum: `(e, sum)`. With `valid`,
/// columns where it is 0 are left out of both.
fn exp_sum(l: &mut Lowerer, x: NodeId, valid: Option<NodeId>) -> R<(NodeId, NodeId, NodeId)> {
    let masked = match valid {
        Some(v) => {
            let ninf = l.constf(f32::NEG_INFINITY)?;
            l.select(v, x, ninf)?
        }
        None => x,
    };
    let m = l.row_reduce(ReduceOp::Max, masked)?;
    let sh = l.sub(x, m)?;
    let e = l.un(UnaryOp::Exp, sh)?;
    let es = match valid {
        Some(v) => {
            let zero = l.constf(0.0)?;
            l.select(v, e, zero)?
        }
        None => e,
    };
    let s = l.row_reduce(ReduceOp::Sum, es)?;
    Ok((e, s, m))
}

/// `e / s` for an element value `e` and a row sum `s` (≥ 1: it includes `exp(max - max)`), as
/// `e * (1 / s)`: one division per row instead of one per element (the product is within an
/// ulp of the quotient).
fn div_by_row_sum(l: &mut Lowerer, e: NodeId, s: NodeId) -> R<NodeId> {
    let r = l.un(UnaryOp::Recip, s)?;
    l.mul(e, r)
}

/// Max-subtracted softmax over the row.
fn softmax(l: &mut Lowerer, x: NodeId) -> R<NodeId> {
    let (e, s, _) = exp_sum(l, x, None)?;
    div_by_row_sum(l, e, s)
}

/// The mask of the first `vocab` columns (`None` when that is every column).
fn vocab_mask(l: &mut Lowerer, vocab: u64) -> R<Option<NodeId>> {
    if vocab >= l.cols {
        return Ok(None);
    }
    let c = l.col_iota()?;
    let v = l.consti(vocab as i32)?;
    Ok(Some(l.cmp(CmpOp::Lt, c, v)?))
}

/// `logsumexp(x[:vocab]) - x[target]` per row.
fn cross_entropy(l: &mut Lowerer, x: NodeId, t: NodeId, vocab: u64) -> R<NodeId> {
    let valid = vocab_mask(l, vocab)?;
    let (_, s, m) = exp_sum(l, x, valid)?;
    let ls = l.un(UnaryOp::Log, s)?;
    let lse = l.add(m, ls)?;
    let c = l.col_iota()?;
    let hit = l.cmp(CmpOp::Eq, c, t)?;
    let zero = l.constf(0.0)?;
    let xt = l.select(hit, x, zero)?;
    let picked = l.row_reduce(ReduceOp::Sum, xt)?;
    l.sub(lse, picked)
}

/// `(softmax(x[:vocab]) - onehot(target)) * dloss`, zero in the padding columns.
fn cross_entropy_grad(l: &mut Lowerer, x: NodeId, t: NodeId, dloss: NodeId, vocab: u64) -> R<NodeId> {
    let valid = vocab_mask(l, vocab)?;
    let (e, s, _) = exp_sum(l, x, valid)?;
    let p = div_by_row_sum(l, e, s)?;
    let c = l.col_iota()?;
    let hit = l.cmp(CmpOp::Eq, c, t)?;
    let one = l.constf(1.0)?;
    let pm1 = l.sub(p, one)?;
    let pt = l.select(hit, pm1, p)?;
    let g = l.mul(pt, dloss)?;
    match valid {
        Some(v) => {
            let zero = l.constf(0.0)?;
            l.select(v, g, zero)
        }
        None => Ok(g),
    }
}

/// One AdamW step (PyTorch / llm.c): `[p', m', v']` from `[p, g, m, v, lr, bc1, bc2]`.
fn adamw(l: &mut Lowerer, v: &[NodeId], [b1, b2, eps, wd]: [f64; 4]) -> R<Vec<NodeId>> {
    let (p, g, m, vv, lr, bc1, bc2) = (v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
    let (cb1, cb1c) = (l.constf(b1 as f32)?, l.constf((1.0 - b1) as f32)?);
    let (cb2, cb2c) = (l.constf(b2 as f32)?, l.constf((1.0 - b2) as f32)?);
    let bm = l.mul(cb1, m)?;
    let gm = l.mul(cb1c, g)?;
    let m2 = l.add(bm, gm)?;
    let bv = l.mul(cb2, vv)?;
    let gv = l.mul(cb2c, g)?;
    let gvg = l.mul(gv, g)?;
    let v2 = l.add(bv, gvg)?;
    let mhat = l.div(m2, bc1)?;
    let vhat = l.div(v2, bc2)?;
    let sq = l.un(UnaryOp::Sqrt, vhat)?;
    let ce = l.constf(eps as f32)?;
    let den = l.add(sq, ce)?;
    let mut upd = l.div(mhat, den)?;
    if wd != 0.0 {
        let cwd = l.constf(wd as f32)?;
        let dp = l.mul(cwd, p)?;
        upd = l.add(upd, dp)?;
    }
    let step = l.mul(lr, upd)?;
    let p2 = l.bin(BinaryOp::Sub, p, step)?;
    Ok(vec![p2, m2, v2])
}
