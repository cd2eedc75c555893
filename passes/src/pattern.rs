//! Read-only views of a graph for pattern matching: producers by op kind, splat constants, and
//! use counts restricted to live nodes. Every accessor returns `None` on a mismatch instead of
//! indexing blindly, so matchers never panic on arbitrary (verified) graphs.

use std::cell::OnceCell;

use fusec_ir::interp::round_to;
use fusec_ir::verify::ValueNames;
use fusec_ir::{BinaryOp, DType, Graph, Node, Op, ReduceOp, UnaryOp, ValueId};

/// The value of a splat constant `v`: `(raw value, dtype)`, or `None` when `v` is not a `const`.
pub(crate) fn splat(g: &Graph, v: ValueId) -> Option<(f64, DType)> {
    match &g.producer(v).op {
        Op::Const { value, ty } => Some((*value, ty.dtype)),
        _ => None,
    }
}

/// The value a splat constant takes at run time in f32 semantics (rounded to its dtype).
pub(crate) fn splat_rounded(g: &Graph, v: ValueId) -> Option<f64> {
    splat(g, v).map(|(x, dt)| round_to(dt, x))
}

/// A graph together with, for every value, how many operand slots of *live* nodes and graph
/// outputs refer to it (uses by dead nodes do not count: they disappear anyway).
pub(crate) struct View<'g> {
    /// The graph being matched.
    pub g: &'g Graph,
    /// Live uses per value.
    pub uses: Vec<u32>,
    /// Whether each node contributes to an output.
    pub live: Vec<bool>,
    /// Positional names, computed on first use (only refusals need them).
    names: OnceCell<ValueNames>,
}

impl<'g> View<'g> {
    /// Computes liveness and live use counts of `g`.
    pub fn new(g: &'g Graph) -> View<'g> {
        let mut live_val = vec![false; g.values.len()];
        for (_, v) in &g.outputs {
            live_val[v.0 as usize] = true;
        }
        let mut live = vec![false; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate().rev() {
            if n.results.iter().any(|r| live_val[r.0 as usize]) {
                live[i] = true;
                for v in &n.inputs {
                    live_val[v.0 as usize] = true;
                }
            }
        }
        let mut uses = vec![0u32; g.values.len()];
        for (n, _) in g.nodes.iter().zip(&live).filter(|(_, l)| **l) {
            for v in &n.inputs {
                uses[v.0 as usize] += 1;
            }
        }
        for (_, v) in &g.outputs {
            uses[v.0 as usize] += 1;
        }
        View { g, uses, live, names: OnceCell::new() }
    }

    /// The positional name of `v` as printed (`%12`).
    pub fn name(&self, v: ValueId) -> String {
        self.names.get_or_init(|| ValueNames::new(self.g)).name(v)
    }

    /// The node producing `v`.
    pub fn node(&self, v: ValueId) -> &'g Node {
        self.g.producer(v)
    }

    /// The operands of `v = a OP b`.
    pub fn bin(&self, v: ValueId, op: BinaryOp) -> Option<(ValueId, ValueId)> {
        let n = self.node(v);
        (n.op == Op::Binary(op) && n.inputs.len() == 2).then(|| (n.inputs[0], n.inputs[1]))
    }

    /// The operand of `v = OP x`.
    pub fn un(&self, v: ValueId, op: UnaryOp) -> Option<ValueId> {
        let n = self.node(v);
        (n.op == Op::Unary(op) && n.inputs.len() == 1).then(|| n.inputs[0])
    }

    /// The operand and dims of `v = broadcast x {dims}`.
    pub fn bcast(&self, v: ValueId) -> Option<(ValueId, &'g [usize])> {
        let n = self.node(v);
        match &n.op {
            Op::Broadcast { dims, .. } if n.inputs.len() == 1 => Some((n.inputs[0], dims.as_slice())),
            _ => None,
        }
    }

    /// The operand and axes of `v = reduce_OP x {axes}`.
    pub fn reduce(&self, v: ValueId, op: ReduceOp) -> Option<(ValueId, &'g [usize])> {
        let n = self.node(v);
        match &n.op {
            Op::Reduce { op: o, axes } if *o == op && n.inputs.len() == 1 => Some((n.inputs[0], axes.as_slice())),
            _ => None,
        }
    }

    /// Whether the values in `inner` are used only by the nodes producing `inner` and `root`
    /// (counting operand slots of live nodes and graph outputs). Returns the first value with an
    /// outside use.
    pub fn outside_use(&self, inner: &[ValueId], root: ValueId) -> Option<ValueId> {
        let mut counts: Vec<(ValueId, u32)> = inner.iter().map(|&v| (v, 0)).collect();
        let mut nodes: Vec<usize> = inner.iter().chain([&root]).map(|v| self.g.values[v.0 as usize].node.0 as usize).collect();
        // Count each node's operands once, even if it produces two listed values.
        nodes.sort_unstable();
        nodes.dedup();
        for n in nodes {
            for x in &self.g.nodes[n].inputs {
                if let Some(c) = counts.iter_mut().find(|(v, _)| v == x) {
                    c.1 += 1;
                }
            }
        }
        counts.into_iter().find(|&(v, c)| self.uses[v.0 as usize] != c).map(|(v, _)| v)
    }
}

/// `(a, b)` and `(b, a)`: both operand orders of a commutative op.
pub(crate) fn orders(p: (ValueId, ValueId)) -> [(ValueId, ValueId); 2] {
    [p, (p.1, p.0)]
}
