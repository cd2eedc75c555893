//! `data-parallel`: makes a graph from `autodiff` one rank of a data-parallel run. Every rank
//! runs the same program on its own slice of the global batch; an `all_reduce` (the mean over
//! the ranks) of each gradient output makes every rank's gradients those of the global batch,
//! so every rank applies the same update (then `optimizer` clips and updates as on one GPU).
//! The `loss` output is reduced too, so that every rank reports the global batch's loss.
//!
//! The mean is the whole scaling: the loss is already a mean over each rank's positions, and
//! ranks hold equal slices, so the mean over ranks is the mean over the global batch. On one
//! rank `all_reduce` is the identity, so a one-rank run computes exactly what a plain run does.
//! Micro-steps that only accumulate (the `Grad` program) reduce their loss but not their
//! gradients: the last micro-step reduces the sum, as PyTorch DDP's `no_sync` does.

use std::collections::{HashMap, HashSet};

use fusec_ir::{Graph, Op, ValueId};

use crate::autodiff::grad_name;
use crate::rewrite::Copier;

/// Wraps the `loss` output and, with `gradients`, every parameter's `grad.P` output in an
/// `all_reduce`: the loss's right after the loss (the end of the forward, where `recompute`
/// looks for it), the gradients' at the end (right after their producers they would close the
/// producers' kernels to the fusions that follow; `schedule` places them). An error (never a
/// panic) when the graph has neither.
pub fn data_parallel(g: &Graph, gradients: bool) -> Result<Graph, String> {
    let grads: HashSet<String> = if gradients { g.params().into_iter().map(|(p, _)| grad_name(p)).collect() } else { HashSet::new() };
    let loss = g.output_named("loss");
    if loss.is_none() && grads.is_empty() {
        return Err("data-parallel: the graph has no `loss` or gradient output to reduce".to_string());
    }
    let mut c = Copier::new(g, "data-parallel");
    // Old value -> its all_reduce in the new graph.
    let mut reduced = HashMap::new();
    for n in &g.nodes {
        let ins = c.get_all(&n.inputs)?;
        c.copy(n, &ins);
        if let Some(l) = loss.filter(|l| n.results.contains(l)) {
            reduced.insert(l, all_reduce(&mut c, l)?);
        }
    }
    for (_, v) in g.outputs.iter().filter(|(name, _)| grads.contains(name)) {
        if !reduced.contains_key(v) {
            reduced.insert(*v, all_reduce(&mut c, *v)?);
        }
    }
    let mut out = c.finish()?;
    for ((_, new), (name, old)) in out.outputs.iter_mut().zip(&g.outputs) {
        if let Some(&r) = reduced.get(old).filter(|_| name == "loss" || grads.contains(name)) {
            *new = r;
        }
    }
    Ok(out)
}

/// Appends `all_reduce` of old value `v` to the new graph (an error for a value that is not a
/// float tensor).
fn all_reduce(c: &mut Copier, v: ValueId) -> Result<ValueId, String> {
    let x = c.get(v)?;
    let ty = c.out.ty(x).clone();
    Ok(c.out.try_add(Op::AllReduce, &[x]).map_err(|e| format!("data-parallel: cannot average {ty} over the ranks: {e}"))?[0])
}
