//! Liveness on the launch order and buffer groups: values that share one buffer over time.
//!
//! A *version* is a value that writes a buffer (every value but a `reshape` result), together
//! with its views; it lives from its definition to the last read of it or of any of its views. A
//! *group* is a set of versions placed in one buffer, ordered by definition; it is legal when
//! each version is dead before the next one is written, or is last read by the very node that
//! writes the next one (in place). A group may be *owned* by a parameter or input: it is then
//! that persistent tensor's buffer.

use fusec_ir::{Bindings, Graph, Op};

/// Positions and sizes of every value on the launch order (the node order of the graph).
pub(super) struct Live {
    /// Number of nodes; as an end position it means "still live when the step ends".
    pub n: usize,
    /// Per value: the position of its producer.
    pub def: Vec<usize>,
    /// Per value: its last read (`n` for graph outputs, its definition if never read).
    pub end: Vec<usize>,
    /// Per value: the value whose buffer it views (itself unless a `reshape` result).
    pub base: Vec<u32>,
    /// Per base value: the end of its version (the latest end over it and its views).
    pub vend: Vec<usize>,
    /// Per value: bytes under the binding.
    pub bytes: Vec<u64>,
}

impl Live {
    /// Computes liveness of `g`'s node order; every symbolic dim must be bound.
    pub fn new(g: &Graph, bind: &Bindings) -> Result<Live, String> {
        let n = g.nodes.len();
        let nv = g.values.len();
        let mut def = vec![0; nv];
        let mut end = vec![0; nv];
        let mut bytes = vec![0u64; nv];
        for (i, node) in g.nodes.iter().enumerate() {
            for r in &node.results {
                def[r.0 as usize] = i;
                end[r.0 as usize] = i;
            }
            for v in &node.inputs {
                end[v.0 as usize] = i;
            }
        }
        for (_, v) in &g.outputs {
            end[v.0 as usize] = n;
        }
        for (v, info) in g.values.iter().enumerate() {
            bytes[v] = info.ty.bytes(bind).map_err(|e| format!("memplan: {e}"))? as u64;
        }
        let base = crate::schedule::view_bases(g);
        let mut vend = end.clone();
        // `base` follows reshape chains to the end, so each view folds straight into its base.
        for v in 0..nv {
            let b = base[v] as usize;
            if b != v {
                vend[b] = vend[b].max(end[v]);
            }
        }
        Ok(Live { n, def, end, base, vend, bytes })
    }
}

/// Why two groups cannot share a buffer.
pub(super) enum Conflict {
    /// Both are owned by (different) persistent tensors.
    TwoOwners(u32, u32),
    /// Version `later` is written (at its definition) while `earlier` is still live.
    Overlap { earlier: u32, later: u32 },
}

/// A union-find over base values whose roots hold each group's versions and owner.
pub(super) struct Groups {
    parent: Vec<u32>,
    /// At roots: the base values of the group, sorted by definition.
    versions: Vec<Vec<u32>>,
    /// At roots: the owning parameter or input value, if any.
    owner: Vec<Option<u32>>,
    /// At roots: the owner is written back (a graph output named like it lives here).
    written_back: Vec<bool>,
}

impl Groups {
    /// One group per base value; parameters and inputs own theirs.
    pub fn new(g: &Graph, live: &Live) -> Groups {
        let nv = g.values.len();
        let mut owner = vec![None; nv];
        for n in &g.nodes {
            if let Op::Param { .. } | Op::Input { .. } = n.op {
                owner[n.results[0].0 as usize] = Some(n.results[0].0);
            }
        }
        let versions = (0..nv as u32).map(|v| if live.base[v as usize] == v { vec![v] } else { vec![] }).collect();
        Groups { parent: (0..nv as u32).collect(), versions, owner, written_back: vec![false; nv] }
    }

    /// The group (root) of a base value.
    pub fn find(&mut self, mut v: u32) -> u32 {
        while self.parent[v as usize] != v {
            let p = self.parent[v as usize];
            self.parent[v as usize] = self.parent[p as usize];
            v = p;
        }
        v
    }

    /// The owner of `v`'s group.
    pub fn owner(&mut self, v: u32) -> Option<u32> {
        let r = self.find(v);
        self.owner[r as usize]
    }

    /// Marks `v`'s group as written back to its owner.
    pub fn set_written_back(&mut self, v: u32) {
        let r = self.find(v);
        self.written_back[r as usize] = true;
    }

    /// Whether `v`'s group is written back to its owner.
    pub fn written_back(&mut self, v: u32) -> bool {
        let r = self.find(v);
        self.written_back[r as usize]
    }

    /// The versions of `v`'s group, in definition order.
    pub fn versions(&mut self, v: u32) -> &[u32] {
        let r = self.find(v);
        &self.versions[r as usize]
    }

    /// Puts the groups of `a` and `b` into one buffer if their versions do not overlap.
    pub fn merge(&mut self, live: &Live, a: u32, b: u32) -> Result<(), Conflict> {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra == rb {
            return Ok(());
        }
        let (oa, ob) = (self.owner[ra as usize], self.owner[rb as usize]);
        if let (Some(x), Some(y)) = (oa, ob) {
            return Err(Conflict::TwoOwners(x, y));
        }
        let key = |v: &u32| (live.def[*v as usize], *v);
        let (va, vb) = (&self.versions[ra as usize], &self.versions[rb as usize]);
        let mut merged = Vec::with_capacity(va.len() + vb.len());
        let (mut i, mut j) = (0, 0);
        while i < va.len() || j < vb.len() {
            if j == vb.len() || (i < va.len() && key(&va[i]) < key(&vb[j])) {
                merged.push(va[i]);
                i += 1;
            } else {
                merged.push(vb[j]);
                j += 1;
            }
        }
        for w in merged.windows(2) {
            let (e, l) = (w[0] as usize, w[1] as usize);
            if live.vend[e] > live.def[l] || live.def[e] == live.def[l] {
                return Err(Conflict::Overlap { earlier: w[0], later: w[1] });
            }
        }
        self.parent[rb as usize] = ra;
        self.versions[ra as usize] = merged;
        self.versions[rb as usize] = vec![];
        self.owner[ra as usize] = oa.or(ob);
        self.written_back[ra as usize] |= self.written_back[rb as usize];
        Ok(())
    }
}

/// Which operands of `node` its results may overwrite in place.
pub(crate) struct InPlace {
    /// Per operand: the one result it flows into through elementwise ops only, so that element
    /// `i` of it is read only while element `i` of that result is computed (`None`: read in
    /// some other way, or into several results of a multi-phase kernel).
    pub only_into: Vec<Option<usize>>,
    /// Per result: the operand positions it may overwrite (same type), in operand order.
    pub candidates: Vec<Vec<usize>>,
}

/// The in-place options of `node`. Conservative: an elementwise op may overwrite any operand of
/// its result's shape. A `kernel` may overwrite operand `k` with result `r` of the same type when
/// everything downstream of `k` in its body is elementwise and `k` reaches `r`; if the body has
/// any other op than elementwise ops, broadcasts and sources (a kernel with phases, e.g. a
/// reduction and its epilogue), `k` must reach no other result.
pub(crate) fn in_place_options(node: &fusec_ir::Node, g: &Graph) -> InPlace {
    let (ni, nr) = (node.inputs.len(), node.results.len());
    let same_type = |k: usize, r: usize| g.ty(node.inputs[k]) == g.ty(node.results[r]);
    match &node.op {
        op if op.is_elementwise() => {
            let same_shape = |k: &usize| g.ty(node.inputs[*k]).shape == g.ty(node.results[0]).shape;
            InPlace { only_into: vec![Some(0); ni], candidates: vec![(0..ni).filter(same_shape).collect()] }
        }
        Op::Kernel(k) => {
            let body = &k.body;
            let single_phase = body.nodes.iter().all(|n| {
                n.op.is_elementwise() || matches!(n.op, Op::Input { .. } | Op::Const { .. } | Op::Iota { .. } | Op::Broadcast { .. })
            });
            let body_inputs = body.nodes.iter().filter(|n| matches!(n.op, Op::Input { .. })).map(|n| n.results[0].0 as usize);
            let mut only_into = vec![None; ni];
            let mut reaches: Vec<Vec<usize>> = vec![vec![]; ni];
            for (k, bv) in body_inputs.enumerate().take(ni) {
                let mut reach = vec![false; body.values.len()];
                reach[bv] = true;
                let mut elementwise = true;
                for n in &body.nodes {
                    if n.inputs.iter().any(|v| reach[v.0 as usize]) {
                        elementwise &= n.op.is_elementwise();
                        n.results.iter().for_each(|r| reach[r.0 as usize] = true);
                    }
                }
                let outs: Vec<usize> = (0..nr.min(body.outputs.len())).filter(|&j| reach[body.outputs[j].1 .0 as usize]).collect();
                if elementwise && (outs.len() == 1 || (single_phase && !outs.is_empty())) {
                    only_into[k] = (outs.len() == 1).then(|| outs[0]);
                    reaches[k] = outs;
                }
            }
            let candidates = (0..nr).map(|r| (0..ni).filter(|&k| reaches[k].contains(&r) && same_type(k, r)).collect()).collect();
            InPlace { only_into, candidates }
        }
        _ => InPlace { only_into: vec![None; ni], candidates: vec![vec![]; nr] },
    }
}
