//! `fuse-grad-accum`: `add(acc, matmul(..))` into a gradient accumulator becomes the matmul
//! writing with beta = 1 in place: `gemm {accumulate}`.
//!
//! An accumulator is a `grad.P` input or the result of an accumulation into one (the tied `wte`
//! gets two contributions: the LM-head weight gradient and the embedding's scatter). The
//! accumulator must have no reader other than the add (the gemm overwrites it in place) and the
//! product must have no reader other than the add (it is never materialized).

use std::collections::HashMap;

use fusec_ir::{BinaryOp, Gemm, Graph, Op};

use crate::explain::FusionLog;
use crate::rewrite::{rebuild, value_names, Replacement, Uses};

const PASS: &str = "fuse-grad-accum";

/// Folds gradient-accumulating adds into their matmul producers; see the module docs.
pub fn fuse_grad_accum(g: &Graph, log: &mut FusionLog) -> Result<Graph, String> {
    let uses = Uses::of(g);
    let names = value_names(g);
    let mut is_acc = vec![false; g.values.len()];
    let mut replacements = HashMap::new();
    let mut deleted = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        match &n.op {
            Op::Input { name, .. } if name.starts_with("grad.") => is_acc[n.results[0].0 as usize] = true,
            Op::Binary(BinaryOp::Add) => {
                let Some(k) = n.inputs.iter().position(|v| is_acc[v.0 as usize]) else {
                    continue;
                };
                let (acc, prod) = (n.inputs[k], n.inputs[1 - k]);
                is_acc[n.results[0].0 as usize] = true;
                let pi = g.values[prod.0 as usize].node.0 as usize;
                let mut gm = match &g.nodes[pi].op {
                    Op::MatMul { trans_a, trans_b } => {
                        Gemm { trans_a: *trans_a, trans_b: *trans_b, bias: false, gelu: false, out: g.ty(prod).dtype, accumulate: false }
                    }
                    Op::Gemm(gm) if !gm.accumulate => gm.clone(),
                    _ => continue,
                };
                let at = format!("{} (accumulate into {})", names[prod.0 as usize], names[acc.0 as usize]);
                let refuse = |log: &mut FusionLog, rule, detail: &str| log.refuse(PASS, &at, rule, detail);
                if gm.gelu {
                    refuse(log, "no-gelu-epilogue", "a GELU gemm has two results");
                } else if uses.users[prod.0 as usize] != [i] || uses.is_output[prod.0 as usize] {
                    refuse(log, "product-has-other-users", "the matmul result is read elsewhere");
                } else if uses.users[acc.0 as usize] != [i] || uses.is_output[acc.0 as usize] {
                    refuse(log, "acc-has-other-users", "the accumulator is read elsewhere, so it cannot be overwritten in place");
                } else if g.ty(acc) != g.ty(prod) {
                    refuse(log, "same-type", &format!("{} vs {}", g.ty(acc), g.ty(prod)));
                } else {
                    gm.accumulate = true;
                    let mut inputs = g.nodes[pi].inputs.to_vec();
                    inputs.push(acc);
                    deleted[pi] = true;
                    replacements.insert(i, Replacement { op: Op::Gemm(gm), inputs, exposes: vec![n.results[0]] });
                }
            }
            Op::Gemm(gm) if gm.accumulate => is_acc[n.results[0].0 as usize] = n.inputs.last().is_some_and(|a| is_acc[a.0 as usize]),
            _ => {}
        }
    }
    rebuild(g, replacements, &deleted)
}
