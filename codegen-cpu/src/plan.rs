//! Which nodes each generated function computes, and where.
//!
//! A node's [`Region`] says where its code goes: once at function entry (kernel-wide values),
//! once per row (row values, after the pass that produces their level), per column inside a
//! column loop (element and column values), or in the finalize function (column-reduction
//! results). The plan takes the split of the stores between the chunk function (element and row
//! results) and the finalize function (column and scalar results, written once) and what each
//! needs from [`liveness`] (both in `fusec_ir::rows`), and groups the chunk function's column work into passes by level: pass `L` finishes the row
//! reductions of level-`L` values, accumulates the column reductions of level-`L` values, writes
//! the stashed values of level `L` to their row buffers (later passes read them back), and — if
//! it is the last pass — computes and stores every element result.
//!
//! Native work of level `L` (see [`crate::vmath`]) goes in a pass of its own just before pass
//! `L`: row maxima of operand rows, and the offloaded `exp` / `tanh` values — their arguments
//! written to the row buffers by that pass's column loop unless the routine reads them straight
//! from an operand (`x - max`), then one call per value, which also returns its row sum (so no
//! pass sums it). Every later read of an offloaded value loads it from its buffer.
//!
//! A last pass whose stores read one-hot selects `select(c == t, a, b)` (`t` per row, e.g. the
//! cross-entropy gradient's `p - 1` at the target) computes `b` in the column loop and writes
//! the stores' values at column `t` separately.

use fusec_ir::rows::{liveness, region, Expr, Liveness, NodeId, Prog, Region, Ty, View};
use fusec_ir::{BinaryOp, ReduceOp};

/// The work of one pass over the columns of a row.
pub(crate) struct Pass {
    pub(crate) level: u32,
    /// Row reductions finished by this pass.
    pub(crate) rowreds: Vec<NodeId>,
    /// Column reductions of element values accumulated in this pass.
    pub(crate) colreds: Vec<NodeId>,
    /// Element stores (last pass only), as indices into `Prog::stores`.
    pub(crate) stores: Vec<usize>,
    /// Row and kernel-wide values read inside the loop (splatted before it).
    pub(crate) splats: Vec<NodeId>,
    /// Stashed values computed (and written to their row buffer) by this pass.
    pub(crate) stash_writes: Vec<(NodeId, u32)>,
    /// Offloaded values of this level, computed by native calls after this pass, which writes
    /// the arguments that are not read straight from an operand to their row buffers: a pass
    /// of its own, just before the level's other pass.
    pub(crate) offload: Vec<Offload>,
    /// Row maxima computed by native calls before this pass's loop: `(node, operand row,
    /// columns read)` (see [`Prog::native_maxes`]).
    pub(crate) native_maxes: Vec<(NodeId, View, u64)>,
    /// One-hot selects `select(c == t, a, b)` (`t` per row) that only the pass's stores read:
    /// the column loop computes `b` everywhere, and the stores' values at column `t` (computed
    /// before the loop, while every operand is intact) are written after it. `(t, selects)`.
    pub(crate) one_hot: Option<(NodeId, Vec<NodeId>)>,
}

/// One offloaded value (see [`Prog::offloads`]).
#[derive(Clone, Debug)]
pub(crate) struct Offload {
    /// The `exp` / `tanh` node.
    pub(crate) node: NodeId,
    /// Its row buffer's scratch slot.
    pub(crate) slot: u32,
    /// When the argument is an f32 or bf16 operand row (a contiguous column view), minus a
    /// per-row value or not: the view and the value. The routine then reads the operand directly
    /// (no pass writes the argument).
    pub(crate) src: Option<(View, Option<NodeId>)>,
    /// Row sums of the node, which the routine returns (summed in the order the column loop
    /// sums: column `c` into lane `c % 16` of 16 partial sums, those combined as a fixed tree,
    /// then the scalar tail columns in order), so no pass reads the buffer for them.
    pub(crate) sums: Vec<NodeId>,
    /// Whether anything reads the values themselves (else only the sums: the routine does
    /// not write the buffer).
    pub(crate) read: bool,
}

/// `t` when node `id` is `select(c == t, a, b)` (or `t == c`) for the column index `c` and an
/// i32 `t` that is constant along the row.
pub(crate) fn one_hot_index(p: &Prog, id: NodeId) -> Option<NodeId> {
    let Expr::Select(c, _, _) = p.node(id).expr else { return None };
    let Expr::Cmp(fusec_ir::CmpOp::Eq, x, y) = p.node(c).expr else { return None };
    let t = match (&p.node(x).expr, &p.node(y).expr) {
        (Expr::ColIota, _) => y,
        (_, Expr::ColIota) => x,
        _ => return None,
    };
    (p.node(t).ty == Ty::I32 && !p.node(t).space.has_col()).then_some(t)
}

/// What the two functions compute.
pub(crate) struct Plan {
    pub(crate) passes: Vec<Pass>,
    /// Live in the chunk function.
    pub(crate) main_live: Vec<bool>,
    /// Live in the finalize function.
    pub(crate) fin_live: Vec<bool>,
    /// Per-row stores.
    pub(crate) row_stores: Vec<usize>,
    /// Column and scalar stores (finalize).
    pub(crate) fin_stores: Vec<usize>,
    /// Column reductions of row values (accumulated at the end of each row).
    pub(crate) row_colreds: Vec<NodeId>,
    /// Every column reduction (partials to initialize).
    pub(crate) colreds: Vec<NodeId>,
    /// Live stashed values and their row-buffer slots.
    pub(crate) stashes: Vec<(NodeId, u32)>,
    /// Live offloaded values.
    pub(crate) offloads: Vec<Offload>,
}

pub(crate) fn plan(p: &Prog) -> Plan {
    let n = p.nodes.len();
    let Liveness { main_live, fin_live, row_stores, elem_stores, fin_stores, colreds } = liveness(p);
    let arg = |id: NodeId| p.node(id).expr.args()[0];
    let all_rowreds: Vec<NodeId> =
        (0..n as NodeId).filter(|&i| main_live[i as usize] && matches!(p.node(i).expr, Expr::RowReduce(..))).collect();
    let offloads: Vec<Offload> = p
        .offloads
        .iter()
        .filter(|(t, _)| main_live[*t as usize])
        .map(|&(t, slot)| {
            let a = arg(t);
            let f32_row = |x: NodeId| match &p.node(x).expr {
                Expr::Load(v) if v.col && crate::vmath::readable(v.mem) => Some(v.clone()),
                _ => None,
            };
            let src = match p.node(a).expr {
                Expr::Binary(BinaryOp::Sub, x, m) if !p.node(m).space.has_col() && p.node(m).ty == Ty::F32 => {
                    f32_row(x).map(|v| (v, Some(m)))
                }
                _ => f32_row(a).map(|v| (v, None)),
            };
            // The routine sums as a loop with one reduction does (16 lanes): only a level's one
            // row reduction moves into it, so that the sum has the same bits either way.
            let level_reds = all_rowreds.iter().filter(|&&r| p.node(arg(r)).level == p.node(t).level).count();
            let sums: Vec<NodeId> =
                all_rowreds.iter().copied().filter(|&r| level_reds == 1 && p.node(r).expr == Expr::RowReduce(ReduceOp::Sum, t)).collect();
            let read = p.stores.iter().any(|s| s.value == t)
                || (0..n as NodeId).any(|i| main_live[i as usize] && !sums.contains(&i) && p.node(i).expr.args().contains(&t));
            Offload { node: t, slot, src, sums, read }
        })
        .collect();
    let native_maxes: Vec<(NodeId, View, u64)> = all_rowreds
        .iter()
        .filter(|r| p.native_maxes.contains(r))
        .filter_map(|&r| crate::vmath::max_source(p, arg(r)).map(|(v, k)| (r, v, k)))
        .collect();
    let rowreds: Vec<NodeId> = all_rowreds
        .iter()
        .copied()
        .filter(|r| !offloads.iter().any(|o| o.sums.contains(r)) && !native_maxes.iter().any(|m| m.0 == *r))
        .collect();
    let col_colreds: Vec<NodeId> = colreds.iter().copied().filter(|&c| p.node(arg(c)).space.has_col()).collect();
    let row_colreds: Vec<NodeId> = colreds.iter().copied().filter(|&c| !p.node(arg(c)).space.has_col()).collect();
    let stashes: Vec<(NodeId, u32)> = p.stashes.iter().copied().filter(|(t, _)| main_live[*t as usize]).collect();
    // Values a pass of `level` reads back from a row buffer instead of computing them.
    let read_back = |id: NodeId, level: u32, pre: bool| {
        let l = p.node(id).level;
        (l < level && stashes.iter().any(|(t, _)| *t == id))
            || ((l < level || (l == level && !pre)) && offloads.iter().any(|o| o.node == id))
    };
    // Row values read by a pass's column work are splatted before its loop.
    let splats_of = |roots: Vec<NodeId>, level: u32, pre: bool| {
        let mut seen = vec![false; n];
        let mut splats = vec![];
        let mut stack = roots;
        while let Some(id) = stack.pop() {
            if std::mem::replace(&mut seen[id as usize], true) || read_back(id, level, pre) {
                continue;
            }
            if region(p, id) == Region::Col {
                stack.extend(p.node(id).expr.args());
            } else {
                splats.push(id);
            }
        }
        splats.sort_unstable();
        splats
    };
    let last = rowreds
        .iter()
        .chain(&col_colreds)
        .map(|&r| p.node(arg(r)).level)
        .chain(elem_stores.iter().map(|&s| p.node(p.stores[s].value).level))
        .chain(stashes.iter().map(|(t, _)| p.node(*t).level))
        .chain(offloads.iter().map(|o| p.node(o.node).level))
        .chain(native_maxes.iter().map(|m| p.node(arg(m.0)).level))
        .max();
    let mut passes = vec![];
    for level in 0..=last.unwrap_or(0) {
        if last.is_none() {
            break;
        }
        let off: Vec<Offload> = offloads.iter().filter(|o| p.node(o.node).level == level).cloned().collect();
        let nm: Vec<(NodeId, View, u64)> = native_maxes.iter().filter(|m| p.node(arg(m.0)).level == level).cloned().collect();
        if !off.is_empty() || !nm.is_empty() {
            let splats = splats_of(off.iter().filter(|o| o.src.is_none()).map(|o| arg(o.node)).collect(), level, true);
            passes.push(Pass {
                level,
                rowreds: vec![],
                colreds: vec![],
                stores: vec![],
                splats,
                stash_writes: vec![],
                offload: off,
                native_maxes: nm,
                one_hot: None,
            });
        }
        let rr: Vec<NodeId> = rowreds.iter().copied().filter(|&r| p.node(arg(r)).level == level).collect();
        let cr: Vec<NodeId> = col_colreds.iter().copied().filter(|&r| p.node(arg(r)).level == level).collect();
        let st: Vec<usize> = if Some(level) == last { elem_stores.clone() } else { vec![] };
        let sw: Vec<(NodeId, u32)> = stashes.iter().copied().filter(|(t, _)| p.node(*t).level == level).collect();
        if rr.is_empty() && cr.is_empty() && st.is_empty() && sw.is_empty() {
            continue;
        }
        let mut roots: Vec<NodeId> = rr.iter().chain(&cr).map(|&r| arg(r)).collect();
        roots.extend(st.iter().map(|&s| p.stores[s].value));
        roots.extend(sw.iter().map(|(t, _)| *t));
        let splats = splats_of(roots, level, false);
        // One-hot selects read by the stores only.
        let reach = |roots: Vec<NodeId>| {
            let mut seen = vec![false; n];
            let mut stack = roots;
            while let Some(id) = stack.pop() {
                if std::mem::replace(&mut seen[id as usize], true) || read_back(id, level, false) || region(p, id) != Region::Col {
                    continue;
                }
                stack.extend(p.node(id).expr.args());
            }
            seen
        };
        let mut others: Vec<NodeId> = rr.iter().chain(&cr).map(|&r| arg(r)).collect();
        others.extend(sw.iter().map(|(t, _)| *t));
        let other = reach(others);
        let stored = reach(st.iter().map(|&s| p.stores[s].value).collect());
        let mut one_hot: Option<(NodeId, Vec<NodeId>)> = None;
        for id in (0..n as NodeId).filter(|&i| stored[i as usize] && !other[i as usize] && region(p, i) == Region::Col) {
            if let Some(t) = one_hot_index(p, id) {
                match &mut one_hot {
                    None => one_hot = Some((t, vec![id])),
                    Some((t0, v)) if *t0 == t => v.push(id),
                    Some(_) => {}
                }
            }
        }
        passes.push(Pass {
            level,
            rowreds: rr,
            colreds: cr,
            stores: st,
            splats,
            stash_writes: sw,
            offload: vec![],
            native_maxes: vec![],
            one_hot,
        });
    }
    Plan { passes, main_live, fin_live, row_stores, fin_stores, row_colreds, colreds, stashes, offloads }
}
