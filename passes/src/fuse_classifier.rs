//! `fuse-classifier`: a `cross_entropy` and a `cross_entropy_grad` of the same logits become one
//! `cross_entropy_with_grad` (llm.c's fused classifier): one kernel reads each row of logits for
//! its maximum and sum once, writes the loss and the gradient, instead of a loss kernel and a
//! gradient kernel that each read the `[B·T, Vp]` logits again.
//!
//! The two must read the same logits (the same value, or widening casts of one value — `amp`
//! makes one per reader) and targets, and the gradient's `dloss` must not depend on the loss.
//! The fused node stands where the gradient was; what reads the loss (the mean that becomes the
//! `loss` output) moves after everything else, so the gradient's readers (its bf16 cast) come
//! first and join its kernel. Each refusal names its predicate for `--explain-fusion`.

use std::collections::HashSet;

use fusec_ir::{Graph, Op, ValueId};

use crate::explain::FusionLog;
use crate::rewrite::{value_names, Copier};

const PASS: &str = "fuse-classifier";

/// Fuses loss and gradient pairs; see the module docs.
pub fn fuse_classifier(g: &Graph, log: &mut FusionLog) -> Result<Graph, String> {
    let names = value_names(g);
    // (loss node, gradient node) pairs.
    let mut pairs: Vec<(usize, usize)> = vec![];
    for (gi, n) in g.nodes.iter().enumerate() {
        let Op::CrossEntropyGrad { vocab } = n.op else {
            continue;
        };
        let at = format!("{} (cross_entropy_grad)", names[n.results[0].0 as usize]);
        let same = |ci: usize| {
            let c = &g.nodes[ci];
            c.op == Op::CrossEntropy { vocab } && c.inputs[1] == n.inputs[1] && source(g, c.inputs[0]) == source(g, n.inputs[0])
        };
        let Some(ci) = (0..gi).find(|&ci| same(ci) && !pairs.iter().any(|p| p.0 == ci)) else {
            log.refuse(PASS, &at, "no-matching-loss", "no earlier cross_entropy reads the same logits and targets");
            continue;
        };
        if depends_on(g, n.inputs[2], ci) {
            log.refuse(PASS, &at, "dloss-reads-loss", "its dloss is computed from the loss");
            continue;
        }
        pairs.push((ci, gi));
    }
    if pairs.is_empty() {
        return Ok(g.clone());
    }
    let mut c = Copier::new(g, PASS);
    // Values computed from a loss whose fused node is not emitted yet, and the nodes that read
    // them, moved after the whole graph (their only reader is the `loss` output's chain).
    let mut pending = vec![false; g.values.len()];
    let mut deferred = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(&(ci, _)) = pairs.iter().find(|p| p.0 == i) {
            pending[g.nodes[ci].results[0].0 as usize] = true;
        } else if let Some(&(ci, gi)) = pairs.iter().find(|p| p.1 == i) {
            // The fused node, where the gradient was (its dloss is computed by now).
            let (loss, grad) = (&g.nodes[ci], &g.nodes[gi]);
            let Op::CrossEntropy { vocab } = loss.op else { unreachable!("paired with a cross_entropy") };
            let ins = c.get_all(&[loss.inputs[0], loss.inputs[1], grad.inputs[2]])?;
            let r = c.out.try_add(Op::CrossEntropyWithGrad { vocab }, &ins)?;
            c.set(loss.results[0], r[0]);
            c.set(grad.results[0], r[1]);
            pending[loss.results[0].0 as usize] = false;
        } else if n.inputs.iter().any(|v| pending[v.0 as usize]) {
            n.results.iter().for_each(|r| pending[r.0 as usize] = true);
            deferred.push(i);
        } else {
            let ins = c.get_all(&n.inputs)?;
            c.copy(n, &ins);
        }
    }
    for i in deferred {
        let ins = c.get_all(&g.nodes[i].inputs)?;
        c.copy(&g.nodes[i], &ins);
    }
    Ok(crate::rewrite::remove_dead_nodes(&c.finish()?))
}

/// `v` without the widening casts in front of it.
fn source(g: &Graph, mut v: ValueId) -> ValueId {
    while let Op::Cast { to } = g.producer(v).op {
        let x = g.producer(v).inputs[0];
        if to.size_bytes() <= g.ty(x).dtype.size_bytes() {
            break;
        }
        v = x;
    }
    v
}

/// Whether `v` is computed from node `ni`'s results.
fn depends_on(g: &Graph, v: ValueId, ni: usize) -> bool {
    let mut stack = vec![v];
    let mut seen = HashSet::new();
    while let Some(x) = stack.pop() {
        let p = g.values[x.0 as usize].node.0 as usize;
        if p == ni {
            return true;
        }
        if p > ni && seen.insert(p) {
            stack.extend(g.nodes[p].inputs.iter().copied());
        }
    }
    false
}
