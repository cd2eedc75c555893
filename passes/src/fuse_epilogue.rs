//! `fuse-epilogue`: bias add, GELU and a cast folded into the matmul that produces them.
//!
//! `add(matmul(a, b), broadcast(bias))` becomes `gemm {bias}` (on bf16 operands only when
//! something other than elementwise ops reads the sum: see `bf16-bias-left-to-consumer`); a
//! following `gelu` joins as the
//! GELU epilogue (the pre-GELU value, which the backward's `gelu_grad` reads, becomes the gemm's
//! second result); a `cast` of the matmul's result that does not widen becomes the `out` dtype. Each refusal names
//! its predicate for `--explain-fusion`. The unfused lowering stays available: a `gemm` is
//! defined as exactly that op sequence, so a backend may always expand it.

use std::collections::HashMap;

use fusec_ir::{BinaryOp, DType, Gemm, Graph, Op, ValueId};

use crate::explain::FusionLog;
use crate::rewrite::{rebuild, value_names, Replacement, Uses};

const PASS: &str = "fuse-epilogue";

/// Folds epilogues into matmuls; see the module docs.
pub fn fuse_epilogue(g: &Graph, log: &mut FusionLog) -> Result<Graph, String> {
    let uses = Uses::of(g);
    let names = value_names(g);
    let mut replacements = HashMap::new();
    let mut deleted = vec![false; g.nodes.len()];
    for (mi, n) in g.nodes.iter().enumerate() {
        let Op::MatMul { trans_a, trans_b } = n.op else {
            continue;
        };
        let y = n.results[0];
        let at = format!("{} (matmul epilogue)", names[y.0 as usize]);
        let mut gm = Gemm { trans_a, trans_b, bias: false, gelu: false, out: g.ty(y).dtype, accumulate: false };
        let mut inputs = vec![n.inputs[0], n.inputs[1]];
        let (mut root, mut cur, mut exposes) = (mi, y, vec![y]);
        // Bias: the matmul's only user adds a vector broadcast along the last axis. On bf16
        // operands a bias whose sum only elementwise ops read (the residual add) is left to
        // their kernel, where it costs no pass: cuBLASLt's bf16 bias epilogue runs at 462
        // TFLOP/s against 724 for the plain product (H100, GPT-2 124M projections).
        let bias = bias_add(g, &uses, mi, y);
        let left = bias.filter(|&(ai, _)| {
            let sum = g.nodes[ai].results[0];
            g.ty(n.inputs[0]).dtype == DType::BF16
                && !uses.is_output[sum.0 as usize]
                && uses.users[sum.0 as usize].iter().all(|&u| g.nodes[u].op.is_elementwise() && g.nodes[u].op != Op::Gelu)
        });
        if left.is_some() {
            log.refuse(PASS, &at, "bf16-bias-left-to-consumer", "only elementwise ops read the biased bf16 value: their kernel adds the bias");
        }
        if let Some((ai, bias)) = bias.filter(|_| left.is_none()) {
            gm.bias = true;
            inputs.push(bias);
            deleted[ai] = true;
            (root, cur) = (ai, g.nodes[ai].results[0]);
            exposes = vec![cur];
            // GELU: one user of the biased value is a gelu; the biased value is the aux result.
            if let Some(gi) = uses.users[cur.0 as usize].iter().copied().find(|&u| matches!(g.nodes[u].op, Op::Gelu)) {
                if uses.users[cur.0 as usize].iter().any(|&u| u < gi) {
                    log.refuse(PASS, &at, "pre-gelu-used-before-gelu", "the biased value is read before the GELU");
                } else {
                    gm.gelu = true;
                    deleted[gi] = true;
                    root = gi;
                    exposes = vec![g.nodes[gi].results[0], cur];
                    cur = g.nodes[gi].results[0];
                }
            }
        } else if left.is_none() && uses.users[y.0 as usize].iter().any(|&u| adds_a_broadcast(g, u, y)) {
            log.refuse(
                PASS,
                &at,
                "bias-is-row-vector",
                "the add's other operand is not a vector broadcast along the last axis, or the matmul result has other users",
            );
        }
        // Cast: the current result's only user is a cast to a float type (a gemm's result), one
        // that does not widen: a widened bf16 product is widened by its reader, in its kernel,
        // so the product is stored in bf16 (`amp` makes parameter gradients f32 gemms).
        if let [ci] = uses.users[cur.0 as usize][..] {
            if let Op::Cast { to } = g.nodes[ci].op {
                if !uses.is_output[cur.0 as usize] && to.is_float() && to.size_bytes() <= g.ty(cur).dtype.size_bytes() {
                    gm.out = to;
                    deleted[ci] = true;
                    root = ci;
                    exposes[0] = g.nodes[ci].results[0];
                }
            }
        }
        if root == mi {
            continue;
        }
        deleted[mi] = true;
        replacements.insert(root, Replacement { op: Op::Gemm(gm), inputs, exposes });
    }
    rebuild(g, replacements, &deleted)
}

/// `add(y, broadcast(bias, dims = [last]))` (either order) as the only user of `y`: the add's
/// node index and the bias vector.
fn bias_add(g: &Graph, uses: &Uses, mi: usize, y: ValueId) -> Option<(usize, ValueId)> {
    let [ai] = uses.users[y.0 as usize][..] else {
        return None;
    };
    if uses.is_output[y.0 as usize] || uses.users[y.0 as usize].iter().any(|&u| u < mi) {
        return None;
    }
    let add = &g.nodes[ai];
    if add.op != Op::Binary(BinaryOp::Add) {
        return None;
    }
    let other = if add.inputs[0] == y { add.inputs[1] } else { add.inputs[0] };
    if other == y {
        return None;
    }
    let (yt, rank) = (g.ty(y), g.ty(y).shape.rank());
    match (&g.producer(other).op, g.producer(other).inputs.first()) {
        // The bias is a whole row: a vector as long as the last axis (not one element repeated).
        (Op::Broadcast { dims, .. }, Some(&bias)) if rank >= 1 && *dims == [rank - 1] => {
            let bt = g.ty(bias);
            (bt.dtype == yt.dtype && bt.shape.0[..] == yt.shape.0[rank - 1..]).then_some((ai, bias))
        }
        _ => None,
    }
}

/// Whether node `u` adds a broadcast value to `y` (a bias-add candidate).
fn adds_a_broadcast(g: &Graph, u: usize, y: ValueId) -> bool {
    let n = &g.nodes[u];
    n.op == Op::Binary(BinaryOp::Add) && n.inputs.iter().any(|&v| v != y && matches!(g.producer(v).op, Op::Broadcast { .. }))
}
