//! `recompute` (`--recompute gelu` and `gelu+layernorm`, llm.c's `-r 1` and `-r 2`): the backward
//! recomputes GELU outputs from their pre-activations (and LayerNorm outputs from their inputs)
//! instead of reading the values the forward stored, so those values die after their last
//! forward use and the memory plan does not keep them through the backward.
//!
//! The forward is every node up to the one that produces the `loss` output; the backward is
//! everything after it. A value is *recomputable* when a forward `gelu` produces it (with
//! `gelu+layernorm`: or it is a forward `layernorm`'s normalized output), or a forward `cast` or
//! `reshape` of a recomputable value does (the `amp` pass's bf16 copies), or a forward widening
//! `cast` does (bf16 to f32: free to redo, and twice its operand's size). Each recomputable
//! value read in the backward is recomputed once, just before its first backward reader, from
//! the non-recomputable values it derives from (the GELU pre-activation, which `gelu_grad`
//! keeps alive anyway; the LayerNorm input and weights, which its gradient reads too); every
//! backward reader takes the copy.
//! The results are bit for bit those of the graph without the pass: the same ops on the same
//! values.

use std::collections::HashMap;

use fusec_ir::{Graph, Op, ValueId};

use crate::rewrite::Copier;

/// What the backward recomputes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Nothing: the backward reads what the forward stored.
    #[default]
    None,
    /// GELU outputs (and their casts and reshapes).
    Gelu,
    /// GELU and LayerNorm outputs (and their casts and reshapes).
    GeluLayernorm,
}

impl Recompute {
    /// The names `--recompute` accepts, in order.
    pub const NAMES: [&'static str; 3] = ["none", "gelu", "gelu+layernorm"];

    /// The default for a precision, chosen by measurement (H100, same call as torch.compile; the
    /// README's tables): in fp32, `gelu+layernorm` costs 3.5% of the step for 19% less memory,
    /// and fp32 runs are for exactness, so nothing is recomputed; in bf16, `gelu` keeps the peak
    /// at 0.87x torch.compile's at 124M and 0.89x at 1.5B (`none`: 1.01x and 1.00x) and is 2%
    /// faster than `gelu+layernorm` (0.81x and 0.83x), so it is the default.
    pub fn default_for(p: crate::amp::Precision) -> Recompute {
        if p.is_bf16() {
            Recompute::Gelu
        } else {
            Recompute::None
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Recompute, String> {
        match s {
            "none" => Ok(Recompute::None),
            "gelu" => Ok(Recompute::Gelu),
            "gelu+layernorm" => Ok(Recompute::GeluLayernorm),
            _ => Err(format!("unknown recompute policy `{s}`; expected one of: {}", Recompute::NAMES.join(", "))),
        }
    }
}

/// Applies the policy; see the module docs. A graph without a `loss` output has no backward
/// and is returned unchanged.
pub fn recompute(g: &Graph, policy: Recompute) -> Result<Graph, String> {
    let Some(loss) = g.output_named("loss").filter(|_| policy != Recompute::None) else {
        return Ok(g.clone());
    };
    let last_forward = g.values[loss.0 as usize].node.0 as usize;
    // Recomputable values: forward gelu results (and layernorm outputs), and forward casts /
    // reshapes of them.
    let mut recomputable = vec![false; g.values.len()];
    for n in &g.nodes[..=last_forward] {
        let from_recomputable = n.inputs.first().is_some_and(|v| recomputable[v.0 as usize]);
        let ok = match n.op {
            Op::Gelu => true,
            Op::LayerNorm { .. } => policy == Recompute::GeluLayernorm,
            // A widening cast costs nothing to redo and is twice the size of its operand (the
            // f32 view of a bf16 residual that a recomputed LayerNorm reads).
            Op::Cast { to } if widens(g, n.inputs[0], to) => true,
            Op::Cast { .. } | Op::Reshape { .. } => from_recomputable,
            _ => false,
        };
        if let (true, Some(r)) = (ok, n.results.first()) {
            recomputable[r.0 as usize] = true;
        }
    }
    let mut c = Copier::new(g, "recompute");
    let mut again: HashMap<ValueId, ValueId> = HashMap::new();
    for i in order(g, last_forward, &recomputable) {
        let n = &g.nodes[i];
        let mut ins = Vec::with_capacity(n.inputs.len());
        for &v in &n.inputs {
            ins.push(if i > last_forward && recomputable[v.0 as usize] {
                recomputed(&mut c, &recomputable, &mut again, v)?
            } else {
                c.get(v)?
            });
        }
        c.copy(n, &ins);
    }
    c.finish()
}

/// The nodes in copy order: the input order, except that a backward reader of a recomputable
/// GELU output that comes before the `gelu_grad` of the same pre-activation moves after it (and
/// after the elementwise and reduction nodes that follow it), together with the nodes in
/// between that depend on it. The recomputed GELU is emitted
/// before its first reader, so it then sits next to the gradient that reads the same
/// pre-activation, and `fuse-elementwise` computes both in one kernel (the pre-activation is
/// read once; GPT-2 124M bf16 on an H100: the standalone GELU took 108 us a layer).
fn order(g: &Graph, last_forward: usize, recomputable: &[bool]) -> Vec<usize> {
    let n = g.nodes.len();
    // The pre-activation each recomputable value derives from through a forward GELU.
    let mut pre: Vec<Option<ValueId>> = vec![None; g.values.len()];
    for node in &g.nodes[..=last_forward] {
        let (Some(&r), Some(&x)) = (node.results.first(), node.inputs.first()) else { continue };
        if recomputable[r.0 as usize] {
            pre[r.0 as usize] = if node.op == Op::Gelu { Some(x) } else { pre[x.0 as usize] };
        }
    }
    let mut moved = vec![false; n];
    let mut before: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
    for (y, node) in g.nodes.iter().enumerate().skip(last_forward + 1) {
        if node.op != Op::GeluGrad {
            continue;
        }
        // The readers of this pre-activation's GELU between the forward and `y`, and what
        // depends on them there (`y` itself does not: it reads the pre-activation).
        let mut dep = vec![false; n];
        for i in last_forward + 1..y {
            let reads_gelu = g.nodes[i].inputs.iter().any(|v| recomputable[v.0 as usize] && pre[v.0 as usize] == Some(node.inputs[0]));
            let reads_dep = g.nodes[i].inputs.iter().any(|v| dep[g.values[v.0 as usize].node.0 as usize]);
            dep[i] = !moved[i] && (reads_gelu || reads_dep);
        }
        if node.inputs.iter().any(|v| dep[g.values[v.0 as usize].node.0 as usize]) {
            continue;
        }
        // After the gradient's own elementwise and reduction readers (its kernel's epilogue):
        // before the next node that a kernel does not absorb.
        let at = (y + 1..n).find(|&j| !crate::fuse_elementwise::joins_producers(&g.nodes[j].op)).unwrap_or(n);
        for (i, _) in dep.iter().enumerate().filter(|(_, d)| **d) {
            moved[i] = true;
            before[at].push(i);
        }
    }
    let mut out = Vec::with_capacity(n);
    for (i, first) in before.iter().enumerate() {
        out.extend(first.iter().copied());
        if i < n && !moved[i] {
            out.push(i);
        }
    }
    out
}

/// Whether casting `v` to `to` widens a float (bf16 to f32).
fn widens(g: &Graph, v: ValueId, to: fusec_ir::DType) -> bool {
    let from = g.ty(v).dtype;
    from.is_float() && to.is_float() && to.size_bytes() > from.size_bytes()
}

/// The backward's copy of recomputable `v`, emitted now (with what it derives from) unless it
/// already exists: a depth-first walk over recomputable operands, without recursion.
fn recomputed(c: &mut Copier, recomputable: &[bool], again: &mut HashMap<ValueId, ValueId>, v: ValueId) -> Result<ValueId, String> {
    let g = c.old;
    let mut stack = vec![v];
    while let Some(&cur) = stack.last() {
        if again.contains_key(&cur) {
            stack.pop();
            continue;
        }
        let p = g.producer(cur);
        let missing: Vec<ValueId> = p.inputs.iter().copied().filter(|u| recomputable[u.0 as usize] && !again.contains_key(u)).collect();
        if !missing.is_empty() {
            stack.extend(missing);
            continue;
        }
        let ins = p
            .inputs
            .iter()
            .map(|u| if recomputable[u.0 as usize] { Ok(again[u]) } else { c.get(*u) })
            .collect::<Result<Vec<ValueId>, String>>()?;
        let tys = p.results.iter().map(|r| g.ty(*r).clone()).collect();
        let new = c.out.push_unchecked(p.op.clone(), &ins, tys);
        for (old, new) in p.results.iter().zip(new) {
            if recomputable[old.0 as usize] {
                again.insert(*old, new);
            }
        }
        stack.pop();
    }
    again.get(&v).copied().ok_or_else(|| format!("recompute: {v:?} was not recomputed"))
}
