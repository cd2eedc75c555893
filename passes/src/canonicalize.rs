//! `canonicalize`: constant folding, algebraic identities, common-subexpression elimination and
//! dead-code elimination, in one walk over the graph in program order followed by DCE.
//!
//! Every rewrite is exact under the interpreter's f32 semantics ([`Rounding::F32`]): folded
//! constants are computed by the interpreter itself on scalars (so they round exactly as it
//! does), and identities are only applied where IEEE arithmetic guarantees them bit for bit.
//! Nothing is reassociated and nothing that changes rounding is introduced (no `x * (1/c)` for
//! `x / c`). What is deliberately *not* done, and why:
//! - `x * 0 → 0`: wrong for NaN and infinities.
//! - `x + 0.0 → x` for floats: `-0.0 + 0.0` is `+0.0`, so only `x + (-0.0)` (and integer
//!   `x + 0`) is an identity; `x - 0.0` is one for both signs of `x`'s zero.
//! - `reduce_sum` of a splat over symbolic dims: the count is unknown until the dims are bound.
//!
//! Parameters and inputs are the graph's interface: never merged, never removed. `gemm` and
//! `kernel` nodes pass through untouched. The result is deterministic and value numbering
//! follows program order; running the pass twice gives the same text as running it once.

use std::collections::HashMap;

use fusec_ir::interp::{self, round_to, Rounding};
use fusec_ir::{BinaryOp, Bindings, DType, Graph, Op, ReduceOp, Type, UnaryOp, ValueId};

use crate::pattern::splat;
use crate::rewrite::remove_dead_nodes;

/// Largest element count a `reduce_sum` of a splat is folded over: up to 2^29 terms, the f64
/// running sum of an f32 value (24 significant bits) is exact, so `value * count` equals it.
const MAX_FOLD_COUNT: u64 = 1 << 29;

/// Folds constants, applies identities, merges common subexpressions and removes dead nodes;
/// see the module docs. The result verifies whenever `g` does.
pub fn canonicalize(g: &Graph) -> Result<Graph, String> {
    let mut out = Graph::new(&g.name, &[]);
    out.syms = g.syms.clone();
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let mut cse: HashMap<(String, Vec<ValueId>), Vec<ValueId>> = HashMap::new();
    for n in &g.nodes {
        let mut ins = Vec::with_capacity(n.inputs.len());
        for v in &n.inputs {
            ins.push(
                map.get(v.0 as usize).copied().flatten().ok_or_else(|| format!("canonicalize: operand {v:?} used before definition"))?,
            );
        }
        let tys: Vec<Type> = n.results.iter().map(|r| g.ty(*r).clone()).collect();
        let results = if tys.len() == 1 {
            simplify(&mut out, n.op.clone(), ins, &tys[0], &mut cse)
        } else {
            emit(&mut out, n.op.clone(), ins, tys, &mut cse)
        };
        for (old, new) in n.results.iter().zip(results) {
            map[old.0 as usize] = Some(new);
        }
    }
    for (name, v) in &g.outputs {
        let nv = map.get(v.0 as usize).copied().flatten().ok_or_else(|| format!("canonicalize: output `{name}` is undefined"))?;
        out.output(name, nv);
    }
    Ok(remove_dead_nodes(&out))
}

/// What one rewrite step produced.
enum Step {
    /// Use an existing value of the new graph.
    Value(ValueId),
    /// Replace the node by another op on other operands (simplified again).
    Op(Op, Vec<ValueId>),
    /// Nothing applies: emit the node.
    Keep(Op, Vec<ValueId>),
}

/// Simplifies a single-result node until no rule applies, then emits it (through CSE).
fn simplify(
    out: &mut Graph,
    mut op: Op,
    mut ins: Vec<ValueId>,
    ty: &Type,
    cse: &mut HashMap<(String, Vec<ValueId>), Vec<ValueId>>,
) -> Vec<ValueId> {
    loop {
        let step = match fold(out, &op, &ins) {
            Some(value) => Step::Op(Op::Const { value, ty: ty.clone() }, vec![]),
            None => identity(out, op, ins, ty),
        };
        match step {
            Step::Value(v) => return vec![v],
            Step::Op(o, i) => {
                // A constant is final; other replacements may simplify further.
                if matches!(o, Op::Const { .. }) {
                    return emit(out, o, i, vec![ty.clone()], cse);
                }
                (op, ins) = (o, i);
            }
            Step::Keep(o, i) => return emit(out, o, i, vec![ty.clone()], cse),
        }
    }
}

/// Appends the node unless an identical one exists (same op and operands; never for the
/// interface ops or `gemm`/`kernel`).
fn emit(
    out: &mut Graph,
    op: Op,
    ins: Vec<ValueId>,
    tys: Vec<Type>,
    cse: &mut HashMap<(String, Vec<ValueId>), Vec<ValueId>>,
) -> Vec<ValueId> {
    let mergeable = !matches!(op, Op::Param { .. } | Op::Input { .. } | Op::Gemm(_) | Op::Kernel(_));
    if !mergeable {
        return out.push_unchecked(op, &ins, tys).to_vec();
    }
    // The key spells the op with its attributes and result type; `{:?}` prints floats with
    // round-trip precision and tells -0.0 from 0.0. It lives only for this pass.
    let key = (format!("{op:?} {tys:?}"), ins);
    if let Some(r) = cse.get(&key) {
        return r.clone();
    }
    let r = out.push_unchecked(op, &key.1, tys).to_vec();
    cse.insert(key, r.clone());
    r
}

/// The raw value of `v` if it is a splat constant.
fn konst(out: &Graph, v: ValueId) -> Option<f64> {
    splat(out, v).map(|(x, _)| x)
}

/// The value of the constant that `op` applied to splat constants `ins` is (in f32 semantics),
/// or `None` when it is not foldable. A NaN result stays unfolded: constants are never NaN.
fn fold(out: &Graph, op: &Op, ins: &[ValueId]) -> Option<f64> {
    fold_any(out, op, ins).filter(|v| !v.is_nan())
}

fn fold_any(out: &Graph, op: &Op, ins: &[ValueId]) -> Option<f64> {
    if ins.is_empty() || matches!(op, Op::Const { .. }) {
        return None;
    }
    let vals: Vec<f64> = ins.iter().map(|&v| konst(out, v)).collect::<Option<_>>()?;
    match op {
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Select | Op::Cast { .. } => {
            let tys: Vec<DType> = ins.iter().map(|&v| out.ty(v).dtype).collect();
            eval_scalar(op, &vals, &tys)
        }
        // Layout ops of a splat are the same splat (same dtype: no rounding involved).
        Op::Reshape { .. } | Op::Broadcast { .. } | Op::Permute { .. } | Op::Slice { .. } => Some(vals[0]),
        Op::Concat { .. } if vals.iter().all(|v| v.to_bits() == vals[0].to_bits()) => Some(vals[0]),
        Op::Reduce { op: ReduceOp::Max, .. } => Some(vals[0]),
        Op::Reduce { op: ReduceOp::Sum, axes } => {
            let xt = out.ty(ins[0]);
            let mut count = 1u64;
            for &a in axes {
                count = count.checked_mul(xt.shape.0.get(a)?.as_lit()?)?;
            }
            (count <= MAX_FOLD_COUNT).then(|| sum_of_splat(xt.dtype, vals[0], count))?
        }
        _ => None,
    }
}

/// `count` copies of the splat `value` summed as the interpreter sums them (from 0, in order).
fn sum_of_splat(dtype: DType, value: f64, count: u64) -> Option<f64> {
    let v = round_to(dtype, value);
    if dtype == DType::I32 {
        // Wrapping i32 addition of `v as i32`, `count` times.
        let prod = (v as i32 as i64).wrapping_mul(count as i64);
        return Some(prod as i32 as f64);
    }
    // The running sum starts at +0.0, so a sum of zeros is +0.0 whatever their sign.
    let s = if v == 0.0 { 0.0 } else { v * count as f64 };
    Some(round_to(dtype, s))
}

/// Evaluates an elementwise op on scalar constants with the interpreter (f32 semantics).
fn eval_scalar(op: &Op, vals: &[f64], dtypes: &[DType]) -> Option<f64> {
    let mut g = Graph::new("fold", &[]);
    let mut ins = Vec::with_capacity(vals.len());
    for (&value, &dt) in vals.iter().zip(dtypes) {
        ins.push(*g.try_add(Op::Const { value, ty: Type::scalar(dt) }, &[]).ok()?.first()?);
    }
    let r = g.try_add(op.clone(), &ins).ok()?;
    g.output("r", r[0]);
    let t = interp::run(&g, &Bindings::default(), &HashMap::new(), Rounding::F32).ok()?;
    t.first()?.data.first().copied()
}

/// The algebraic identities (each exact; see the module docs).
fn identity(out: &Graph, op: Op, ins: Vec<ValueId>, ty: &Type) -> Step {
    let same = |v: ValueId| out.ty(v) == ty;
    let is = |v: ValueId, want: f64| konst(out, v).is_some_and(|x| x.to_bits() == want.to_bits());
    let int = ty.dtype == DType::I32;
    let is_zero = |v: ValueId, neg: bool| {
        if int {
            konst(out, v) == Some(0.0)
        } else {
            is(v, if neg { -0.0 } else { 0.0 })
        }
    };
    let producer = |v: ValueId| &out.producer(v).op;
    let fwd = match (&op, ins.as_slice()) {
        (Op::Binary(BinaryOp::Mul), &[a, b]) if is(b, 1.0) => Some(a),
        (Op::Binary(BinaryOp::Mul), &[a, b]) if is(a, 1.0) => Some(b),
        (Op::Binary(BinaryOp::Add), &[a, b]) if is_zero(b, true) => Some(a),
        (Op::Binary(BinaryOp::Add), &[a, b]) if is_zero(a, true) => Some(b),
        (Op::Binary(BinaryOp::Sub), &[a, b]) if is_zero(b, false) => Some(a),
        (Op::Binary(BinaryOp::Div), &[a, b]) if is(b, 1.0) => Some(a),
        (Op::Unary(UnaryOp::Neg), &[a]) => match (producer(a), out.producer(a).inputs.as_slice()) {
            (Op::Unary(UnaryOp::Neg), &[x]) => Some(x),
            _ => None,
        },
        (Op::Select, &[_, a, b]) if a == b => Some(a),
        (Op::Select, &[c, a, b]) => konst(out, c).map(|k| if round_to(DType::I32, k) != 0.0 { a } else { b }),
        (Op::Cast { .. } | Op::Reshape { .. } | Op::Broadcast { .. }, &[a]) => Some(a),
        (Op::Permute { perm }, &[a]) if perm.iter().enumerate().all(|(i, &p)| i == p) => Some(a),
        _ => None,
    };
    // Forward only when the types are identical (this also decides the layout ops above).
    if let Some(v) = fwd.filter(|&v| same(v)) {
        return Step::Value(v);
    }
    match (&op, ins.as_slice()) {
        // reshape(reshape(x)) is reshape(x): row-major order is unchanged by both.
        (Op::Reshape { .. }, &[a]) => {
            if let (Op::Reshape { .. }, &[x]) = (producer(a), out.producer(a).inputs.as_slice()) {
                return Step::Op(op.clone(), vec![x]);
            }
        }
        // permute(permute(x, p), q): result axis i is x's axis p[q[i]].
        (Op::Permute { perm: q }, &[a]) => {
            if let (Op::Permute { perm: p }, &[x]) = (producer(a), out.producer(a).inputs.as_slice()) {
                if p.len() == q.len() && q.iter().all(|&i| i < p.len()) {
                    let perm = q.iter().map(|&i| p[i]).collect();
                    return Step::Op(Op::Permute { perm }, vec![x]);
                }
            }
        }
        _ => {}
    }
    Step::Keep(op, ins)
}
