//! Row views read by several passes of a row kernel: copied to shared memory once
//! ([`Seg::stage_plan`]) or kept in registers ([`Seg::keep_plan`]), so that the later passes
//! do not load them from global memory again.

use fusec_ir::rows::{Expr, NodeId, View};

use super::rows::{mem_bytes, vectorizable, MAX_UNROLL};
use super::Seg;
use crate::plan::STAGE_MAX_BYTES;

/// The largest row view copied to shared memory for two passes: a copy of 100 KiB (the
/// classifier's bf16 logits) leaves room for two blocks an SM, and reading the row a second
/// time from L2 was faster (online classifier 1.74 -> 1.22 ms, H200); three passes still copy.
const STAGE_PAIR_MAX_BYTES: u64 = 16 * 1024;

/// The most registers a thread spends on row views kept between passes.
const MAX_KEPT_REGS: u64 = 48;

impl Seg<'_> {
    /// The row views to keep in shared memory, each with the level of the pass that copies it
    /// there: with one team a block, a view that three or more wide passes load with vector
    /// accesses (two, for a copy of at most [`STAGE_PAIR_MAX_BYTES`]) is read from global
    /// memory once, by the first of them, and from the copy by the others (the fp32
    /// classifier's three passes over a 50,304-column row). Copies take at most
    /// [`STAGE_MAX_BYTES`] a block. `codes` are the passes' [`Seg::pass_code`]s; pass `merged`
    /// is not emitted (its sum is the online pass's).
    pub(super) fn stage_plan(&self, tpb: u32, codes: &[(Vec<NodeId>, u32, bool)], merged: Option<usize>) -> Vec<(View, u32)> {
        if tpb != 1 {
            return vec![];
        }
        let mut seen: Vec<(View, u32, usize)> = vec![];
        for (i, (pass, (body, w, _))) in self.plan.passes.iter().zip(codes).enumerate() {
            if merged == Some(i) {
                continue;
            }
            let w = *w;
            for &id in body {
                if let Expr::Load(v) = &self.p.node(id).expr {
                    if w == 1 || v.row.is_empty() || !vectorizable(v, w) {
                        continue;
                    }
                    match seen.iter_mut().find(|(x, _, _)| x == v) {
                        Some((_, _, n)) => *n += 1,
                        None => seen.push((v.clone(), pass.level, 1)),
                    }
                }
            }
        }
        let mut bytes = 0;
        let mut staged = vec![];
        for (v, first, n) in seen {
            let b = self.p.cols * mem_bytes(v.mem);
            if (n >= 3 || (n == 2 && b <= STAGE_PAIR_MAX_BYTES)) && bytes + b <= STAGE_MAX_BYTES {
                bytes += b;
                staged.push((v, first));
            }
        }
        staged
    }

    /// The row views to keep in registers between passes: with short unrolled wide passes
    /// (at most [`MAX_UNROLL`] vector steps a thread, so that every step's index is a constant),
    /// a row view that two or more of them load with the same width and steps is read from
    /// global memory by the first and from registers by the others (a LayerNorm's mean,
    /// variance and output passes over the same row), at most [`MAX_KEPT_REGS`] registers a
    /// thread. With `ahead`, a row view that only a later pass loads is loaded by an earlier
    /// pass of the same shape, so that its latency overlaps that pass's loads instead of
    /// following the row reductions (the LayerNorm gradient's residual-gradient addend).
    /// `codes` are the passes' [`Seg::pass_code`]s; staged views are not kept.
    pub(super) fn keep_plan(&self, team: u32, k_slots: u64, codes: &[(Vec<NodeId>, u32, bool)], staged: &[(View, u32)], ahead: bool) -> Vec<Kept> {
        let cols = self.p.cols;
        // Each view with the passes that load it, `None` once one of them has another shape.
        let mut seen: Vec<(Kept, Option<usize>)> = vec![];
        // The level, width and steps of each pass that may keep views.
        let mut shapes: Vec<(u32, u32, u64)> = vec![];
        for (pass, (body, w, unrolled)) in self.plan.passes.iter().zip(codes) {
            let w = *w;
            let steps = if *unrolled { k_slots / w as u64 } else { cols.div_ceil(team as u64 * w as u64) };
            if w == 1 || (!*unrolled && steps > MAX_UNROLL) {
                continue;
            }
            shapes.push((pass.level, w, steps));
            for &id in body {
                let Expr::Load(v) = &self.p.node(id).expr else { continue };
                if v.row.is_empty() || !vectorizable(v, w) || staged.iter().any(|(x, _)| x == v) {
                    continue;
                }
                match seen.iter_mut().find(|(k, _)| k.view == *v) {
                    Some((k, n)) if k.w == w && k.steps == steps => *n = n.map(|n| n + 1),
                    Some((_, n)) => *n = None,
                    None => seen.push((Kept { view: v.clone(), first: pass.level, w, steps }, Some(1))),
                }
            }
        }
        let mut regs = 0;
        let mut kept = vec![];
        for (mut k, n) in seen {
            let r = k.steps * k.w as u64 * mem_bytes(k.view.mem) / 4;
            let earlier = shapes.iter().find(|&&(level, w, steps)| level < k.first && w == k.w && steps == k.steps).map(|s| s.0);
            match (n, earlier) {
                (Some(n), _) if n >= 2 => {}
                (Some(1), Some(level)) if ahead => k.first = level,
                _ => continue,
            }
            if regs + r <= MAX_KEPT_REGS {
                regs += r;
                kept.push(k);
            }
        }
        kept
    }
}

/// A row view kept in registers between passes ([`Seg::keep_plan`]).
pub(super) struct Kept {
    pub view: View,
    /// The level of the pass that loads it from memory.
    pub first: u32,
    /// The passes' width and vector steps a thread.
    pub w: u32,
    pub steps: u64,
}
