//! `autodiff`: reverse-mode differentiation of the `loss` output with respect to every parameter.
//!
//! The result graph keeps the forward nodes and appends the backward ones. It takes two kinds of
//! new inputs: `dloss: f32[]`, the seed (1 for a plain step, 1/k for k accumulated micro-steps:
//! a runtime scalar, so it never changes the graph), and one accumulator `grad.P` per parameter
//! `P`. It outputs `loss` and `grad.P = grad.P + dP` for each parameter: parameter gradients
//! accumulate, as in llm.c, and every contribution to a parameter used twice (the tied `wte`) is
//! its own add into the accumulator, in reverse program order, so that `fuse-grad-accum` can
//! turn each into its producer writing with beta = 1. Activation gradients are plain sums.
//!
//! Composites use their hand-written backward ops (`layernorm_grad`, `attention_grad`, ...).

use std::collections::{HashMap, HashSet};

use fusec_ir::{BinaryOp, CmpOp, DType, Dim, Graph, Op, ReduceOp, Type, UnaryOp, ValueId};

use crate::rewrite::{output_unique, remove_dead_nodes, Emit};

/// Name of the seed input.
pub const DLOSS: &str = "dloss";

/// The gradient accumulator (input and output) name of a parameter.
pub fn grad_name(param: &str) -> String {
    format!("grad.{param}")
}

/// Appends the backward graph; see the module docs for inputs and outputs. Fails (never
/// panics) on a graph it cannot differentiate, or whose names collide with the ones it adds.
pub fn autodiff(fwd: &Graph) -> Result<Graph, String> {
    let loss = fwd.output_named("loss").ok_or("autodiff needs an output named `loss`")?;
    if *fwd.ty(loss) != Type::scalar(DType::F32) {
        return Err(format!("autodiff needs `loss: f32[]`, found {}", fwd.ty(loss)));
    }
    let mut g = fwd.clone();
    g.outputs.retain(|(n, _)| n == "loss");
    let needs = needs_grad(fwd, loss);
    let n_fwd = fwd.nodes.len();
    let mut e = Emit::new(&mut g);
    let named = |r: Result<ValueId, String>| r.map_err(|m| format!("autodiff: {m}"));
    let seed = named(e.input(DLOSS, &Type::scalar(DType::F32)))?;
    let mut adj: HashMap<ValueId, ValueId> = HashMap::new();
    adj.insert(loss, seed);
    // Parameter accumulators: created on first contribution (reverse program order).
    let params: HashMap<ValueId, String> = fwd.params().into_iter().map(|(n, v)| (v, n.to_string())).collect();
    let mut acc: HashMap<ValueId, ValueId> = HashMap::new();
    if let Some(name) = params.get(&loss) {
        // The loss is a parameter itself: its gradient is the seed.
        let gin = named(e.input(&grad_name(name), &Type::scalar(DType::F32)))?;
        acc.insert(loss, named(e.bin(BinaryOp::Add, gin, seed))?);
    }

    for ni in (0..n_fwd).rev() {
        let node = &fwd.nodes[ni];
        let dys: Vec<Option<ValueId>> = node.results.iter().map(|r| adj.get(r).copied()).collect();
        if dys.iter().all(|d| d.is_none()) || !node.inputs.iter().any(|v| needs[v.0 as usize]) {
            continue;
        }
        let at = |m: String| format!("autodiff of node {ni} (`{}`): {m}", node.op.mnemonic());
        let contribs = backward_rule(&mut e, &node.op, &node.inputs, &node.results, &dys).map_err(at)?;
        for (x, dx) in node.inputs.iter().zip(contribs) {
            let Some(dx) = dx else { continue };
            if !needs[x.0 as usize] {
                continue;
            }
            if let Some(name) = params.get(x) {
                let cur = match acc.get(x) {
                    Some(&a) => a,
                    None => {
                        let ty = e.g.ty(*x).clone();
                        e.input(&grad_name(name), &ty).map_err(at)?
                    }
                };
                acc.insert(*x, e.bin(BinaryOp::Add, cur, dx).map_err(at)?);
            } else {
                let sum = match adj.get(x) {
                    Some(&prev) => e.bin(BinaryOp::Add, prev, dx).map_err(at)?,
                    None => dx,
                };
                adj.insert(*x, sum);
            }
        }
    }
    let mut outs = vec![];
    for (name, v) in fwd.params() {
        let out = match acc.get(&v) {
            Some(&a) => a,
            None => {
                let ty = e.g.ty(v).clone();
                named(e.input(&grad_name(name), &ty))?
            }
        };
        outs.push((grad_name(name), out));
    }
    let mut taken: HashSet<String> = g.outputs.iter().map(|(n, _)| n.clone()).collect();
    for (name, v) in outs {
        output_unique(&mut g, &mut taken, &name, v).map_err(|m| format!("autodiff: {m}"))?;
    }
    // Rules emit every operand's adjoint; drop those no parameter gradient needs.
    Ok(remove_dead_nodes(&g))
}

/// Which values lie on a path from a parameter to the loss.
fn needs_grad(g: &Graph, loss: ValueId) -> Vec<bool> {
    let n = g.values.len();
    let mut from_param = vec![false; n];
    for node in &g.nodes {
        let f = matches!(node.op, Op::Param { .. }) || node.inputs.iter().any(|v| from_param[v.0 as usize]);
        for r in &node.results {
            from_param[r.0 as usize] = f && g.values[r.0 as usize].ty.dtype.is_float();
        }
    }
    let mut to_loss = vec![false; n];
    to_loss[loss.0 as usize] = true;
    for node in g.nodes.iter().rev() {
        if node.results.iter().any(|r| to_loss[r.0 as usize]) {
            for v in &node.inputs {
                to_loss[v.0 as usize] = true;
            }
        }
    }
    (0..n).map(|i| from_param[i] && to_loss[i]).collect()
}

/// The adjoint contribution of each input, given the adjoints of the results.
fn backward_rule(e: &mut Emit, op: &Op, xs: &[ValueId], ys: &[ValueId], dys: &[Option<ValueId>]) -> Result<Vec<Option<ValueId>>, String> {
    use BinaryOp::*;
    let dy = || dys[0].ok_or_else(|| "missing adjoint of the first result".to_string());
    let y = ys[0];
    Ok(match op {
        Op::Param { .. } | Op::Input { .. } | Op::Const { .. } | Op::Iota { .. } | Op::Compare(_) => vec![None; xs.len()],
        Op::Unary(u) => {
            let (x, d) = (xs[0], dy()?);
            let dx = match u {
                UnaryOp::Neg => e.un(UnaryOp::Neg, d)?,
                UnaryOp::Exp => e.bin(Mul, d, y)?,
                UnaryOp::Log => e.bin(Div, d, x)?,
                UnaryOp::Sqrt => {
                    let half = e.scale(d, 0.5)?;
                    e.bin(Div, half, y)?
                }
                UnaryOp::Rsqrt => {
                    // d/dx x^-1/2 = -1/2 y^3
                    let y2 = e.bin(Mul, y, y)?;
                    let y3 = e.bin(Mul, y2, y)?;
                    let t = e.bin(Mul, d, y3)?;
                    e.scale(t, -0.5)?
                }
                UnaryOp::Tanh => {
                    let y2 = e.bin(Mul, y, y)?;
                    let one = e.splat_like(1.0, y)?;
                    let s = e.bin(Sub, one, y2)?;
                    e.bin(Mul, d, s)?
                }
                UnaryOp::Recip => {
                    let y2 = e.bin(Mul, y, y)?;
                    let t = e.bin(Mul, d, y2)?;
                    e.un(UnaryOp::Neg, t)?
                }
            };
            vec![Some(dx)]
        }
        Op::Binary(b) => {
            let (a, bb, d) = (xs[0], xs[1], dy()?);
            match b {
                Add => vec![Some(d), Some(d)],
                Sub => vec![Some(d), Some(e.un(UnaryOp::Neg, d)?)],
                Mul => vec![Some(e.bin(Mul, d, bb)?), Some(e.bin(Mul, d, a)?)],
                Div => {
                    let da = e.bin(Div, d, bb)?;
                    let t = e.bin(Mul, da, y)?;
                    vec![Some(da), Some(e.un(UnaryOp::Neg, t)?)]
                }
                Max | Min => {
                    let cmp = if *b == Max { CmpOp::Ge } else { CmpOp::Le };
                    let take_a = e.op(Op::Compare(cmp), &[a, bb])?;
                    let zero = e.splat_like(0.0, d)?;
                    vec![Some(e.op(Op::Select, &[take_a, d, zero])?), Some(e.op(Op::Select, &[take_a, zero, d])?)]
                }
            }
        }
        Op::Select => {
            let (c, d) = (xs[0], dy()?);
            let zero = e.splat_like(0.0, d)?;
            vec![None, Some(e.op(Op::Select, &[c, d, zero])?), Some(e.op(Op::Select, &[c, zero, d])?)]
        }
        Op::Cast { .. } => {
            let to = e.g.ty(xs[0]).dtype;
            vec![Some(e.op(Op::Cast { to }, &[dy()?])?)]
        }
        Op::Reshape { .. } => {
            let shape = e.g.ty(xs[0]).shape.clone();
            vec![Some(e.op(Op::Reshape { shape }, &[dy()?])?)]
        }
        Op::Broadcast { dims, shape } => vec![Some(unbroadcast(e, dy()?, xs[0], dims, shape)?)],
        Op::Permute { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(e.op(Op::Permute { perm: inv }, &[dy()?])?)]
        }
        Op::Slice { axis, start, end } => {
            let xt = e.g.ty(xs[0]).clone();
            let n = xt.shape.0[*axis].as_lit().ok_or("slice axis must be constant")?;
            let mut parts = vec![];
            for (lo, hi) in [(0, *start), (*end, n)] {
                if hi > lo {
                    let mut t = xt.clone();
                    t.shape.0[*axis] = Dim::lit(hi - lo);
                    parts.push(e.splat(0.0, &t)?);
                }
            }
            let d = dy()?;
            parts.insert(if *start > 0 { 1 } else { 0 }, d);
            let dx = if parts.len() == 1 { d } else { e.op(Op::Concat { axis: *axis }, &parts)? };
            vec![Some(dx)]
        }
        Op::Concat { axis } => {
            let d = dy()?;
            let mut off = 0;
            let mut out = vec![];
            for x in xs {
                let n = e.g.ty(*x).shape.0[*axis].as_lit().ok_or("concat axis must be constant")?;
                let end = off + n;
                out.push(Some(e.op(Op::Slice { axis: *axis, start: off, end }, &[d])?));
                off = end;
            }
            out
        }
        Op::Reduce { op: r, axes } => {
            let (x, d) = (xs[0], dy()?);
            let xt = e.g.ty(x).clone();
            let kept: Vec<usize> = (0..xt.shape.rank()).filter(|i| !axes.contains(i)).collect();
            let db = e.op(Op::Broadcast { dims: kept.clone(), shape: xt.shape.clone() }, &[d])?;
            match r {
                ReduceOp::Sum => vec![Some(db)],
                ReduceOp::Max => {
                    let yb = e.op(Op::Broadcast { dims: kept, shape: xt.shape.clone() }, &[y])?;
                    let hit = e.op(Op::Compare(CmpOp::Eq), &[x, yb])?;
                    let zero = e.splat(0.0, &xt)?;
                    vec![Some(e.op(Op::Select, &[hit, db, zero])?)]
                }
            }
        }
        Op::MatMul { trans_a: ta, trans_b: tb } => matmul_rule(e, xs[0], xs[1], *ta, *tb, dy()?)?,
        Op::Gather => {
            let rows = e.g.ty(xs[0]).shape.0[0].clone();
            vec![Some(e.op(Op::ScatterAdd { rows }, &[dy()?, xs[1]])?), None]
        }
        Op::ScatterAdd { .. } => vec![Some(e.op(Op::Gather, &[dy()?, xs[1]])?), None],
        Op::Gelu => vec![Some(e.op(Op::GeluGrad, &[xs[0], dy()?])?)],
        Op::LayerNorm { .. } => {
            if dys[1].is_some() || dys[2].is_some() {
                return Err("gradients through the saved mean/rstd are not supported".into());
            }
            let r = e.ops(Op::LayerNormGrad, &[dy()?, xs[0], xs[1], ys[1], ys[2]])?;
            vec![Some(r[0]), Some(r[1]), Some(r[2])]
        }
        Op::Softmax => vec![Some(e.op(Op::SoftmaxGrad, &[y, dy()?])?)],
        Op::CrossEntropy { vocab } => vec![Some(e.op(Op::CrossEntropyGrad { vocab: *vocab }, &[xs[0], xs[1], dy()?])?), None],
        Op::Attention { heads, scale } => {
            if dys[1].is_some() {
                return Err("gradients through the saved log-sum-exp are not supported".into());
            }
            vec![Some(e.op(Op::AttentionGrad { heads: *heads, scale: *scale }, &[xs[0], ys[0], ys[1], dy()?])?)]
        }
        // Every rank's result is the mean of every rank's operand, so each operand's adjoint is
        // the mean of the results' adjoints: the same collective.
        Op::AllReduce => dys.iter().map(|d| d.map(|d| e.op(Op::AllReduce, &[d])).transpose()).collect::<Result<_, _>>()?,
        Op::GeluGrad | Op::LayerNormGrad | Op::SoftmaxGrad | Op::CrossEntropyGrad { .. } | Op::AttentionGrad { .. } | Op::AdamW { .. } | Op::FromOwners { .. } => {
            return Err("has no backward rule (second-order or optimizer op)".into())
        }
        Op::Gemm(_) | Op::Kernel(_) | Op::CrossEntropyWithGrad { .. } => {
            return Err("fused ops are made after autodiff and have no backward rule".into())
        }
    })
}

/// Adjoint of a broadcast: sum over the repeated axes, then restore the operand's shape.
fn unbroadcast(e: &mut Emit, d: ValueId, x: ValueId, dims: &[usize], shape: &fusec_ir::Shape) -> Result<ValueId, String> {
    let xt = e.g.ty(x).clone();
    let axes: Vec<usize> = (0..shape.rank())
        .filter(|r| match dims.iter().position(|d| d == r) {
            None => true,
            Some(i) => xt.shape.0[i] != shape.0[*r],
        })
        .collect();
    if axes.is_empty() {
        return e.op(Op::Reshape { shape: xt.shape.clone() }, &[d]);
    }
    let s = e.op(Op::Reduce { op: ReduceOp::Sum, axes }, &[d])?;
    if *e.g.ty(s) == xt {
        Ok(s)
    } else {
        e.op(Op::Reshape { shape: xt.shape.clone() }, &[s])
    }
}

/// `C = op(A) op(B)`: `dA = dC op(B)^T`, `dB = op(A)^T dC`, written back in A's and B's layouts.
/// A rank-2 `B` shared across A's batch gets its gradient from the flattened batch.
fn matmul_rule(e: &mut Emit, a: ValueId, b: ValueId, ta: bool, tb: bool, dc: ValueId) -> Result<Vec<Option<ValueId>>, String> {
    let mm = |e: &mut Emit, x, y, trans_a, trans_b| e.op(Op::MatMul { trans_a, trans_b }, &[x, y]);
    let (ra, rb) = (e.g.ty(a).shape.rank(), e.g.ty(b).shape.rank());
    let shared_b = rb == 2 && ra > 2;
    if shared_b && ta {
        return Err("transposed batched A with a shared rank-2 B has no backward rule".into());
    }
    let da = if ta { mm(e, b, dc, tb, true)? } else { mm(e, dc, b, false, !tb)? };
    let (a2, dc2) = if shared_b { (flatten_rows(e, a)?, flatten_rows(e, dc)?) } else { (a, dc) };
    let db = if tb { mm(e, dc2, a2, true, ta)? } else { mm(e, a2, dc2, !ta, false)? };
    Ok(vec![Some(da), Some(db)])
}

/// `[d0, .., dn-2, dn-1]` to `[d0*..*dn-2, dn-1]`.
fn flatten_rows(e: &mut Emit, x: ValueId) -> Result<ValueId, String> {
    let s = &e.g.ty(x).shape;
    let (last, lead) = s.0.split_last().ok_or("a matmul operand has rank >= 2")?;
    let rows = lead.iter().try_fold(Dim::lit(1), |a, d| a.checked_mul(d)).ok_or("the flattened rows overflow 64 bits")?;
    let shape = vec![rows, last.clone()].into();
    e.op(Op::Reshape { shape }, &[x])
}
