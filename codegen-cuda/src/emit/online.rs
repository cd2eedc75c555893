//! The online softmax: a row's maximum and its sum of `exp(x - max)` in one pass instead of
//! two (Milakov and Gimelshein, 2018). A row kernel whose first pass only finds
//! `M = row_max(select(mask, x, -inf))` and whose second only sums
//! `S = row_sum(select(mask, exp(x - M), 0))` (softmax, the fused classifier) keeps, per
//! thread, a running maximum `m` and the sum `s` of `exp(x - m)`, rescaling `s` when `m` grows;
//! the team then takes `M = max m` and `S = sum s exp(m - M)`. One pass over the row and one
//! team reduction less; `S` differs from the two-pass sum by roundings only (the products of
//! two `exp`s), so it is used only where `exp` is the hardware's approximate `ex2` already
//! (kernels on bf16 storage, [`super::reads_bf16`]). NaN propagates as in the two passes: a NaN
//! element makes `m`, hence `M`, and `S` NaN.

use fusec_ir::rows::{Expr, NodeId, Prog};
use fusec_ir::{BinaryOp, ReduceOp, UnaryOp};

use crate::plan::Pass;

/// The two reductions that one online pass computes.
pub(crate) struct Online {
    /// `M`, the row maximum (finished by the first pass).
    pub max: NodeId,
    /// `S`, the sum of `exp(x - M)` (the second pass, which is not emitted).
    pub sum: NodeId,
}

const NEG_INF: u32 = 0xff80_0000;

/// The online form of `passes`' first two passes, when they are exactly a masked maximum and
/// a masked sum of `exp(x - M)` over the same `x` and mask.
pub(crate) fn detect(p: &Prog, passes: &[Pass]) -> Option<Online> {
    let [first, second, ..] = passes else { return None };
    let only = |pass: &Pass, level: u32| {
        (pass.level == level && pass.rowreds.len() == 1 && pass.colreds.is_empty() && pass.stores.is_empty()).then(|| pass.rowreds[0])
    };
    let (max, sum) = (only(first, 0)?, only(second, 1)?);
    let Expr::RowReduce(ReduceOp::Max, a) = p.node(max).expr else { return None };
    let Expr::RowReduce(ReduceOp::Sum, e) = p.node(sum).expr else { return None };
    // `select(mask, v, fill)` as (Some(mask), v), anything else as (None, itself).
    let masked = |id: NodeId, fill: u32| match p.node(id).expr {
        Expr::Select(m, v, f) if p.node(f).expr == Expr::ConstF(fill) => (Some(m), v),
        _ => (None, id),
    };
    let (mask_a, x) = masked(a, NEG_INF);
    let (mask_e, ex) = masked(e, 0);
    let Expr::Unary(UnaryOp::Exp, d) = p.node(ex).expr else { return None };
    let Expr::Binary(BinaryOp::Sub, x2, m) = p.node(d).expr else { return None };
    (mask_a == mask_e && x2 == x && m == max && p.node(x).level == 0).then_some(Online { max, sum })
}

impl Online {
    /// The first pass's declarations: the running maximum and sum, and with `w` columns a step
    /// (`w > 1`) the step's values.
    pub fn open(&self, w: u32) -> String {
        let (m, s) = (self.max, self.sum);
        let mut out = format!("    float a{m} = __uint_as_float(0x{NEG_INF:x}u);\n    float o{s} = 0.0f;\n");
        if w > 1 {
            out += &format!("    float x{s}[{w}];\n");
        }
        out
    }

    /// The per-column code for `v{arg}` (the maximum's argument: `-inf` where masked): kept
    /// for the step's update with `w > 1`, else the update itself.
    pub fn update(&self, arg: NodeId, w: u32) -> String {
        if w > 1 {
            return format!("      x{}[j] = v{arg};\n", self.sum);
        }
        format!("      {{ const float x = v{arg};\n        {}\n        {} }}\n", self.rescale("x"), self.term("x"))
    }

    /// After a step of `w` columns: the running maximum moves to the step's at most once, then
    /// the step's terms are added.
    pub fn step(&self, w: u32) -> String {
        let s = self.sum;
        format!(
            "      {{ float x = x{s}[0];\n#pragma unroll\n        for (int j = 1; j < {w}; ++j) x = max_nan(x, x{s}[j]);\n        {}\n\
             #pragma unroll\n        for (int j = 0; j < {w}; ++j) {} }}\n",
            self.rescale("x"),
            self.term(&format!("x{s}[j]"))
        )
    }

    /// Moves the running maximum up to `x` (or to NaN), rescaling the running sum.
    fn rescale(&self, x: &str) -> String {
        let (m, s) = (self.max, self.sum);
        format!("if ({x} > a{m} || {x} != {x}) {{ o{s} = o{s} * fast_exp(a{m} - {x}); a{m} = {x}; }}")
    }

    /// Adds `exp(x - m)` to the running sum unless `x` is masked (`-inf`).
    fn term(&self, x: &str) -> String {
        let (m, s) = (self.max, self.sum);
        format!("if ({x} > __uint_as_float(0x{NEG_INF:x}u)) o{s} = o{s} + fast_exp({x} - a{m});")
    }

    /// After the team's maximum `v{max}`: the sum, rescaled to it and reduced over the team by
    /// `reduce` (the team reduction's call on `a{sum}`).
    pub fn close(&self, reduce: &str) -> String {
        let (m, s) = (self.max, self.sum);
        format!("    const float a{s} = o{s} == 0.0f ? 0.0f : o{s} * fast_exp(a{m} - v{m});\n    const float v{s} = {reduce};\n")
    }
}
