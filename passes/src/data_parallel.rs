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

use std::collections::HashSet;

use fusec_ir::{Graph, Op};

use crate::autodiff::grad_name;

/// Wraps the `loss` output and, with `gradients`, every parameter's `grad.P` output in an
/// `all_reduce`.
/// An error (never a panic) when the graph has neither.
pub fn data_parallel(g: &Graph, gradients: bool) -> Result<Graph, String> {
    let grads: HashSet<String> = if gradients { g.params().into_iter().map(|(p, _)| grad_name(p)).collect() } else { HashSet::new() };
    let mut out = g.clone();
    let mut reduced = 0;
    for i in 0..out.outputs.len() {
        let (name, v) = out.outputs[i].clone();
        if name == "loss" || grads.contains(&name) {
            let r = out.try_add(Op::AllReduce, &[v]).map_err(|e| format!("data-parallel: output `{name}`: {e}"))?;
            out.outputs[i].1 = r[0];
            reduced += 1;
        }
    }
    if reduced == 0 {
        return Err("data-parallel: the graph has no `loss` or gradient output to reduce".to_string());
    }
    Ok(out)
}
