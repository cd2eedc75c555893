//! `fuse-layernorm`: rewrites the primitive forms of LayerNorm, softmax and softmax +
//! cross-entropy (as `fusec_models::build_gpt2` emits them) into the composites `layernorm`,
//! `softmax` and `cross_entropy`, whose backward rules `autodiff` then uses.
//!
//! Matching is structural (commuted operands of `add`/`mul` are accepted); a structural match is
//! a *candidate*, and every candidate must pass the legality predicates of its pattern, each a
//! named rule. A refused candidate is recorded in the [`FusionLog`] with the positional name of
//! its root (`%123 (layernorm)`), the rule and what did not hold. Only the pattern's root is
//! replaced; intermediates then have no users and are removed.
//!
//! The composites compute a row in one go (f64 in the interpreter, then one rounding), so the
//! results differ from the primitive chain by f32 reassociation (~1e-7 relative), never more.
//!
//! Patterns (values in `[]` are the pattern's operands):
//! - LayerNorm: `mean = reduce_sum([x], last) * k1`, `xc = [x] - broadcast(mean)`,
//!   `var = reduce_sum(xc * xc, last) * k2`, `rstd = rsqrt(var + [eps])`,
//!   `y = xc * broadcast(rstd) * broadcast([w]) + broadcast([b])` with `k1 = k2 = 1/C`.
//! - Softmax: `e = exp([x] - broadcast(reduce_max([x], last)))`, `y = e / broadcast(reduce_sum(e, last))`.
//! - Cross-entropy: `lv = slice([logits], last, 0..V)` (or the logits themselves),
//!   `sh = lv - broadcast(reduce_max(lv, last))`, `lse = log(reduce_sum(exp(sh), last))`,
//!   `picked = reduce_sum(select(iota(last) == broadcast([targets]), sh, 0), last)`,
//!   `loss = lse - picked`.

use std::collections::HashMap;

use fusec_ir::interp::round_to;
use fusec_ir::{BinaryOp, CmpOp, DType, Graph, Op, ReduceOp, UnaryOp, ValueId};

use crate::explain::FusionLog;
use crate::pattern::{orders, splat, splat_rounded, View};
use crate::rewrite::remove_dead_nodes;

/// The pass name, as on the command line and in refusals.
pub const PASS: &str = "fuse-layernorm";

/// A refusal: the rule that did not hold and what exactly.
type Refused = (&'static str, String);

/// A legal match: the composite replacing the value `root`.
struct Plan {
    op: Op,
    inputs: Vec<ValueId>,
    root: ValueId,
}

/// Rewrites every legal LayerNorm, softmax and cross-entropy pattern of `g` into its composite,
/// recording refused candidates in `log`. Candidates whose root is dead are ignored. Returns `g`
/// unchanged when nothing fuses; otherwise every node left dead is removed (the replaced
/// patterns' intermediates, and any code that was dead before).
pub fn fuse_layernorm(g: &Graph, log: &mut FusionLog) -> Result<Graph, String> {
    let v = View::new(g);
    let mut plans: HashMap<usize, Plan> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        // Dead candidates are not worth a refusal line: DCE removes them anyway.
        if !v.live[i] || n.results.len() != 1 {
            continue;
        }
        let root = n.results[0];
        let found = match n.op {
            Op::Binary(BinaryOp::Add) => match_layernorm(&v, root).map(|m| ("layernorm", m.check(&v))),
            Op::Binary(BinaryOp::Div) => match_softmax(&v, root).map(|m| ("softmax", m.check(&v))),
            Op::Binary(BinaryOp::Sub) => match_cross_entropy(&v, root).map(|m| ("cross_entropy", m.check(&v))),
            _ => None,
        };
        match found {
            Some((_, Ok(plan))) => {
                plans.insert(i, plan);
            }
            Some((what, Err((rule, detail)))) => log.refuse(PASS, format!("{} ({what})", v.name(root)), rule, detail),
            None => {}
        }
    }
    if plans.is_empty() {
        return Ok(g.clone());
    }
    rebuild(g, &plans)
}

/// Copies `g` in program order, emitting each plan's composite at its root's position and
/// redirecting the root's uses to the composite's first result; then drops the dead nodes.
fn rebuild(g: &Graph, plans: &HashMap<usize, Plan>) -> Result<Graph, String> {
    let mut out = Graph::new(&g.name, &[]);
    out.syms = g.syms.clone();
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let get =
        |map: &[Option<ValueId>], v: ValueId| map[v.0 as usize].ok_or_else(|| format!("{PASS}: operand {v:?} used before definition"));
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(p) = plans.get(&i) {
            let ins = p.inputs.iter().map(|&x| get(&map, x)).collect::<Result<Vec<_>, _>>()?;
            let res = out.try_add(p.op.clone(), &ins).map_err(|e| format!("{PASS}: building `{}`: {e}", p.op.mnemonic()))?;
            if out.ty(res[0]) != g.ty(p.root) {
                return Err(format!("{PASS}: `{}` would change the type {} to {}", p.op.mnemonic(), g.ty(p.root), out.ty(res[0])));
            }
            map[p.root.0 as usize] = Some(res[0]);
            continue;
        }
        let ins = n.inputs.iter().map(|&x| get(&map, x)).collect::<Result<Vec<_>, _>>()?;
        let tys = n.results.iter().map(|r| g.ty(*r).clone()).collect();
        for (old, new) in n.results.iter().zip(out.push_unchecked(n.op.clone(), &ins, tys)) {
            map[old.0 as usize] = Some(new);
        }
    }
    for (name, v) in &g.outputs {
        let nv = get(&map, *v)?;
        out.output(name, nv);
    }
    Ok(remove_dead_nodes(&out))
}

/// `Err` with `rule` unless `ok`.
fn rule(ok: bool, name: &'static str, detail: impl FnOnce() -> String) -> Result<(), Refused> {
    if ok {
        Ok(())
    } else {
        Err((name, detail()))
    }
}

/// The axes `0..n`.
fn leading(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// Checks that every reduction in `reds` (value, what, op) runs over exactly the last axis of a
/// rank-`r` operand.
fn reduces_last(v: &View, r: usize, reds: &[(ValueId, &str, ReduceOp)]) -> Result<(), Refused> {
    for &(s, what, op) in reds {
        let axes = v.reduce(s, op).map(|(_, a)| a).unwrap_or(&[]);
        rule(axes == [r - 1], "axis-is-last", || {
            format!("the {what} ({}) reduces axes {axes:?} of a rank-{r} operand, not only the last axis {}", v.name(s), r - 1)
        })?;
    }
    Ok(())
}

/// Checks that each broadcast in `bcs` (value, what, expected dims) has exactly those dims.
fn broadcast_dims(v: &View, bcs: &[(ValueId, &str, Vec<usize>)]) -> Result<(), Refused> {
    for (b, what, want) in bcs {
        let dims = v.bcast(*b).map(|(_, d)| d).unwrap_or(&[]);
        rule(dims == want.as_slice(), "broadcast-shapes", || {
            format!("the {what} is broadcast ({}) along dims {dims:?}, expected {want:?}", v.name(*b))
        })?;
    }
    Ok(())
}

/// Checks that the intermediates are used only inside the pattern rooted at `root`.
fn no_outside_uses(v: &View, inner: &[ValueId], root: ValueId) -> Result<(), Refused> {
    match v.outside_use(inner, root) {
        Some(u) => Err(("no-outside-uses", format!("the intermediate {} is also used outside the pattern", v.name(u)))),
        None => Ok(()),
    }
}

// ---- LayerNorm ---------------------------------------------------------------------------

/// A structural LayerNorm match (see the module docs for the names).
struct Ln {
    x: ValueId,
    w: ValueId,
    b: ValueId,
    eps: ValueId,
    k1: ValueId,
    k2: ValueId,
    s1: ValueId,
    mean: ValueId,
    mean_b: ValueId,
    xc: ValueId,
    sq: ValueId,
    s2: ValueId,
    var: ValueId,
    var_eps: ValueId,
    rstd: ValueId,
    rstd_b: ValueId,
    norm: ValueId,
    w_b: ValueId,
    scaled: ValueId,
    b_b: ValueId,
    y: ValueId,
}

/// `m = reduce_sum(src, ..) * k` in either operand order, for a `src` accepted by `want`:
/// `(sum, k, src)`.
fn scaled_sum(v: &View, m: ValueId, want: impl Fn(ValueId) -> bool) -> Option<(ValueId, ValueId, ValueId)> {
    orders(v.bin(m, BinaryOp::Mul)?).into_iter().find_map(|(s, k)| {
        let (src, _) = v.reduce(s, ReduceOp::Sum)?;
        want(src).then_some((s, k, src))
    })
}

fn match_layernorm(v: &View, y: ValueId) -> Option<Ln> {
    for (scaled, b_b) in orders(v.bin(y, BinaryOp::Add)?) {
        let (Some((b, _)), Some(pair)) = (v.bcast(b_b), v.bin(scaled, BinaryOp::Mul)) else {
            continue;
        };
        for (norm, w_b) in orders(pair) {
            let Some((w, _)) = v.bcast(w_b) else { continue };
            let Some(pair) = v.bin(norm, BinaryOp::Mul) else {
                continue;
            };
            for (xc, rstd_b) in orders(pair) {
                let Some(m) = match_stats(v, xc, rstd_b) else {
                    continue;
                };
                let [x, eps, k1, k2, s1, mean, mean_b, sq, s2, var, var_eps, rstd] = m;
                return Some(Ln {
                    x,
                    w,
                    b,
                    eps,
                    k1,
                    k2,
                    s1,
                    mean,
                    mean_b,
                    xc,
                    sq,
                    s2,
                    var,
                    var_eps,
                    rstd,
                    rstd_b,
                    norm,
                    w_b,
                    scaled,
                    b_b,
                    y,
                });
            }
        }
    }
    None
}

/// The statistics part of LayerNorm given `xc` and `broadcast(rstd)`:
/// `[x, eps, k1, k2, s1, mean, mean_b, sq, s2, var, var_eps, rstd]`.
fn match_stats(v: &View, xc: ValueId, rstd_b: ValueId) -> Option<[ValueId; 12]> {
    let (rstd, _) = v.bcast(rstd_b)?;
    let var_eps = v.un(rstd, UnaryOp::Rsqrt)?;
    let (x, mean_b) = v.bin(xc, BinaryOp::Sub)?;
    let (mean, _) = v.bcast(mean_b)?;
    let (s1, k1, _) = scaled_sum(v, mean, |src| src == x)?;
    orders(v.bin(var_eps, BinaryOp::Add)?).into_iter().find_map(|(var, eps)| {
        let (s2, k2, sq) = scaled_sum(v, var, |src| v.bin(src, BinaryOp::Mul) == Some((xc, xc)))?;
        Some([x, eps, k1, k2, s1, mean, mean_b, sq, s2, var, var_eps, rstd])
    })
}

impl Ln {
    fn check(&self, v: &View) -> Result<Plan, Refused> {
        let g = v.g;
        let xt = g.ty(self.x);
        for (what, t) in [("input", self.x), ("weight", self.w), ("bias", self.b)] {
            rule(g.ty(t).dtype == DType::F32, "dtype-f32", || format!("the {what} {} is {}", v.name(t), g.ty(t)))?;
        }
        let r = xt.shape.rank();
        reduces_last(v, r, &[(self.s1, "mean", ReduceOp::Sum), (self.s2, "variance", ReduceOp::Sum)])?;
        broadcast_dims(
            v,
            &[
                (self.mean_b, "mean", leading(r - 1)),
                (self.rstd_b, "rstd", leading(r - 1)),
                (self.w_b, "weight", vec![r - 1]),
                (self.b_b, "bias", vec![r - 1]),
            ],
        )?;
        let c = &xt.shape.0[r - 1];
        for (what, t) in [("weight", self.w), ("bias", self.b)] {
            rule(g.ty(t).shape.0[..] == [c.clone()], "affine-rank", || {
                format!("the {what} {} is {}, expected [{c}]", v.name(t), g.ty(t).shape)
            })?;
        }
        let n = c.as_lit().ok_or_else(|| ("mean-scale-matches-width", format!("the normalized width {c} is not a constant")))?;
        let want = round_to(DType::F32, 1.0 / n as f64);
        for (what, k) in [("mean", self.k1), ("variance", self.k2)] {
            let got = splat_rounded(g, k);
            rule(got == Some(want), "mean-scale-matches-width", || match got {
                Some(got) => format!("the {what} scale {} is {got}, not 1/{n} = {want}", v.name(k)),
                None => format!("the {what} scale {} is not a constant", v.name(k)),
            })?;
        }
        let eps = match splat(g, self.eps) {
            Some((e, dt)) if e.is_finite() && e > 0.0 && round_to(dt, e) > 0.0 => e,
            Some((e, _)) => return Err(("eps-constant", format!("eps {} is {e}, not a positive finite constant", v.name(self.eps)))),
            None => return Err(("eps-constant", format!("eps {} is not a constant", v.name(self.eps)))),
        };
        // The broadcasts of the weight and bias are free views: they may be shared.
        let inner = [
            self.s1,
            self.mean,
            self.mean_b,
            self.xc,
            self.sq,
            self.s2,
            self.var,
            self.var_eps,
            self.rstd,
            self.rstd_b,
            self.norm,
            self.scaled,
        ];
        no_outside_uses(v, &inner, self.y)?;
        Ok(Plan { op: Op::LayerNorm { eps }, inputs: vec![self.x, self.w, self.b], root: self.y })
    }
}

// ---- softmax -----------------------------------------------------------------------------

/// A structural softmax match.
struct Sm {
    x: ValueId,
    mx: ValueId,
    mx_b: ValueId,
    d: ValueId,
    e: ValueId,
    s: ValueId,
    s_b: ValueId,
    y: ValueId,
}

fn match_softmax(v: &View, y: ValueId) -> Option<Sm> {
    let (e, s_b) = v.bin(y, BinaryOp::Div)?;
    let (s, _) = v.bcast(s_b)?;
    let (e2, _) = v.reduce(s, ReduceOp::Sum)?;
    let d = v.un(e, UnaryOp::Exp)?;
    let (x, mx_b) = v.bin(d, BinaryOp::Sub)?;
    let (mx, _) = v.bcast(mx_b)?;
    let (x2, _) = v.reduce(mx, ReduceOp::Max)?;
    (e2 == e && x2 == x).then_some(Sm { x, mx, mx_b, d, e, s, s_b, y })
}

impl Sm {
    fn check(&self, v: &View) -> Result<Plan, Refused> {
        let xt = v.g.ty(self.x);
        rule(xt.dtype.is_float(), "dtype-float", || format!("the input {} is {xt}", v.name(self.x)))?;
        let r = xt.shape.rank();
        reduces_last(v, r, &[(self.mx, "maximum", ReduceOp::Max), (self.s, "sum", ReduceOp::Sum)])?;
        broadcast_dims(v, &[(self.mx_b, "maximum", leading(r - 1)), (self.s_b, "sum", leading(r - 1))])?;
        no_outside_uses(v, &[self.mx, self.mx_b, self.d, self.e, self.s, self.s_b], self.y)?;
        Ok(Plan { op: Op::Softmax, inputs: vec![self.x], root: self.y })
    }
}

// ---- cross-entropy -----------------------------------------------------------------------

/// A structural softmax + cross-entropy match.
struct Ce {
    logits: ValueId,
    /// The `slice` of the logits, when there is one (else `lv == logits`).
    sliced: bool,
    lv: ValueId,
    mx: ValueId,
    mx_b: ValueId,
    shifted: ValueId,
    e: ValueId,
    s: ValueId,
    lse: ValueId,
    ids: ValueId,
    targets: ValueId,
    targets_b: ValueId,
    hit: ValueId,
    zero: ValueId,
    picked_all: ValueId,
    picked: ValueId,
    loss: ValueId,
}

fn match_cross_entropy(v: &View, loss: ValueId) -> Option<Ce> {
    let (lse, picked) = v.bin(loss, BinaryOp::Sub)?;
    let s = v.un(lse, UnaryOp::Log)?;
    let (e, _) = v.reduce(s, ReduceOp::Sum)?;
    let shifted = v.un(e, UnaryOp::Exp)?;
    let (lv, mx_b) = v.bin(shifted, BinaryOp::Sub)?;
    let (mx, _) = v.bcast(mx_b)?;
    let (lv2, _) = v.reduce(mx, ReduceOp::Max)?;
    let (picked_all, _) = v.reduce(picked, ReduceOp::Sum)?;
    let sel = v.node(picked_all);
    if lv2 != lv || sel.op != Op::Select || sel.inputs.len() != 3 || sel.inputs[1] != shifted {
        return None;
    }
    let (hit, zero) = (sel.inputs[0], sel.inputs[2]);
    let cmp = v.node(hit);
    if cmp.op != Op::Compare(CmpOp::Eq) || cmp.inputs.len() != 2 {
        return None;
    }
    let (ids, targets_b, targets) = orders((cmp.inputs[0], cmp.inputs[1])).into_iter().find_map(|(ids, tb)| {
        let is_iota = matches!(v.node(ids).op, Op::Iota { .. });
        let (t, _) = v.bcast(tb)?;
        is_iota.then_some((ids, tb, t))
    })?;
    let sl = v.node(lv);
    let (logits, sliced) = match sl.op {
        Op::Slice { .. } if sl.inputs.len() == 1 => (sl.inputs[0], true),
        _ => (lv, false),
    };
    Some(Ce { logits, sliced, lv, mx, mx_b, shifted, e, s, lse, ids, targets, targets_b, hit, zero, picked_all, picked, loss })
}

impl Ce {
    fn check(&self, v: &View) -> Result<Plan, Refused> {
        let g = v.g;
        let lt = g.ty(self.logits);
        rule(lt.dtype == DType::F32, "dtype-f32", || format!("the logits {} are {lt}", v.name(self.logits)))?;
        let r = g.ty(self.lv).shape.rank();
        reduces_last(
            v,
            r,
            &[(self.mx, "maximum", ReduceOp::Max), (self.s, "sum", ReduceOp::Sum), (self.picked, "picked logit", ReduceOp::Sum)],
        )?;
        let vocab = match &g.producer(self.lv).op {
            Op::Slice { axis, start, end } if self.sliced => {
                rule(*axis == r - 1, "axis-is-last", || {
                    format!("the vocabulary slice {} is along axis {axis}, not the last axis {}", v.name(self.lv), r - 1)
                })?;
                rule(*start == 0, "slice-from-zero", || format!("the vocabulary slice {} is {start}..{end}, not 0..V", v.name(self.lv)))?;
                *end
            }
            _ => {
                let last = &lt.shape.0[r - 1];
                last.as_lit()
                    .ok_or_else(|| ("vocab-constant", format!("the vocabulary width {last} of {} is not a constant", v.name(self.lv))))?
            }
        };
        if let Op::Iota { axis, .. } = g.producer(self.ids).op {
            rule(axis == r - 1, "onehot-axis", || {
                format!("the one-hot iota {} counts along axis {axis}, not the last axis {}", v.name(self.ids), r - 1)
            })?;
        }
        let z = splat_rounded(g, self.zero);
        rule(z == Some(0.0), "onehot-zero", || format!("the one-hot else-branch {} is not a zero constant", v.name(self.zero)))?;
        let (tt, lead) = (g.ty(self.targets), &g.ty(self.lv).shape.0[..r - 1]);
        rule(tt.dtype == DType::I32 && tt.shape.0[..] == *lead, "targets-shape", || {
            format!("the targets {} are {tt}, expected i32 with the logits' leading shape", v.name(self.targets))
        })?;
        broadcast_dims(v, &[(self.targets_b, "targets", leading(r - 1)), (self.mx_b, "maximum", leading(r - 1))])?;
        let mut inner = vec![self.mx, self.mx_b, self.shifted, self.e, self.s, self.lse, self.hit, self.picked_all, self.picked];
        if self.sliced {
            inner.push(self.lv);
        }
        // The iota, the zero and the broadcast targets are sources or free views: they may be shared.
        no_outside_uses(v, &inner, self.loss)?;
        Ok(Plan { op: Op::CrossEntropy { vocab }, inputs: vec![self.logits, self.targets], root: self.loss })
    }
}
