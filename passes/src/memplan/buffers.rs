//! Liveness on the launch order and buffer groups: values that share one buffer over time.
//!
//! A *version* is a value that writes a buffer (every value but a `reshape` result), together
//! with its views; it lives from its definition to the last read of it or of any of its views. A
//! *group* is a set of versions placed in one buffer, ordered by definition; it is legal when
//! each version is dead before the next one is written, or is last read by the very node that
//! writes the next one (in place). A group may be *owned* by a parameter or input: it is then
//! that persistent tensor's buffer.

use std::collections::HashMap;

use fusec_ir::{Bindings, Graph, Op};
use smallvec::SmallVec;

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
        // An all-reduce written in place may run on a second stream beside the launches that
        // follow it, until a reader waits for it or the step ends: its results stay live to the
        // end of the step, read or not (under ZeRO-1 a rank reads none of the averages of the
        // gradients it does not own; reusing their buffers raced with NCCL). Its operands end
        // at it as usual, so that the results may take their buffers (in place); one that is
        // not in place runs on the step's stream.
        for node in g.nodes.iter().filter(|node| node.op == Op::AllReduce) {
            for v in &node.results {
                end[v.0 as usize] = n;
            }
        }
        let bytes = value_bytes(g, bind).map_err(|e| format!("memplan: {e}"))?;
        let base = view_bases(g);
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

/// The bytes of every value of `g` under `bind`, checked: each size, and the sum of all of
/// them rounded up to [`super::ALIGN`], must fit in 64 bits and in this host's `usize`. Every
/// offset and total a plan or a schedule computes is at most that sum, so once it fits, their
/// arithmetic cannot overflow.
pub(crate) fn value_bytes(g: &Graph, bind: &Bindings) -> Result<Vec<u64>, String> {
    let mut bytes = Vec::with_capacity(g.values.len());
    let mut total = 0u64;
    for info in &g.values {
        let b = info.ty.bytes(bind)? as u64;
        total = b.checked_next_multiple_of(super::ALIGN).and_then(|a| total.checked_add(a)).ok_or_else(|| {
            let binding: Vec<String> = bind.0.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            let under = if binding.is_empty() { String::new() } else { format!(" under {}", binding.join(", ")) };
            format!("the program's tensors total more than 2^64 bytes{under}")
        })?;
        bytes.push(b);
    }
    usize::try_from(total).map_err(|_| format!("the program's tensors total {total} bytes, more than this host can address"))?;
    Ok(bytes)
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
        let overlap = |e: u32, l: u32| live.vend[e as usize] > live.def[l as usize] || live.def[e as usize] == live.def[l as usize];
        let before = |x: &[u32], y: &[u32]| matches!((x.last(), y.first()), (Some(p), Some(q)) if key(p) < key(q));
        let (va, vb) = (&self.versions[ra as usize], &self.versions[rb as usize]);
        // Each group's own neighbours were checked when it was formed, so when one group's
        // versions all precede the other's only the junction is new: appending keeps a chain of
        // in-place writes linear instead of copying the whole group at every step.
        let (a_first, b_first) = (before(va, vb), before(vb, va));
        let merged = if a_first || b_first {
            let (first, second) = if a_first { (va, vb) } else { (vb, va) };
            let (e, l) = (first[first.len() - 1], second[0]);
            if overlap(e, l) {
                return Err(Conflict::Overlap { earlier: e, later: l });
            }
            let mut va = std::mem::take(&mut self.versions[ra as usize]);
            let mut vb = std::mem::take(&mut self.versions[rb as usize]);
            if a_first {
                va.append(&mut vb);
                va
            } else {
                vb.append(&mut va);
                vb
            }
        } else {
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
            if let Some(w) = merged.windows(2).find(|w| overlap(w[0], w[1])) {
                return Err(Conflict::Overlap { earlier: w[0], later: w[1] });
            }
            merged
        };
        self.parent[rb as usize] = ra;
        self.versions[ra as usize] = merged;
        self.versions[rb as usize] = vec![];
        self.owner[ra as usize] = oa.or(ob);
        self.written_back[ra as usize] |= self.written_back[rb as usize];
        Ok(())
    }
}

/// How a node reads its operands, for deciding what it may overwrite while it runs.
///
/// Contract with the backends: a single-phase node (elementwise ops, `adamw`, a kernel of only
/// those, broadcasts and sources) loads every operand element `i` before it stores element `i` of
/// any result; a multi-phase kernel may run its body in several passes.
pub(crate) struct InPlace {
    /// Per operand: the results it flows into through pointwise ops only (element `i` read only
    /// to compute element `i`), or `None` if it is read any other way.
    pub reach: Vec<Option<SmallVec<[usize; 2]>>>,
    /// Whether the node computes all its results in one pass over the elements.
    pub single_phase: bool,
    /// Per result: the operand positions it may overwrite (same shape), in operand order.
    pub candidates: Vec<Vec<usize>>,
}

impl InPlace {
    /// Whether result `r` may be stored over operand `k`'s buffer while the node reads `k`.
    pub fn safe_while_writing(&self, k: usize, r: usize) -> bool {
        match &self.reach[k] {
            Some(rs) => self.single_phase || rs.iter().all(|&x| x == r),
            None => false,
        }
    }
}

/// Elementwise ops and `adamw`: element `i` of every result from element `i` of the operands.
fn is_pointwise(op: &Op) -> bool {
    op.is_elementwise() || matches!(op, Op::AdamW { .. })
}

/// A `cross_entropy_grad` (or `cross_entropy_with_grad`) reached only through its logits:
/// backends read a whole row of logits (its maximum and sum; the loss needs nothing more) before
/// writing that row's gradient, and then write element `i` right after reading it, so the
/// gradient may overwrite the logits (llm.c's fused classifier does).
fn reads_row_before_writing(n: &fusec_ir::Node, reach: &[bool]) -> bool {
    matches!(n.op, Op::CrossEntropyGrad { .. } | Op::CrossEntropyWithGrad { .. }) && n.inputs.iter().skip(1).all(|v| !reach[v.0 as usize])
}

/// The in-place options of `node`; see [`InPlace`]. Conservative: an elementwise op may overwrite
/// any operand of its result's shape; `adamw` its `p`, `m` and `v`; a kernel may overwrite operand
/// `k` with result `r` of the same shape when everything downstream of `k` in its body is pointwise
/// (or a `cross_entropy_grad` of its logits) and reaches `r` (and, in a multi-phase kernel,
/// nothing else).
pub(crate) fn in_place_options(node: &fusec_ir::Node, g: &Graph) -> InPlace {
    let (ni, nr) = (node.inputs.len(), node.results.len());
    // Same element count; `memplan` also requires the same byte size (an i32 mask may become f32).
    let same_shape = |k: usize, r: usize| g.ty(node.inputs[k]).shape == g.ty(node.results[r]).shape;
    let shape0 = node.results.first().map(|r| &g.ty(*r).shape);
    let all = || -> SmallVec<[usize; 2]> { (0..nr).collect() };
    let mut o = InPlace { reach: vec![None; ni], single_phase: false, candidates: vec![vec![]; nr] };
    match &node.op {
        op if is_pointwise(op) => {
            o.single_phase = true;
            for k in 0..ni {
                if Some(&g.ty(node.inputs[k]).shape) == shape0 {
                    o.reach[k] = Some(all());
                }
            }
            let pairs: Vec<(usize, usize)> =
                if let Op::AdamW { .. } = op { vec![(0, 0), (1, 2), (2, 3), (3, 7)] } else { (0..ni).map(|k| (0, k)).collect() };
            for (r, k) in pairs {
                if k < ni && r < nr && o.reach[k].is_some() && same_shape(k, r) {
                    o.candidates[r].push(k);
                }
            }
        }
        Op::Gemm(gm) if gm.accumulate && ni > 0 => o.reach[ni - 1] = Some(SmallVec::from_slice(&[0])),
        // A collective reads all of one operand and writes its result: result `k` may overwrite
        // operand `k` (NCCL in place), never another operand (not single-phase).
        Op::AllReduce | Op::FromOwners { .. } => {
            for k in 0..ni.min(nr) {
                o.reach[k] = Some(SmallVec::from_slice(&[k]));
                if same_shape(k, k) {
                    o.candidates[k].push(k);
                }
            }
        }
        Op::Kernel(kernel) => {
            let body = &kernel.body;
            o.single_phase = body.nodes.iter().all(|n| {
                is_pointwise(&n.op) || matches!(n.op, Op::Input { .. } | Op::Const { .. } | Op::Iota { .. } | Op::Broadcast { .. })
            });
            let body_inputs = body.nodes.iter().filter(|n| matches!(n.op, Op::Input { .. })).map(|n| n.results[0].0 as usize);
            for (k, bv) in body_inputs.enumerate().take(ni) {
                let mut reach = vec![false; body.values.len()];
                reach[bv] = true;
                let mut pointwise = true;
                for n in &body.nodes {
                    if n.inputs.iter().any(|v| reach[v.0 as usize]) {
                        pointwise &= is_pointwise(&n.op) || reads_row_before_writing(n, &reach);
                        // The fused classifier's loss is complete before its gradient is
                        // written: only the gradient counts as written from the logits.
                        let skip = usize::from(matches!(n.op, Op::CrossEntropyWithGrad { .. }));
                        n.results.iter().skip(skip).for_each(|r| reach[r.0 as usize] = true);
                    }
                }
                if pointwise {
                    let outs = (0..nr.min(body.outputs.len())).filter(|&j| reach[body.outputs[j].1 .0 as usize]).collect();
                    o.reach[k] = Some(outs);
                }
            }
            for k in 0..ni {
                let rs = o.reach[k].clone().unwrap_or_default();
                for r in rs {
                    if same_shape(k, r) && o.safe_while_writing(k, r) {
                        o.candidates[r].push(k);
                    }
                }
            }
        }
        _ => {}
    }
    o
}

/// The value whose buffer `v` shares by view (following `reshape` operands).
pub(crate) fn view_bases(g: &Graph) -> Vec<u32> {
    let mut base: Vec<u32> = (0..g.values.len() as u32).collect();
    for n in &g.nodes {
        if matches!(n.op, Op::Reshape { .. }) {
            base[n.results[0].0 as usize] = base[n.inputs[0].0 as usize];
        }
    }
    base
}

/// Write-after-read constraints `(reader, writer)`: every node reading the old value of state
/// (or of an accumulating `gemm`'s accumulator, or a view of it) runs before the writer.
pub(crate) fn war_edges(g: &Graph, base: &[u32]) -> Vec<(usize, usize)> {
    let producer = |v: u32| g.values[v as usize].node.0 as usize;
    let names: HashMap<&str, u32> = g
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Param { name, .. } | Op::Input { name, .. } => Some((name.as_str(), n.results[0].0)),
            _ => None,
        })
        .collect();
    // (old base, writer node)
    let mut writes: Vec<(u32, usize)> = vec![];
    for (name, v) in &g.outputs {
        if let Some(&x) = names.get(name.as_str()) {
            let b = base[v.0 as usize];
            if b != x && !g.nodes[producer(b)].op.is_source() {
                writes.push((x, producer(b)));
            }
        }
    }
    for (i, n) in g.nodes.iter().enumerate() {
        if let Op::Gemm(gm) = &n.op {
            if let (true, Some(acc)) = (gm.accumulate, n.inputs.last()) {
                writes.push((base[acc.0 as usize], i));
            }
        }
    }
    if writes.is_empty() {
        return vec![];
    }
    let mut written = vec![false; g.values.len()];
    for &(b, _) in &writes {
        written[b as usize] = true;
    }
    let mut readers: Vec<Vec<usize>> = vec![vec![]; g.values.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        for v in &n.inputs {
            let b = base[v.0 as usize] as usize;
            if written[b] && readers[b].last() != Some(&i) {
                readers[b].push(i);
            }
        }
    }
    let mut edges: Vec<(usize, usize)> =
        writes.iter().flat_map(|&(b, w)| readers[b as usize].iter().filter(move |&&r| r != w).map(move |&r| (r, w))).collect();
    edges.sort_unstable();
    edges.dedup();
    edges
}
