//! `schedule`: reorders the nodes into the launch order, keeping peak live transient memory low.
//!
//! The result is the same graph (same nodes, same outputs) in a new topological order; values are
//! renumbered because the printer numbers them by position. The order is chosen as follows.
//!
//! - `param` and `input` nodes come first, in their original order: they are the interface.
//! - A *lazy* node (`const`, `iota`, and any node computed only from parameters, inputs and lazy
//!   nodes, e.g. a bias broadcast or the token gather) is emitted right before its first user,
//!   never on its own: running it earlier only lengthens its result's life.
//! - Every other node is list-scheduled: among the ready nodes, take the one that maximizes
//!   `bytes freed - bytes allocated` (its operands' buffers that it reads last, minus its new
//!   results and the lazy nodes it pulls in); ties go to the earlier original node.
//! - A kernel that only sums an `attention_grad` result's columns (the qkv bias gradient) comes
//!   right after it, where a target can fold the sums into the backward (`schedule_colsum`).
//! - Writes over state are ordered after every read of the old value: a graph output named like a
//!   parameter or input (written back in place by `memplan`) is produced only after every other
//!   reader of that parameter, and so is a `gemm` that accumulates in place over its last operand.
//!
//! Memory model (shared with [`peak_bytes`]; it mirrors `memplan`'s lower bound): a `reshape`
//! result aliases its operand, an accumulating `gemm` writes over its accumulator, parameters,
//! inputs, state outputs and elementwise accumulations into a `grad.P` input are persistent (not
//! counted); every other result is allocated when its node runs and freed after the last node that
//! reads it or a view of it (graph outputs are never freed), and a result that an elementwise op
//! may write over an operand read for the last time adds nothing at that step.
//!
//! Never worse than the input order: three kinds of order are compared under this model, the
//! input order (sources hoisted), the input order with lazy nodes moved to their first user, and
//! the memory-greedy order; a later one is taken only if its peak is no higher under every probe
//! binding (the greedy one: and strictly lower under one). [`schedule`] probes every symbolic dim
//! at 64 ([`default_bindings`]: activations weigh most) and at 1 (parameter-sized tensors weigh
//! most); [`schedule_with`] uses the one binding it is given (use it when the sizes are known).
//! Deterministic: no hash-order iteration anywhere.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use fusec_ir::{Bindings, Graph, Op, ValueId};
use smallvec::SmallVec;

use crate::memplan::buffers::{in_place_options, view_bases, war_edges};
use crate::schedule_overlap as overlap;

/// The value every symbolic dim takes in [`default_bindings`].
pub const DEFAULT_DIM: u64 = 64;

/// Binds every symbolic dim declared by `g` to [`DEFAULT_DIM`].
pub fn default_bindings(g: &Graph) -> Bindings {
    bind_all(g, DEFAULT_DIM)
}

fn bind_all(g: &Graph, value: u64) -> Bindings {
    let mut b = Bindings::default();
    for s in &g.syms {
        b.set(s, value);
    }
    b
}

/// Reorders `g` into a low-memory launch order for unknown sizes: candidates are judged under
/// [`default_bindings`] and under every symbolic dim = 1 (where parameter-sized tensors weigh
/// most), and one is taken only if it is no worse under both.
pub fn schedule(g: &Graph) -> Result<Graph, String> {
    let mut probes = vec![default_bindings(g)];
    if !g.syms.is_empty() {
        probes.push(bind_all(g, 1));
    }
    schedule_for(g, &probes)
}

/// [`schedule`] for known sizes: tensors are sized under `bind` (every symbolic dim bound).
pub fn schedule_with(g: &Graph, bind: &Bindings) -> Result<Graph, String> {
    schedule_for(g, std::slice::from_ref(bind))
}

/// Picks among the input order (sources hoisted), the input order with lazy nodes moved to their
/// first user, and the memory-greedy order under each probe binding: a later one replaces the
/// current choice when it is no worse under every probe (and, for the greedy orders, strictly
/// better under one), or when the current choice violates a state-ordering constraint.
fn schedule_for(g: &Graph, probes: &[Bindings]) -> Result<Graph, String> {
    let models = probes.iter().map(|b| Model::new(g, b)).collect::<Result<Vec<_>, _>>()?;
    let peaks = |o: &[usize]| models.iter().map(|m| m.peak(o)).collect::<Vec<u64>>();
    let m0 = &models[0];
    let mut best = m0.baseline_order();
    let mut best_peaks = peaks(&best);
    let mut consider = |cand: Option<Vec<usize>>, need_better: bool| {
        // `None`: the state-ordering constraints form a cycle; `memplan` will say why.
        let Some(cand) = cand else { return };
        let p = peaks(&cand);
        let no_worse = p.iter().zip(&best_peaks).all(|(a, b)| a <= b);
        let better = p.iter().zip(&best_peaks).any(|(a, b)| a < b);
        if !m0.respects_war(&best) || (no_worse && (better || !need_better)) {
            best = cand;
            best_peaks = p;
        }
    };
    consider(m0.list_order(false), false);
    for m in &models {
        consider(m.list_order(true), true);
    }
    // A data-parallel step: each bucket's gradients early, its all-reduce right after them.
    if g.nodes.iter().any(|n| n.op == Op::AllReduce) {
        let early = overlap::gradients_early(g, &best);
        if m0.respects_war(&early) {
            best = early;
        }
    }
    // The qkv bias gradient right after the attention backward (`schedule_colsum`).
    let sums = crate::schedule_colsum::after_attention(g, &best);
    if m0.respects_war(&sums) {
        best = sums;
    }
    Ok(reorder(g, &overlap::collectives_early(g, &best)))
}

/// The peak live transient bytes of `g`'s own node order under the module's memory model.
pub fn peak_bytes(g: &Graph, bind: &Bindings) -> Result<u64, String> {
    let m = Model::new(g, bind)?;
    let order: Vec<usize> = (0..g.nodes.len()).collect();
    Ok(m.peak(&order))
}

/// A copy of `g` with its nodes in `order` (a permutation of node indices that is topological),
/// values renumbered in the new order.
pub fn reorder(g: &Graph, order: &[usize]) -> Graph {
    let mut out = Graph { name: g.name.clone(), syms: g.syms.clone(), ..Graph::default() };
    let mut map = vec![ValueId(u32::MAX); g.values.len()];
    for &ni in order {
        let n = &g.nodes[ni];
        let ins: Vec<ValueId> = n.inputs.iter().map(|v| map[v.0 as usize]).collect();
        let tys = n.results.iter().map(|r| g.ty(*r).clone()).collect();
        let rs = out.push_unchecked(n.op.clone(), &ins, tys);
        for (old, new) in n.results.iter().zip(rs) {
            map[old.0 as usize] = new;
        }
    }
    out.outputs = g.outputs.iter().map(|(n, v)| (n.clone(), map[v.0 as usize])).collect();
    out
}

/// A result and the operands it may overwrite.
type InPlacePair = (u32, SmallVec<[u32; 4]>);

/// The scheduler's view of the graph: buffers, their sizes and their readers.
struct Model<'g> {
    g: &'g Graph,
    /// Per value: the value that owns its buffer (views and accumulators share one).
    root: Vec<u32>,
    /// Per value: it is a new transient buffer (its own root, not persistent).
    new_buf: Vec<bool>,
    /// Per value: bytes under the binding.
    bytes: Vec<u64>,
    /// Per root: never freed (persistent, or held by a graph output).
    keep: Vec<bool>,
    /// Per root: distinct nodes reading it (through any alias), in node order.
    users: Vec<Vec<u32>>,
    /// Per node: distinct roots of its operands.
    node_roots: Vec<SmallVec<[u32; 4]>>,
    /// Per node: results that may be written in place over one of these operands.
    inplace: Vec<SmallVec<[InPlacePair; 1]>>,
    /// Write-after-read constraints `(reader, writer)`.
    war: Vec<(usize, usize)>,
}

impl<'g> Model<'g> {
    fn new(g: &'g Graph, bind: &Bindings) -> Result<Model<'g>, String> {
        let nv = g.values.len();
        let bytes = crate::memplan::buffers::value_bytes(g, bind).map_err(|e| format!("schedule: {e}"))?;
        let mut is_output = vec![false; nv];
        for (_, v) in &g.outputs {
            is_output[v.0 as usize] = true;
        }
        let mut readers = vec![0u32; nv];
        for n in &g.nodes {
            for (k, v) in n.inputs.iter().enumerate() {
                if !n.inputs[..k].contains(v) {
                    readers[v.0 as usize] += 1;
                }
            }
        }
        let mut names: HashMap<&str, bool> = HashMap::new();
        for n in &g.nodes {
            match &n.op {
                Op::Param { name, .. } => names.insert(name.as_str(), true),
                Op::Input { name, .. } => names.insert(name.as_str(), false),
                _ => None,
            };
        }
        // Gradient accumulators: `memplan` accumulates into them in place.
        let is_acc = |n: &fusec_ir::Node| match &n.op {
            Op::Input { name, .. } => name.strip_prefix("grad.").is_some_and(|p| names.get(p) == Some(&true)),
            _ => false,
        };
        let mut root: Vec<u32> = (0..nv as u32).collect();
        let mut persistent = vec![false; nv];
        let mut acc = vec![false; nv];
        let mut inplace = vec![SmallVec::new(); g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            let r0 = n.results.first().map_or(0, |r| r.0 as usize);
            match &n.op {
                Op::Reshape { .. } => root[r0] = root[n.inputs[0].0 as usize],
                Op::Gemm(gm) if gm.accumulate => {
                    if let Some(a) = n.inputs.last() {
                        root[r0] = root[a.0 as usize];
                    }
                }
                Op::Param { .. } | Op::Input { .. } => {
                    persistent[r0] = true;
                    acc[r0] = is_acc(n);
                }
                _ => {
                    let opts = in_place_options(n, g);
                    for (ri, cands) in opts.candidates.iter().enumerate() {
                        let r = n.results[ri].0 as usize;
                        let into_acc = cands
                            .iter()
                            .map(|&k| n.inputs[k].0 as usize)
                            .find(|&o| acc[root[o] as usize] && readers[o] == 1 && !is_output[o] && bytes[o] == bytes[r]);
                        match into_acc {
                            Some(o) => root[r] = root[o],
                            None if !cands.is_empty() => inplace[i].push((r as u32, cands.iter().map(|&k| n.inputs[k].0).collect())),
                            None => {}
                        }
                    }
                }
            }
        }
        let mut keep = vec![false; nv];
        for (name, v) in &g.outputs {
            let r = root[v.0 as usize] as usize;
            keep[r] = true;
            if names.contains_key(name.as_str()) {
                persistent[r] = true;
            }
        }
        let mut new_buf = vec![false; nv];
        for v in 0..nv {
            new_buf[v] = root[v] as usize == v && !persistent[v];
            keep[v] |= persistent[v];
        }
        let mut users: Vec<Vec<u32>> = vec![vec![]; nv];
        let mut node_roots = Vec::with_capacity(g.nodes.len());
        for (i, n) in g.nodes.iter().enumerate() {
            let mut rs: SmallVec<[u32; 4]> = SmallVec::new();
            for v in &n.inputs {
                let r = root[v.0 as usize];
                if !rs.contains(&r) {
                    rs.push(r);
                    users[r as usize].push(i as u32);
                }
            }
            node_roots.push(rs);
        }
        let war = war_edges(g, &view_bases(g));
        Ok(Model { g, root, new_buf, bytes, keep, users, node_roots, inplace, war })
    }

    /// The input order with parameters and inputs hoisted to the front.
    fn baseline_order(&self) -> Vec<usize> {
        let n = self.g.nodes.len();
        let is_iface = |i: &usize| matches!(self.g.nodes[*i].op, Op::Param { .. } | Op::Input { .. });
        let mut order: Vec<usize> = (0..n).filter(is_iface).collect();
        order.extend((0..n).filter(|i| !is_iface(i)));
        order
    }

    fn respects_war(&self, order: &[usize]) -> bool {
        let mut pos = vec![0usize; self.g.nodes.len()];
        for (p, &n) in order.iter().enumerate() {
            pos[n] = p;
        }
        self.war.iter().all(|&(r, w)| pos[r] < pos[w])
    }

    /// Peak live transient bytes of a complete order.
    fn peak(&self, order: &[usize]) -> u64 {
        let mut remaining: Vec<u32> = self.users.iter().map(|u| u.len() as u32).collect();
        let (mut live, mut peak) = (0u64, 0u64);
        let mut taken: SmallVec<[u32; 4]> = SmallVec::new();
        for &ni in order {
            let n = &self.g.nodes[ni];
            for r in &n.results {
                if self.new_buf[r.0 as usize] {
                    live += self.bytes[r.0 as usize];
                }
            }
            // A result written over an operand read for the last time adds nothing at the peak.
            let mut reused = 0;
            taken.clear();
            for (r, cands) in &self.inplace[ni] {
                let r = *r as usize;
                let fits = |o: &&u32| {
                    let o = self.root[**o as usize];
                    let ok = self.new_buf[o as usize] && !self.keep[o as usize] && remaining[o as usize] == 1;
                    ok && self.bytes[o as usize] == self.bytes[r] && !taken.contains(&o)
                };
                if let Some(o) = cands.iter().find(fits).filter(|_| self.new_buf[r]) {
                    taken.push(self.root[*o as usize]);
                    reused += self.bytes[r];
                }
            }
            peak = peak.max(live - reused);
            for &r in &self.node_roots[ni] {
                remaining[r as usize] -= 1;
                if remaining[r as usize] == 0 && !self.keep[r as usize] {
                    live -= self.bytes[r as usize];
                }
            }
            for r in &n.results {
                let r = r.0 as usize;
                if self.new_buf[r] && self.users[r].is_empty() && !self.keep[r] {
                    live -= self.bytes[r];
                }
            }
        }
        peak
    }

    /// The list-scheduled order (by memory if `by_memory`, else by input position), or `None`
    /// when the constraints have a cycle.
    fn list_order(&self, by_memory: bool) -> Option<Vec<usize>> {
        let g = self.g;
        let nn = g.nodes.len();
        let producer = |v: &ValueId| g.values[v.0 as usize].node.0 as usize;
        let is_iface = |i: usize| matches!(g.nodes[i].op, Op::Param { .. } | Op::Input { .. });
        let mut war_target = vec![false; nn];
        let mut war_preds: Vec<Vec<usize>> = vec![vec![]; nn];
        for &(r, w) in &self.war {
            war_target[w] = true;
            war_preds[w].push(r);
        }
        let mut has_user = vec![false; nn];
        for n in &g.nodes {
            for v in &n.inputs {
                has_user[producer(v)] = true;
            }
        }
        // Lazy nodes, in input (topological) order.
        let mut lazy = vec![false; nn];
        for (i, n) in g.nodes.iter().enumerate() {
            lazy[i] = !is_iface(i)
                && has_user[i]
                && !war_target[i]
                && n.inputs.iter().all(|v| {
                    let p = producer(v);
                    is_iface(p) || lazy[p]
                });
        }
        // Predecessors: regular ones gate readiness, lazy ones are emitted on demand.
        let mut deps = vec![0u32; nn];
        let mut succs: Vec<Vec<u32>> = vec![vec![]; nn];
        let mut lazy_preds: Vec<SmallVec<[u32; 4]>> = vec![SmallVec::new(); nn];
        for i in 0..nn {
            let preds = g.nodes[i].inputs.iter().map(producer).chain(war_preds[i].iter().copied());
            let mut seen: SmallVec<[usize; 8]> = SmallVec::new();
            for p in preds {
                if seen.contains(&p) || is_iface(p) {
                    continue;
                }
                seen.push(p);
                if lazy[p] {
                    lazy_preds[i].push(p as u32);
                } else {
                    deps[i] += 1;
                    succs[p].push(i as u32);
                }
            }
        }
        let mut st = ListState {
            m: self,
            by_memory,
            lazy: &lazy,
            lazy_preds: &lazy_preds,
            // Only regular users are ever requeued; a root may have as many lazy users as the
            // graph has nodes (a chain of reshapes of one input).
            regular_users: self.users.iter().map(|us| us.iter().copied().filter(|&u| !lazy[u as usize]).collect()).collect(),
            emitting: None,
            remaining: self.users.iter().map(|u| u.len() as u32).collect(),
            done: vec![false; nn],
            deps,
            version: vec![0; nn],
            heap: BinaryHeap::new(),
            order: Vec::with_capacity(nn),
            stamp: vec![0; nn],
            epoch: 0,
        };
        for i in (0..nn).filter(|&i| is_iface(i)) {
            st.emit_one(i);
        }
        for (i, &lz) in lazy.iter().enumerate() {
            if !lz && !st.done[i] && st.deps[i] == 0 {
                st.refresh(i);
            }
        }
        while let Some((_, Reverse(i), ver)) = st.heap.pop() {
            let i = i as usize;
            if st.done[i] || ver != st.version[i] {
                continue;
            }
            st.emit_with_lazy(i);
            for &s in &succs[i] {
                let s = s as usize;
                st.deps[s] -= 1;
                if st.deps[s] == 0 {
                    st.refresh(s);
                }
            }
        }
        // Lazy nodes are emitted by their users; any left (none in a well-formed graph) go last.
        for (i, &lz) in lazy.iter().enumerate() {
            if lz && !st.done[i] {
                st.emit_with_lazy(i);
            }
        }
        (st.order.len() == nn).then_some(st.order)
    }
}

/// Mutable state of the list scheduler.
struct ListState<'a, 'g> {
    m: &'a Model<'g>,
    /// Priority by memory; otherwise every node ties and input order decides.
    by_memory: bool,
    lazy: &'a [bool],
    lazy_preds: &'a [SmallVec<[u32; 4]>],
    /// Per root: distinct reader nodes not yet emitted.
    remaining: Vec<u32>,
    done: Vec<bool>,
    deps: Vec<u32>,
    /// Per node: bumped on every priority change; stale heap entries are skipped.
    version: Vec<u32>,
    heap: BinaryHeap<(i64, Reverse<u32>, u32)>,
    order: Vec<usize>,
    /// Visit marks for the lazy closure walk.
    stamp: Vec<u32>,
    epoch: u32,
    /// Per root: its users that are not lazy.
    regular_users: Vec<Vec<u32>>,
    /// The node whose lazy predecessors are being emitted (it runs next, so requeueing it in
    /// the meantime would only push a heap entry that is skipped).
    emitting: Option<usize>,
}

impl ListState<'_, '_> {
    /// Recomputes the priority of a ready regular node and queues it.
    fn refresh(&mut self, i: usize) {
        let p = self.priority(i);
        self.version[i] += 1;
        self.heap.push((p, Reverse(i as u32), self.version[i]));
    }

    /// `bytes freed - bytes allocated` if `i` (with its pending lazy predecessors) ran now.
    fn priority(&mut self, i: usize) -> i64 {
        if !self.by_memory {
            return 0;
        }
        let m = self.m;
        let mut alloc = self.new_bytes(i);
        self.epoch += 1;
        let mut stack: Vec<u32> = self.lazy_preds[i].to_vec();
        while let Some(p) = stack.pop() {
            let p = p as usize;
            if self.done[p] || self.stamp[p] == self.epoch {
                continue;
            }
            self.stamp[p] = self.epoch;
            alloc += self.new_bytes(p);
            stack.extend(self.lazy_preds[p].iter().copied());
        }
        let freed: u64 =
            m.node_roots[i].iter().filter(|&&r| !m.keep[r as usize] && self.remaining[r as usize] == 1).map(|&r| m.bytes[r as usize]).sum();
        freed as i64 - alloc as i64
    }

    /// Bytes of the new transient results of node `i` that outlive it.
    fn new_bytes(&self, i: usize) -> u64 {
        let m = self.m;
        m.g.nodes[i]
            .results
            .iter()
            .map(|r| r.0 as usize)
            .filter(|&r| m.new_buf[r] && (!m.users[r].is_empty() || m.keep[r]))
            .map(|r| m.bytes[r])
            .sum()
    }

    /// Emits the pending lazy predecessors of `i` (depth first, in operand order), then `i`.
    /// Iterative: a chain of lazy nodes may be as long as the graph.
    fn emit_with_lazy(&mut self, i: usize) {
        // (node, how many of its lazy predecessors were visited)
        let mut stack: Vec<(usize, usize)> = vec![(i, 0)];
        self.emitting = Some(i);
        while let Some(top) = stack.last_mut() {
            let (n, k) = *top;
            if let Some(&p) = self.lazy_preds[n].get(k) {
                top.1 += 1;
                if !self.done[p as usize] {
                    stack.push((p as usize, 0));
                }
            } else {
                stack.pop();
                self.emit_one(n);
            }
        }
        self.emitting = None;
    }

    /// Appends node `i` and updates the readers' counts and affected priorities.
    fn emit_one(&mut self, i: usize) {
        let m = self.m;
        self.done[i] = true;
        self.order.push(i);
        for &r in &m.node_roots[i] {
            let r = r as usize;
            self.remaining[r] -= 1;
            if self.remaining[r] == 1 && !m.keep[r] {
                // The one reader left now frees this buffer: it gains priority.
                if let Some(&u) = m.users[r].iter().find(|&&u| !self.done[u as usize]) {
                    self.requeue(u as usize);
                }
            }
        }
        if self.lazy[i] {
            // Its users no longer pay for it.
            for r in &m.g.nodes[i].results {
                let root = m.root[r.0 as usize] as usize;
                for k in 0..self.regular_users[root].len() {
                    self.requeue(self.regular_users[root][k] as usize);
                }
            }
        }
    }

    /// Refreshes `u`'s priority if it is queued (a ready, regular, pending node).
    fn requeue(&mut self, u: usize) {
        if self.emitting != Some(u) && !self.done[u] && !self.lazy[u] && self.deps[u] == 0 && self.version[u] > 0 {
            self.refresh(u);
        }
    }
}
