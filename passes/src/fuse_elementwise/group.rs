//! The greedy grouping: which nodes go into which kernel (see the parent module's docs).

use fusec_ir::{Op, Shape, ValueId};

mod cycle;

use super::{Class, Ctx, Read, MAX_READS, MAX_RESULTS, PASS};
use crate::explain::FusionLog;

/// "No group" in [`Grouping::group_of`].
pub(super) const NONE: u32 = u32::MAX;

/// What a group is built around.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Core {
    /// Nothing: a pointwise group.
    None,
    /// Reductions of operands of shape `input` over `axes`.
    Reduce { input: Box<Shape>, axes: Vec<usize> },
    /// The composite node with this index.
    Composite(u32),
    /// The multi-tensor AdamW kernel.
    AdamW,
}

/// One group of nodes that becomes one kernel.
#[derive(Clone, Debug)]
pub(super) struct Group {
    /// Member nodes (unordered; empty once merged into another group).
    pub members: Vec<u32>,
    /// The form.
    pub core: Core,
    /// The shape of the ops before the core (pointwise and reduction groups).
    pub domain: Option<Shape>,
    /// Distinct values read from outside, sorted (not kept for the AdamW group).
    pub reads: Vec<ValueId>,
    /// The first outside node that read a result, and the value it read: the group is closed.
    pub closed_by: Option<(u32, ValueId)>,
    /// The position of the last member.
    pub maxpos: u32,
    /// How many results its members have (a bound on the kernel's results).
    pub nresults: usize,
}

/// The outcome: groups and the group of every node.
pub(super) struct Grouping {
    /// Every group ever made; merged-away ones have no members.
    pub groups: Vec<Group>,
    /// Per node: its group, or [`NONE`].
    pub group_of: Vec<u32>,
}

/// Why a candidate merge is refused: the rule's name and what did not hold.
type Refusal = (&'static str, String);

/// A legal merge, ready to apply.
struct Merged {
    core: Core,
    domain: Option<Shape>,
    reads: Vec<ValueId>,
    /// Whether the new node comes after the core (in the epilogue).
    post: bool,
    /// Pointwise groups that join the epilogue.
    to_post: Vec<u32>,
}

/// Groups `cx.g`'s live nodes; refusals go to `log`.
pub(super) fn group(cx: &Ctx, log: &mut FusionLog) -> Grouping {
    let n = cx.g.nodes.len();
    let mut st = State {
        cx,
        groups: Vec::new(),
        group_of: vec![NONE; n],
        post: vec![false; n],
        adamw_open: None,
        logged_fixed: vec![false; n],
        readers: vec![Vec::new(); cx.g.values.len()],
        parent: Vec::new(),
        log,
    };
    for i in 0..n {
        if !cx.live[i] {
            continue;
        }
        match cx.class[i] {
            Class::Absorb => {}
            Class::Fixed => {
                for r in cx.reads(i) {
                    st.close_producer(r.root, i);
                }
            }
            Class::AdamW => st.join_adamw(i),
            Class::Pointwise | Class::Reduce | Class::Composite => st.join(i),
        }
    }
    Grouping { groups: st.groups, group_of: st.group_of }
}

struct State<'a, 'g> {
    cx: &'a Ctx<'g>,
    groups: Vec<Group>,
    group_of: Vec<u32>,
    /// Per node: whether it is a core or depends on its group's core (epilogue).
    post: Vec<bool>,
    /// The AdamW group that later updates may still join.
    adamw_open: Option<u32>,
    /// Per node: whether a `not-fusible` refusal was recorded for it already.
    logged_fixed: Vec<bool>,
    /// Per value: the groups that read it from outside, latest last (ids may be stale: see
    /// `parent`).
    readers: Vec<Vec<u32>>,
    /// Per group: the group it was merged into (itself while it lives).
    parent: Vec<u32>,
    log: &'a mut FusionLog,
}

impl State<'_, '_> {
    fn gof(&self, v: ValueId) -> u32 {
        self.group_of[self.cx.prod(v)]
    }

    /// Marks the group producing `v` (if any) as read from outside by node `reader`.
    fn close_producer(&mut self, v: ValueId, reader: usize) {
        let gid = self.gof(v);
        if gid != NONE && self.group_of[reader] != gid {
            let g = &mut self.groups[gid as usize];
            if g.closed_by.is_none() {
                g.closed_by = Some((reader as u32, v));
            }
        }
    }

    /// Records `not-fusible` for values of never-fused ops that `n` reads (once per such op).
    fn log_fixed_producers(&mut self, n: usize, reads: &[Read]) {
        let cx = self.cx;
        for r in reads {
            let p = cx.prod(r.root);
            let op = &cx.g.nodes[p].op;
            if cx.class[p] == Class::Fixed && !matches!(op, Op::Param { .. } | Op::Input { .. }) && !self.logged_fixed[p] {
                self.logged_fixed[p] = true;
                let detail = format!("`{}` is never fused: {} reads it as a kernel operand", op.mnemonic(), cx.node_name(n));
                self.log.refuse(PASS, cx.at(r.root), "not-fusible", detail);
            }
        }
    }

    /// Visits a pointwise, reduce or composite node: joins what it legally can, in operand order.
    fn join(&mut self, n: usize) {
        let cx = self.cx;
        let reads = cx.reads(n);
        self.log_fixed_producers(n, &reads);
        let mut cands: Vec<(u32, ValueId)> = Vec::new();
        for r in &reads {
            let gid = self.gof(r.root);
            if gid != NONE && !cands.iter().any(|c| c.0 == gid) {
                cands.push((gid, r.root));
            }
        }
        let mut acc: Vec<u32> = Vec::new();
        let mut merged = None;
        for (gid, v) in cands {
            acc.push(gid);
            match self.check(&acc, n, &reads) {
                Ok(m) => merged = Some(m),
                Err((rule, detail)) => {
                    acc.pop();
                    self.log.refuse(PASS, cx.at(v), rule, detail);
                }
            }
        }
        if merged.is_none() {
            if let Some((gid, m)) = self.sibling(n, &reads) {
                acc.push(gid);
                merged = Some(m);
            }
        }
        let m = match merged {
            Some(m) => m,
            None => self.check(&[], n, &reads).unwrap_or_else(|_| self.alone(n, &reads)),
        };
        for &gid in &m.to_post {
            for &x in &self.groups[gid as usize].members {
                self.post[x as usize] = true;
            }
        }
        let gid = self.merge(&acc, n, m.core, m.domain, m.reads);
        self.post[n] = m.post;
        self.after_join(n, gid, &reads);
    }

    /// Closes the groups `n` reads from and records `n`'s group as a reader of its operands.
    fn after_join(&mut self, n: usize, gid: u32, reads: &[Read]) {
        for r in reads {
            self.close_producer(r.root, n);
            if self.gof(r.root) != gid {
                let rd = &mut self.readers[r.root.0 as usize];
                if rd.last() != Some(&gid) {
                    rd.push(gid);
                }
            }
        }
    }

    /// The live group that `gid` was merged into.
    fn find(&self, mut gid: u32) -> u32 {
        while self.parent[gid as usize] != gid {
            gid = self.parent[gid as usize];
        }
        gid
    }

    /// Horizontal fusion, for a node that joined no producer's group: the first open group among
    /// the latest few that read one of the same operands and that `n` may join (the operand is
    /// then read once). Not logged: these are opportunities, not producer-consumer candidates.
    fn sibling(&self, n: usize, reads: &[Read]) -> Option<(u32, Merged)> {
        const RECENT: usize = 4;
        for r in reads {
            for &h in self.readers[r.root.0 as usize].iter().rev().take(RECENT) {
                let h = self.find(h);
                let g = &self.groups[h as usize];
                if g.closed_by.is_some() || g.core == Core::AdamW {
                    continue;
                }
                if let Ok(m) = self.check(&[h], n, reads) {
                    return Some((h, m));
                }
            }
        }
        None
    }

    /// The facts of a group holding only `n` (used if even that breaks a limit).
    fn alone(&self, n: usize, reads: &[Read]) -> Merged {
        let (core, domain) = self.own_core(n);
        let mut rs: Vec<ValueId> = reads.iter().map(|r| r.root).collect();
        rs.sort();
        rs.dedup();
        Merged { post: core != Core::None, core, domain, reads: rs, to_post: Vec::new() }
    }

    /// The core that node `n` brings, and its pre-core domain.
    fn own_core(&self, n: usize) -> (Core, Option<Shape>) {
        let g = self.cx.g;
        let node = &g.nodes[n];
        match &node.op {
            Op::Reduce { axes, .. } => {
                let input = g.ty(node.inputs[0]).shape.clone();
                (Core::Reduce { input: Box::new(input.clone()), axes: axes.clone() }, Some(input))
            }
            _ if self.cx.class[n] == Class::Composite => (Core::Composite(n as u32), None),
            _ => (Core::None, Some(g.ty(node.results[0]).shape.clone())),
        }
    }

    /// The core of the group in `set` built around a row composite when `n` reduces one of that
    /// composite's row-shaped results' shape over every axis but the last (a bias gradient of
    /// LayerNorm's input gradient): the kernel adds the column partials in its last pass over
    /// each row instead of a new kernel reading the rows again.
    fn column_epilogue(&self, set: &[u32], n: usize) -> Option<Core> {
        let g = self.cx.g;
        let node = &g.nodes[n];
        let Op::Reduce { axes, .. } = &node.op else { return None };
        let input = &g.ty(node.inputs[0]).shape;
        let rank = input.rank();
        if rank < 2 || *axes != (0..rank - 1).collect::<Vec<_>>() {
            return None;
        }
        set.iter().map(|&gid| &self.groups[gid as usize].core).find_map(|core| match core {
            Core::Composite(c) if g.nodes[*c as usize].op.is_row_composite() && g.ty(g.nodes[*c as usize].results[0]).shape == *input => {
                Some(core.clone())
            }
            _ => None,
        })
    }

    /// Whether node `n` may join the union of the groups `set` (the last one being the new
    /// candidate; the others were accepted already), and if so the merged group's facts.
    fn check(&self, set: &[u32], n: usize, reads: &[Read]) -> Result<Merged, Refusal> {
        let cx = self.cx;
        let g = cx.g;
        let me = cx.node_name(n);
        let in_set = |v: ValueId| set.contains(&self.gof(v));
        if let Some(&gid) = set.last() {
            let gr = &self.groups[gid as usize];
            if gr.core == Core::AdamW {
                return Err(("not-fusible", format!("the multi-tensor `adamw` kernel takes no epilogue ({me} reads its result)")));
            }
            if let Some(r) = reads.iter().find(|r| r.layout && self.gof(r.root) == gid) {
                let what = format!("{me} reads {} through a broadcast or reshape", cx.at(r.root));
                return Err(if self.post[cx.prod(r.root)] {
                    ("recompute-in-reduction", format!("{what}, after the kernel's reduction or composite: the kernel would have to finish or recompute it first, so the value is exported instead"))
                } else {
                    ("domain-mismatch", format!("{what}: a kernel does not change the shape of its own values"))
                });
            }
        }
        let class = cx.class[n];
        let reads_post = reads.iter().any(|r| !r.layout && in_set(r.root) && self.post[cx.prod(r.root)]);
        let col_epilogue = self.column_epilogue(set, n);
        if class == Class::Reduce && reads_post && col_epilogue.is_none() {
            return Err(("recompute-in-reduction", format!("{me} reduces a value computed after the kernel's reduction or composite: chained row operations would need the first one recomputed, so the value is exported and reduced by a new kernel")));
        }
        let (own, own_domain) = self.own_core(n);
        let mut post = own != Core::None || reads_post;
        let mut core = col_epilogue.clone().unwrap_or(own);
        for &gid in set {
            let other = &self.groups[gid as usize].core;
            match (&core, other) {
                (_, Core::None) => {}
                (Core::None, c) => core = c.clone(),
                (a, b) if a == b && col_epilogue.is_some() => {}
                (Core::Composite(_), _) | (_, Core::Composite(_)) => {
                    return Err((
                        "one-composite-per-kernel",
                        format!("{me} would put a composite and another composite or a reduction in one kernel"),
                    ));
                }
                (Core::Reduce { input: a, axes: x }, Core::Reduce { input: b, axes: y }) => {
                    if a != b || x != y {
                        return Err((
                            "domain-mismatch",
                            format!("{me} would join reductions of {a} over axes {x:?} and of {b} over axes {y:?}"),
                        ));
                    }
                }
                (_, Core::AdamW) | (Core::AdamW, _) => {
                    unreachable!("adamw groups are refused above")
                }
            }
        }
        // Pointwise groups (and `n`) that do not depend on the core may still join its epilogue
        // when they are on a result shape: they are evaluated there.
        let mut to_post = Vec::new();
        let shape_n = &g.ty(g.nodes[n].results[0]).shape;
        let mismatch = |have: &Shape, want: String| Err(("domain-mismatch", format!("{me} would join ops on {have} with ops on {want}")));
        let domain = match &core {
            Core::None => {
                let want = own_domain.expect("pointwise ops have a domain");
                for &gid in set {
                    match &self.groups[gid as usize].domain {
                        Some(d) if *d != want => return mismatch(d, want.to_string()),
                        _ => {}
                    }
                }
                Some(want)
            }
            Core::Reduce { input, axes } => {
                let r = reduced(input, axes);
                for &gid in set.iter().filter(|&&gid| self.groups[gid as usize].core == Core::None) {
                    match &self.groups[gid as usize].domain {
                        Some(d) if *d == **input => {}
                        Some(d) if *d == r => to_post.push(gid),
                        Some(d) => return mismatch(d, format!("{input} (before the reduction) or {r} (after it)")),
                        None => {}
                    }
                }
                // A pointwise op is in the prologue when it is on `D` and independent of the
                // reductions; otherwise it must be on `R`.
                if class == Class::Pointwise && (post || *shape_n != **input) {
                    if *shape_n != r {
                        return mismatch(shape_n, if post { r.to_string() } else { format!("{input} or {r}") });
                    }
                    post = true;
                }
                Some((**input).clone())
            }
            Core::Composite(c) => {
                let outs: Vec<&Shape> = g.nodes[*c as usize].results.iter().map(|v| &g.ty(*v).shape).collect();
                let outs_text = || outs.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" or ");
                if class == Class::Composite {
                    for &gid in set {
                        if let Some(m) = self.member_not_feeding(gid, n) {
                            return Err((
                                "domain-mismatch",
                                format!(
                                    "{} does not feed the composite {me}: a composite's prologue holds only ops that feed it",
                                    cx.node_name(m)
                                ),
                            ));
                        }
                    }
                } else {
                    let shape_n = if col_epilogue.is_some() { &g.ty(g.nodes[n].inputs[0]).shape } else { shape_n };
                    if !outs.contains(&shape_n) {
                        return mismatch(shape_n, format!("the results of composite {} ({})", cx.node_name(*c as usize), outs_text()));
                    }
                    post = true;
                    for &gid in set.iter().filter(|&&gid| self.groups[gid as usize].core == Core::None) {
                        match &self.groups[gid as usize].domain {
                            Some(d) if outs.contains(&d) => to_post.push(gid),
                            Some(d) => {
                                return mismatch(d, format!("the results of composite {} ({})", cx.node_name(*c as usize), outs_text()))
                            }
                            None => {}
                        }
                    }
                }
                None
            }
            Core::AdamW => unreachable!("adamw groups are refused above"),
        };
        // Ordering comes after the structural rules, so that `cycle` names merges that would
        // otherwise be legal.
        if let Some(&gid) = set.last() {
            if let Some((k, v)) = self.groups[gid as usize].closed_by {
                return Err(("cycle", self.cycle_detail(set, n, reads, k as usize, v)));
            }
        }
        let nres: usize = set.iter().map(|&gid| self.groups[gid as usize].nresults).sum::<usize>() + g.nodes[n].results.len();
        if nres > MAX_RESULTS {
            return Err((
                "result-count-limit",
                format!("with {me} the kernel's ops would have {nres} results (a node has at most {MAX_RESULTS})"),
            ));
        }
        let mut rs: Vec<ValueId> = set.iter().flat_map(|&gid| self.groups[gid as usize].reads.iter().copied()).collect();
        rs.extend(reads.iter().filter(|r| !in_set(r.root)).map(|r| r.root));
        rs.sort();
        rs.dedup();
        if rs.len() > MAX_READS {
            return Err((
                "read-count-limit",
                format!("with {me} the kernel would read {} distinct operands (at most {MAX_READS})", rs.len()),
            ));
        }
        Ok(Merged { core, domain, reads: rs, post, to_post })
    }

    /// Merges the groups `set` and node `n` into one group (the largest of `set`, or a new one)
    /// with the given facts; returns its id.
    fn merge(&mut self, set: &[u32], n: usize, core: Core, domain: Option<Shape>, reads: Vec<ValueId>) -> u32 {
        let target = match set.iter().copied().max_by_key(|&gid| (self.groups[gid as usize].members.len(), std::cmp::Reverse(gid))) {
            Some(t) => t,
            None => {
                self.groups.push(Group {
                    members: Vec::new(),
                    core: Core::None,
                    domain: None,
                    reads: Vec::new(),
                    closed_by: None,
                    maxpos: 0,
                    nresults: 0,
                });
                self.parent.push((self.groups.len() - 1) as u32);
                (self.groups.len() - 1) as u32
            }
        };
        for &gid in set.iter().filter(|&&gid| gid != target) {
            self.parent[gid as usize] = target;
            let moved = std::mem::take(&mut self.groups[gid as usize].members);
            for &m in &moved {
                self.group_of[m as usize] = target;
            }
            self.groups[target as usize].members.extend(moved);
            self.groups[target as usize].nresults += std::mem::take(&mut self.groups[gid as usize].nresults);
        }
        let t = &mut self.groups[target as usize];
        t.members.push(n as u32);
        t.core = core;
        t.domain = domain;
        t.reads = reads;
        t.maxpos = n as u32;
        t.nresults += self.cx.g.nodes[n].results.len();
        self.group_of[n] = target;
        target
    }

    /// Visits an `adamw` node: it joins the open AdamW group, with the pointwise groups that
    /// compute its parameter, gradient or moments for it alone.
    fn join_adamw(&mut self, n: usize) {
        let cx = self.cx;
        let reads = cx.reads(n);
        self.log_fixed_producers(n, &reads);
        let mut set: Vec<u32> = Vec::new();
        let node_results = cx.g.nodes[n].results.len();
        if let Some(s) = self.adamw_open {
            match self.groups[s as usize].closed_by {
                Some((k, v)) => {
                    let detail = format!(
                        "an earlier update's result {} is read by {} before {}, so this update starts a new `adamw` kernel",
                        cx.at(v),
                        cx.node_name(k as usize),
                        cx.node_name(n)
                    );
                    self.log.refuse(PASS, cx.at(v), "cycle", detail);
                    self.adamw_open = None;
                }
                None if self.groups[s as usize].nresults + node_results > MAX_RESULTS => {
                    let detail = format!(
                        "the `adamw` kernel already has {} results (a node has at most {MAX_RESULTS}), so {} starts a new one",
                        self.groups[s as usize].nresults,
                        cx.node_name(n)
                    );
                    self.log.refuse(PASS, cx.at(cx.g.nodes[n].results[0]), "result-count-limit", detail);
                    self.adamw_open = None;
                }
                None => set.push(s),
            }
        }
        let node = &cx.g.nodes[n];
        let shape = cx.g.ty(node.inputs[0]).shape.clone();
        for &v in node.inputs.iter().take(4) {
            let gid = self.gof(v);
            if cx.class[cx.prod(v)] == Class::Absorb || gid == NONE || set.contains(&gid) {
                continue;
            }
            match self.feeder_refusal(gid, n, &shape) {
                None => set.push(gid),
                Some((rule, detail)) => self.log.refuse(PASS, cx.at(v), rule, detail),
            }
        }
        // Only the updates' results leave the kernel (its prologue feeds nothing else).
        let prev = self.adamw_open.map_or(0, |s| self.groups[s as usize].nresults);
        let gid = self.merge(&set, n, Core::AdamW, None, Vec::new());
        self.groups[gid as usize].nresults = prev + node_results;
        self.adamw_open = Some(gid);
        self.post[n] = true;
        self.after_join(n, gid, &reads);
    }

    /// Why group `gid` cannot become a prologue of the update `n` on `shape`, if it cannot.
    fn feeder_refusal(&self, gid: u32, n: usize, shape: &Shape) -> Option<Refusal> {
        let cx = self.cx;
        let g = &self.groups[gid as usize];
        let me = cx.node_name(n);
        if g.core == Core::AdamW {
            return Some(("cycle", format!("{me} reads a result of another `adamw` kernel")));
        }
        if let Some((k, v)) = g.closed_by {
            let detail = format!(
                "its result {} is already read by {} outside it, so it cannot move into the `adamw` kernel",
                cx.at(v),
                cx.node_name(k as usize)
            );
            return Some(("cycle", detail));
        }
        if g.core != Core::None {
            return Some((
                "not-fusible",
                format!("only pointwise ops join the `adamw` kernel; this kernel (feeding {me}) holds a reduction or composite"),
            ));
        }
        if g.domain.as_ref() != Some(shape) {
            return Some((
                "domain-mismatch",
                format!("the update {me} is on {shape}, this kernel on {}", g.domain.as_ref().map_or("?".into(), |d| d.to_string())),
            ));
        }
        for &m in &g.members {
            for r in &cx.g.nodes[m as usize].results {
                let other = cx.users[r.0 as usize].iter().find(|&&u| u as usize != n && self.group_of[u as usize] != gid);
                if cx.is_output[r.0 as usize] || other.is_some() {
                    let by = other.map_or("an output".to_string(), |&u| cx.node_name(u as usize));
                    return Some((
                        "not-fusible",
                        format!("{} is also read by {by}: only ops that feed nothing but {me} join the `adamw` kernel", cx.at(*r)),
                    ));
                }
            }
        }
        None
    }
}

/// `input` without the `axes`.
fn reduced(input: &Shape, axes: &[usize]) -> Shape {
    Shape(input.0.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, d)| d.clone()).collect())
}
