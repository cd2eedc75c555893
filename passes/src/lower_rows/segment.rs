//! Kernel body analysis: concrete shapes, operand numbering, and the split into segments.
//!
//! A *segment* is a group of computed values connected through computed values; operands,
//! constants, iotas and their broadcasts and reshapes are shared freely (each segment loads them
//! itself), and so are scalars computed from operands alone. A kernel from `fuse-elementwise` is
//! one segment, except the multi-tensor AdamW kernel (one per parameter) and kernels whose
//! outputs are independent.

use fusec_ir::interp::concrete_shape;
use fusec_ir::{Bindings, DType, Graph, Op, ValueId};

/// Facts about a kernel body.
pub(crate) struct Body<'g> {
    /// The body graph.
    pub g: &'g Graph,
    /// Concrete shape per value.
    pub shapes: Vec<Vec<usize>>,
    /// Per node: the operand index of an `input` node.
    pub operand: Vec<Option<usize>>,
    /// Per value: computed from operands, constants and iotas only (lowered where used).
    pub free: Vec<bool>,
}

/// One segment: its non-free nodes and its outputs (indices into the body's outputs).
pub(crate) struct Seg {
    /// Its computed nodes, in order.
    pub nodes: Vec<usize>,
    /// Its outputs (indices into the body's outputs).
    pub outputs: Vec<usize>,
}

impl<'g> Body<'g> {
    /// Analyses a body under concrete bindings.
    pub fn new(g: &'g Graph, bind: &Bindings) -> Result<Body<'g>, String> {
        let shapes = g.values.iter().map(|v| concrete_shape(&v.ty, bind)).collect::<Result<Vec<_>, _>>()?;
        let mut operand = vec![None; g.nodes.len()];
        let mut free = vec![false; g.values.len()];
        let mut k = 0;
        for (i, n) in g.nodes.iter().enumerate() {
            let is_free = match &n.op {
                Op::Input { .. } => {
                    operand[i] = Some(k);
                    k += 1;
                    true
                }
                Op::Const { .. } | Op::Iota { .. } => true,
                Op::Broadcast { .. } | Op::Reshape { .. } => free[n.inputs[0].0 as usize],
                op if op.is_elementwise() => n.inputs.iter().all(|v| free[v.0 as usize]),
                _ => false,
            };
            for r in &n.results {
                free[r.0 as usize] = is_free;
            }
        }
        Ok(Body { g, shapes, operand, free })
    }

    /// The node producing `v`.
    pub fn prod(&self, v: ValueId) -> usize {
        self.g.values[v.0 as usize].node.0 as usize
    }

    /// The dtype of `v`.
    pub fn dtype(&self, v: ValueId) -> DType {
        self.g.values[v.0 as usize].ty.dtype
    }

    /// The concrete shape of `v`.
    pub fn shape(&self, v: ValueId) -> &[usize] {
        &self.shapes[v.0 as usize]
    }

    /// Connected groups of non-free nodes, each with its outputs, in output order.
    pub fn segments(&self) -> Vec<Seg> {
        let n = self.g.nodes.len();
        let mut parent: Vec<usize> = (0..n).collect();
        fn find(p: &mut [usize], mut x: usize) -> usize {
            while p[x] != x {
                p[x] = p[p[x]];
                x = p[x];
            }
            x
        }
        // Nodes are connected through every value that costs something to compute: an
        // elementwise op of operands counts too (so that its result is computed once, in the
        // segment that also reduces it), except scalars computed from operands alone, which
        // each segment may recompute (so AdamW updates sharing `lr` stay separate). Readers of
        // one non-scalar operand are connected too: segments run one after the other, and a
        // result written in place over an operand must not be written before another segment
        // reads that operand (within a segment, every read of an element precedes its write).
        let mut layout = vec![false; self.g.values.len()];
        let mut source: Vec<Option<usize>> = vec![None; self.g.values.len()];
        for (i, n) in self.g.nodes.iter().enumerate() {
            let (l, s) = match n.op {
                Op::Input { .. } => (true, Some(i)),
                Op::Const { .. } | Op::Iota { .. } => (true, None),
                Op::Broadcast { .. } | Op::Reshape { .. } => (layout[n.inputs[0].0 as usize], source[n.inputs[0].0 as usize]),
                _ => (false, None),
            };
            for r in &n.results {
                layout[r.0 as usize] = l;
                source[r.0 as usize] = s;
            }
        }
        let numel = |v: ValueId| self.shape(v).iter().product::<usize>();
        let member = |v: ValueId| !layout[v.0 as usize] && (numel(v) > 1 || !self.free[v.0 as usize]);
        // The operand node a layout value reads, when that operand is not a scalar.
        let operand_of = |v: ValueId| source[v.0 as usize].filter(|&k| numel(self.g.nodes[k].results[0]) > 1);
        for (i, node) in self.g.nodes.iter().enumerate() {
            if layout[node.results[0].0 as usize] {
                continue;
            }
            for v in &node.inputs {
                let other = if member(*v) { Some(self.prod(*v)) } else { operand_of(*v) };
                if let Some(o) = other {
                    let (a, b) = (find(&mut parent, i), find(&mut parent, o));
                    parent[a] = b;
                }
            }
        }
        let mut segs: Vec<(Option<usize>, Seg)> = Vec::new();
        for (j, (_, v)) in self.g.outputs.iter().enumerate() {
            let root =
                if !layout[v.0 as usize] { Some(find(&mut parent, self.prod(*v))) } else { operand_of(*v).map(|k| find(&mut parent, k)) };
            match segs.iter_mut().find(|(r, _)| root.is_some() && *r == root) {
                Some((_, s)) => s.outputs.push(j),
                None => segs.push((root, Seg { nodes: vec![], outputs: vec![j] })),
            }
        }
        for (i, node) in self.g.nodes.iter().enumerate() {
            if node.results.iter().any(|r| !layout[r.0 as usize]) {
                let root = find(&mut parent, i);
                if let Some((_, s)) = segs.iter_mut().find(|(r, _)| *r == Some(root)) {
                    s.nodes.push(i);
                }
            }
        }
        segs.into_iter().map(|(_, s)| s).collect()
    }
}
