//! Row buffers for bf16-derived element values that later passes would recompute.
//!
//! A value of level `L` read in a later pass is recomputed there (see [`fusec_ir::rows`]),
//! which is cheap for f32 operands but not for a chain that widens bf16 loads and rounds to
//! bf16: the residual LayerNorm of `--precision bf16` adds the projection's bias to its bf16
//! product and rounds in each of its three passes. Such a value is *stashed* instead: pass `L`
//! writes it to a per-chunk row buffer (`C` floats) and later passes load it, exactly the f32
//! the recomputation would give. Chains without bf16 are left as they are, so f32 kernels do
//! not change.

use fusec_ir::rows::{Expr, Mem, NodeId, Prog, Slot, Ty, FINAL};

/// Element nodes in a recomputed chain below which a stash does not pay off.
const MIN_NODES: usize = 3;

/// Adds stashes (to [`Prog::stashes`], each with a new scratch slot) for the f32 element values
/// that a later pass reads or stores, whose recomputed chain holds a bf16 load or a rounding to
/// bf16 and at least [`MIN_NODES`] element nodes. Runs after the native routines are assigned.
pub(crate) fn assign(p: &mut Prog) {
    let n = p.nodes.len();
    let col = |i: usize| p.nodes[i].space.has_col() && p.nodes[i].level != FINAL;
    let last = (0..n).filter(|&i| col(i)).map(|i| p.nodes[i].level).max().unwrap_or(0);
    if last == 0 {
        return;
    }
    let kept = |i: usize| p.stashes.iter().any(|&(t, _)| t as usize == i) || p.offloads.iter().any(|&(t, _)| t as usize == i);
    // Read by an element value of a later pass (not a row reduction, finished in its own pass,
    // nor a pick, evaluated at one column), or stored (stores are in the last pass).
    let mut later = vec![false; n];
    let mut picked = vec![false; n];
    for y in &p.nodes {
        for a in y.expr.args() {
            let a = a as usize;
            match y.expr {
                Expr::Pick(..) => picked[a] = true,
                Expr::RowReduce(..) | Expr::ColReduce(..) => {}
                _ if y.space.has_col() && y.level != FINAL && y.level > p.nodes[a].level => later[a] = true,
                _ => {}
            }
        }
    }
    for s in &p.stores {
        let v = s.value as usize;
        if col(v) && p.nodes[v].level < last {
            later[v] = true;
        }
    }
    let mut chosen = vec![];
    for i in 0..n {
        if !later[i] || picked[i] || !col(i) || p.nodes[i].ty != Ty::F32 || kept(i) || matches!(p.nodes[i].expr, Expr::Load(_)) {
            continue;
        }
        // The chain pass `level(i)` computes and later passes would repeat.
        let (mut nodes, mut bf16) = (0, false);
        let mut stack = vec![i];
        let mut seen = vec![false; n];
        while let Some(x) = stack.pop() {
            if std::mem::replace(&mut seen[x], true) || !col(x) || p.nodes[x].level != p.nodes[i].level || (x != i && kept(x)) {
                continue;
            }
            nodes += 1;
            match &p.nodes[x].expr {
                Expr::Load(v) if v.mem == Mem::Bf16 => bf16 = true,
                Expr::RoundBf16(_) => bf16 = true,
                _ => {}
            }
            stack.extend(p.nodes[x].expr.args().into_iter().map(|a| a as usize));
        }
        if bf16 && nodes >= MIN_NODES {
            chosen.push(i as NodeId);
        }
    }
    for id in chosen {
        p.slots.push(Slot::Scratch((p.chunks * p.cols) as usize));
        p.stashes.push((id, (p.slots.len() - 1) as u32));
    }
}
