//! `data-parallel`: makes a graph from `autodiff` one rank of a data-parallel run. Every rank
//! runs the same program on its own slice of the global batch; an `all_reduce` (the mean over
//! the ranks) of each gradient output makes every rank's gradients those of the global batch,
//! so every rank applies the same update (then `optimizer` clips and updates as on one GPU).
//! The `loss` output is reduced too, so that every rank reports the global batch's loss.
//!
//! The mean is the whole scaling: the loss is already a mean over each rank's positions, and
//! ranks hold equal slices, so the mean over ranks is the mean over the global batch. On one
//! rank `all_reduce` is the identity, but it still bounds the fusions around it (the gradient
//! norm's sums would run in other kernels, in another order): `fusec run` leaves the pass out
//! of one-rank runs (unless ZeRO-1 shards), so they compute exactly what a plain run does.
//! Micro-steps that only accumulate (the `Grad` program) reduce their loss but not their
//! gradients: the last micro-step reduces the sum, as PyTorch DDP's `no_sync` does.

use std::collections::{HashMap, HashSet};

use fusec_ir::{Bindings, Graph, Op, ValueId};

use crate::autodiff::grad_name;
use crate::rewrite::Copier;

/// The most gradient bytes one `all_reduce` averages (PyTorch DDP's `bucket_cap_mb` default):
/// fewer, larger collectives pay NCCL's fixed cost less often; a gradient larger than this gets
/// a bucket of its own.
pub const BUCKET_BYTES: u64 = 25 << 20;

/// Wraps the `loss` output in an `all_reduce` right after the loss (the end of the forward,
/// where `recompute` looks for it) and, with `gradients`, the parameters' `grad.P` outputs in
/// buckets of at most [`BUCKET_BYTES`], in the order the backward produces them, one
/// `all_reduce` a bucket at the end of the graph (right after their producers they would close
/// the producers' kernels to the fusions that follow; `schedule` places them). An error (never
/// a panic) when the graph has neither, or a value to average is not a float tensor.
pub fn data_parallel(g: &Graph, gradients: bool) -> Result<Graph, String> {
    let grads: HashSet<String> = if gradients { g.params().into_iter().map(|(p, _)| grad_name(p)).collect() } else { HashSet::new() };
    let loss = g.output_named("loss");
    if loss.is_none() && grads.is_empty() {
        return Err("data-parallel: the graph has no `loss` or gradient output to reduce".to_string());
    }
    let mut c = Copier::new(g, "data-parallel");
    // Old value -> its average in the new graph.
    let mut reduced = HashMap::new();
    for n in &g.nodes {
        let ins = c.get_all(&n.inputs)?;
        c.copy(n, &ins);
        if let Some(l) = loss.filter(|l| n.results.contains(l)) {
            reduced.insert(l, all_reduce(&mut c, &[l])?[0]);
        }
    }
    let mut order: Vec<ValueId> = vec![];
    for (_, v) in g.outputs.iter().filter(|(name, _)| grads.contains(name)) {
        if !reduced.contains_key(v) && !order.contains(v) {
            order.push(*v);
        }
    }
    // Production order: the position of each gradient's producer.
    order.sort_by_key(|v| g.values[v.0 as usize].node.0);
    for bucket in buckets(g, &order)? {
        for (old, new) in bucket.iter().zip(all_reduce(&mut c, &bucket)?) {
            reduced.insert(*old, new);
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

/// `values` (in production order) cut into runs of at most [`BUCKET_BYTES`].
fn buckets(g: &Graph, values: &[ValueId]) -> Result<Vec<Vec<ValueId>>, String> {
    let mut out: Vec<Vec<ValueId>> = vec![];
    let mut filled = 0;
    for &v in values {
        let ty = g.ty(v);
        // Gradients of parameters have concrete shapes.
        let bytes = ty.bytes(&Bindings::default()).map_err(|e| format!("data-parallel: gradient {ty}: {e}"))? as u64;
        match out.last_mut() {
            Some(b) if filled + bytes <= BUCKET_BYTES => b.push(v),
            _ => {
                out.push(vec![v]);
                filled = 0;
            }
        }
        filled += bytes;
    }
    Ok(out)
}

/// Appends one `all_reduce` of old values `vs` to the new graph (an error for a value that is
/// not a float tensor).
fn all_reduce(c: &mut Copier, vs: &[ValueId]) -> Result<Vec<ValueId>, String> {
    let xs = c.get_all(vs)?;
    let r = c.out.try_add(Op::AllReduce, &xs).map_err(|e| format!("data-parallel: cannot average over the ranks: {e}"))?;
    Ok(r.to_vec())
}
