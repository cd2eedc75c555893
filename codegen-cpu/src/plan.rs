//! Which nodes each generated function computes, and where.
//!
//! A node's *region* says where its code goes: once at function entry (kernel-wide values), once
//! per row (row values, after the pass that produces their level), per column inside a column
//! loop (element and column values), or in the finalize function (column-reduction results).
//! The plan splits the stores between the chunk function (element and row results) and the
//! finalize function (column and scalar results, written once), finds what each needs (liveness),
//! and groups the chunk function's column work into passes by level: pass `L` finishes the row
//! reductions of level-`L` values, accumulates the column reductions of level-`L` values, writes
//! the stashed values of level `L` to their row buffers (later passes read them back), and — if
//! it is the last pass — computes and stores every element result.

use crate::prog::{Expr, NodeId, Prog, Space, FINAL};

/// Where a node is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Region {
    /// Once, at function entry (kernel-wide values).
    Entry,
    /// Once per row, after the pass producing its level.
    Row,
    /// Per column, inside a column loop.
    Col,
    /// In the finalize function (column-reduction results and what depends on them).
    Final,
}

pub(crate) fn region(p: &Prog, id: NodeId) -> Region {
    let n = p.node(id);
    if n.level == FINAL {
        Region::Final
    } else if n.space.has_col() {
        Region::Col
    } else if n.space == Space::Uni && n.level == 0 {
        Region::Entry
    } else {
        Region::Row
    }
}

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
}

fn mark(p: &Prog, live: &mut [bool], root: NodeId, stop_at_colred: bool) {
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        if live[id as usize] {
            continue;
        }
        live[id as usize] = true;
        let e = &p.node(id).expr;
        if stop_at_colred && matches!(e, Expr::ColReduce(..)) {
            continue;
        }
        stack.extend(e.args());
    }
}

pub(crate) fn plan(p: &Prog) -> Plan {
    let n = p.nodes.len();
    let (mut main_live, mut fin_live) = (vec![false; n], vec![false; n]);
    let (mut row_stores, mut elem_stores, mut fin_stores) = (vec![], vec![], vec![]);
    for (i, s) in p.stores.iter().enumerate() {
        // Column results and scalars are written once, by the finalize function; with a single
        // row (all row axes of size 1) every non-final result is written by the row loop.
        let once = !s.view.space().has_row() && p.rows > 1;
        if p.node(s.value).level == FINAL || once {
            fin_stores.push(i);
        } else if s.view.col {
            elem_stores.push(i);
        } else {
            row_stores.push(i);
        }
    }
    for &i in &fin_stores {
        mark(p, &mut fin_live, p.stores[i].value, true);
    }
    let colreds: Vec<NodeId> =
        (0..n as NodeId).filter(|&i| fin_live[i as usize] && matches!(p.node(i).expr, Expr::ColReduce(..))).collect();
    for &i in row_stores.iter().chain(&elem_stores) {
        mark(p, &mut main_live, p.stores[i].value, false);
    }
    for &c in &colreds {
        mark(p, &mut main_live, p.node(c).expr.args()[0], false);
    }
    let arg = |id: NodeId| p.node(id).expr.args()[0];
    let rowreds: Vec<NodeId> =
        (0..n as NodeId).filter(|&i| main_live[i as usize] && matches!(p.node(i).expr, Expr::RowReduce(..))).collect();
    let col_colreds: Vec<NodeId> = colreds.iter().copied().filter(|&c| p.node(arg(c)).space.has_col()).collect();
    let row_colreds: Vec<NodeId> = colreds.iter().copied().filter(|&c| !p.node(arg(c)).space.has_col()).collect();
    let stashes: Vec<(NodeId, u32)> = p.stashes.iter().copied().filter(|(t, _)| main_live[*t as usize]).collect();
    let last = rowreds
        .iter()
        .chain(&col_colreds)
        .map(|&r| p.node(arg(r)).level)
        .chain(elem_stores.iter().map(|&s| p.node(p.stores[s].value).level))
        .chain(stashes.iter().map(|(t, _)| p.node(*t).level))
        .max();
    let mut passes = vec![];
    for level in 0..=last.unwrap_or(0) {
        if last.is_none() {
            break;
        }
        let rr: Vec<NodeId> = rowreds.iter().copied().filter(|&r| p.node(arg(r)).level == level).collect();
        let cr: Vec<NodeId> = col_colreds.iter().copied().filter(|&r| p.node(arg(r)).level == level).collect();
        let st: Vec<usize> = if Some(level) == last { elem_stores.clone() } else { vec![] };
        let sw: Vec<(NodeId, u32)> = stashes.iter().copied().filter(|(t, _)| p.node(*t).level == level).collect();
        if rr.is_empty() && cr.is_empty() && st.is_empty() && sw.is_empty() {
            continue;
        }
        // Row values read by the pass's column work are splatted before its loop.
        let mut seen = vec![false; n];
        let mut splats = vec![];
        let mut stack: Vec<NodeId> = rr.iter().chain(&cr).map(|&r| arg(r)).collect();
        stack.extend(st.iter().map(|&s| p.stores[s].value));
        stack.extend(sw.iter().map(|(t, _)| *t));
        while let Some(id) = stack.pop() {
            if std::mem::replace(&mut seen[id as usize], true) {
                continue;
            }
            let read_back = p.node(id).level < level && stashes.iter().any(|(t, _)| *t == id);
            if read_back {
                continue;
            }
            if region(p, id) == Region::Col {
                stack.extend(p.node(id).expr.args());
            } else {
                splats.push(id);
            }
        }
        splats.sort_unstable();
        passes.push(Pass { level, rowreds: rr, colreds: cr, stores: st, splats, stash_writes: sw });
    }
    Plan { passes, main_live, fin_live, row_stores, fin_stores, row_colreds, colreds, stashes }
}
