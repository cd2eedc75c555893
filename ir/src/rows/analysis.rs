//! The analyses every backend runs first on a row program: where each node's code goes
//! ([`region`]) and which stores and values the row loop and the finalize step need
//! ([`liveness`]).
//!
//! A node's *region* says where its code goes: once at function entry (kernel-wide values), once
//! per row (row values, after the pass that produces their level), per column inside a column
//! loop (element and column values), or in the finalize step (column-reduction results).
//! Liveness splits the stores between the row loop (element and row results) and the finalize
//! step (column and scalar results, written once) and finds what each needs.

use super::{Expr, NodeId, Prog, Space, FINAL};

/// Where a node is computed (both backends schedule row programs by it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// Once, at function entry (kernel-wide values).
    Entry,
    /// Once per row, after the pass producing its level.
    Row,
    /// Per column, inside a column loop.
    Col,
    /// In the finalize function (column-reduction results and what depends on them).
    Final,
}

/// The region of node `id` of `p`.
pub fn region(p: &Prog, id: NodeId) -> Region {
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

/// What every backend derives first from a row program: which stores the row loop and which the
/// finalize step writes, the values each of them needs, and the column reductions.
pub struct Liveness {
    /// Values the row loop computes.
    pub main_live: Vec<bool>,
    /// Values the finalize step computes.
    pub fin_live: Vec<bool>,
    /// Stores of per-row values.
    pub row_stores: Vec<usize>,
    /// Stores of per-element values.
    pub elem_stores: Vec<usize>,
    /// Stores of the finalize step (column-reduction results, results without a row axis).
    pub fin_stores: Vec<usize>,
    /// Every column reduction the finalize step combines.
    pub colreds: Vec<NodeId>,
}

fn mark(p: &Prog, live: &mut [bool], root: NodeId, stop_at_colred: bool) {
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        if std::mem::replace(&mut live[id as usize], true) {
            continue;
        }
        let e = &p.node(id).expr;
        if stop_at_colred && matches!(e, Expr::ColReduce(..)) {
            continue;
        }
        stack.extend(e.args());
    }
}

/// The stores and live values of `p`; see [`Liveness`].
pub fn liveness(p: &Prog) -> Liveness {
    let n = p.nodes.len();
    let (mut main_live, mut fin_live) = (vec![false; n], vec![false; n]);
    let (mut row_stores, mut elem_stores, mut fin_stores) = (vec![], vec![], vec![]);
    for (i, s) in p.stores.iter().enumerate() {
        // Column results and scalars are written once, by the finalize step; with a single
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
    Liveness { main_live, fin_live, row_stores, elem_stores, fin_stores, colreds }
}
