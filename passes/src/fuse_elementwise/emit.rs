//! Building the fused graph from a grouping: kernel bodies, names and the launch order.

use std::collections::HashMap;

use fusec_ir::{Graph, Kernel, Op, ValueId};

use super::group::{Core, Grouping, NONE};
use super::{Class, Ctx, MAX_NAME};

/// A schedulable unit of the output: a group or an unfused node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unit {
    Group(u32),
    Node(u32),
}

/// Builds the output graph: one `kernel` per group (members in program order), unfused nodes as
/// they are, absorbable nodes outside kernels where something unfused uses them.
pub(super) fn emit(cx: &Ctx, gr: &Grouping) -> Result<Graph, String> {
    let g = cx.g;
    let exported = exports(cx, gr);
    let mut out = Graph::new(&g.name, &[]);
    out.syms = g.syms.clone();
    let mut e = Emitter { cx, gr, out, map: vec![None; g.values.len()] };

    // Units in order of their last node; each is emitted after what it reads (it always is when
    // groups close on escape, but the search keeps the output valid regardless).
    let mut unit_at: Vec<Option<Unit>> = vec![None; g.nodes.len()];
    for (i, c) in cx.class.iter().enumerate() {
        if cx.live[i] && *c == Class::Fixed {
            unit_at[i] = Some(Unit::Node(i as u32));
        }
    }
    for (gid, grp) in gr.groups.iter().enumerate() {
        if !grp.members.is_empty() {
            unit_at[grp.maxpos as usize] = Some(Unit::Group(gid as u32));
        }
    }
    let mut state = vec![0u8; g.nodes.len() + gr.groups.len()];
    let slot = |u: Unit| match u {
        Unit::Node(n) => n as usize,
        Unit::Group(gid) => g.nodes.len() + gid as usize,
    };
    for start in unit_at.iter().flatten().copied() {
        // Iterative post-order search: (unit, whether its dependencies were pushed).
        let mut stack = vec![(start, false)];
        while let Some((u, expanded)) = stack.pop() {
            let s = slot(u);
            if expanded {
                state[s] = 2;
                e.unit(u, &exported)?;
                continue;
            }
            match state[s] {
                2 => continue,
                1 => return Err("internal error: fused groups form a cycle".to_string()),
                _ => {}
            }
            state[s] = 1;
            stack.push((u, true));
            for d in deps(cx, gr, u).into_iter().rev() {
                if state[slot(d)] != 2 {
                    stack.push((d, false));
                }
            }
        }
    }
    for (name, v) in &g.outputs {
        let nv = e.ensure(*v)?;
        e.out.output(name, nv);
    }
    Ok(e.out)
}

/// The units whose values `u` reads.
fn deps(cx: &Ctx, gr: &Grouping, u: Unit) -> Vec<Unit> {
    let mut reads = Vec::new();
    match u {
        Unit::Node(n) => reads.extend(cx.reads(n as usize).iter().map(|r| r.root)),
        Unit::Group(gid) => {
            for &m in &gr.groups[gid as usize].members {
                reads.extend(cx.reads(m as usize).iter().map(|r| r.root));
            }
        }
    }
    let mut out = Vec::new();
    for v in reads {
        let p = cx.prod(v);
        let d = match gr.group_of[p] {
            NONE => Unit::Node(p as u32),
            h => Unit::Group(h),
        };
        if d != u && !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// Per value: whether it is a group member's value used outside its group (a kernel result).
fn exports(cx: &Ctx, gr: &Grouping) -> Vec<bool> {
    let mut ex = vec![false; cx.g.values.len()];
    let mut mark = |v: ValueId, from: u32| {
        let h = gr.group_of[cx.prod(v)];
        if h != NONE && h != from {
            ex[v.0 as usize] = true;
        }
    };
    for (_, v) in &cx.g.outputs {
        let p = cx.prod(*v);
        let root = if cx.class[p] == Class::Absorb { cx.chain_root[p] } else { Some(*v) };
        if let Some(r) = root {
            mark(r, NONE);
        }
    }
    for n in (0..cx.g.nodes.len()).filter(|&n| cx.live[n]) {
        if cx.class[n] == Class::Absorb {
            continue;
        }
        for r in cx.reads(n) {
            mark(r.root, gr.group_of[n]);
        }
    }
    ex
}

struct Emitter<'a, 'g> {
    cx: &'a Ctx<'g>,
    gr: &'a Grouping,
    out: Graph,
    /// Old value -> new value.
    map: Vec<Option<ValueId>>,
}

impl Emitter<'_, '_> {
    /// The new value of old `v`, emitting the absorbable chain that makes it if needed
    /// (operands first, without recursion: a chain may be as long as the graph).
    fn ensure(&mut self, v: ValueId) -> Result<ValueId, String> {
        let cx = self.cx;
        let mut stack: Vec<(ValueId, bool)> = vec![(v, false)];
        while let Some((u, expanded)) = stack.pop() {
            if self.map[u.0 as usize].is_some() {
                continue;
            }
            let p = cx.prod(u);
            if expanded {
                self.push_copy(p)?;
                continue;
            }
            if cx.class[p] != Class::Absorb {
                return Err(format!("internal error: %{} is used before it is emitted", cx.names[u.0 as usize]));
            }
            stack.push((u, true));
            stack.extend(cx.g.nodes[p].inputs.iter().rev().filter(|x| self.map[x.0 as usize].is_none()).map(|&x| (x, false)));
        }
        self.map[v.0 as usize].ok_or_else(|| format!("internal error: %{} was not emitted", cx.names[v.0 as usize]))
    }

    /// Copies node `n` of the input graph as it is, emitting the absorbable chains it reads.
    fn copy_node(&mut self, n: usize) -> Result<(), String> {
        for &v in &self.cx.g.nodes[n].inputs {
            self.ensure(v)?;
        }
        self.push_copy(n)
    }

    /// Copies node `n`, whose operands are all emitted.
    fn push_copy(&mut self, n: usize) -> Result<(), String> {
        let node = &self.cx.g.nodes[n];
        let ins = node
            .inputs
            .iter()
            .map(|v| self.map[v.0 as usize].ok_or_else(|| format!("internal error: %{} is not emitted", self.cx.names[v.0 as usize])))
            .collect::<Result<Vec<_>, _>>()?;
        let tys = node.results.iter().map(|r| self.cx.g.ty(*r).clone()).collect();
        let res = self.out.push_unchecked(node.op.clone(), &ins, tys);
        for (old, new) in node.results.iter().zip(res) {
            self.map[old.0 as usize] = Some(new);
        }
        Ok(())
    }

    fn unit(&mut self, u: Unit, exported: &[bool]) -> Result<(), String> {
        match u {
            Unit::Node(n) => self.copy_node(n as usize),
            Unit::Group(gid) => self.group(gid, exported),
        }
    }

    /// Emits group `gid` as one kernel (or, if it reads no operand, as its plain nodes).
    fn group(&mut self, gid: u32, exported: &[bool]) -> Result<(), String> {
        let cx = self.cx;
        let grp = &self.gr.groups[gid as usize];
        let mut members = grp.members.clone();
        members.sort_unstable();
        let name = kernel_name(cx, &members, &grp.core);
        let (body, operands, results) = build_body(cx, self.gr, gid, &members, exported, &name)?;
        if operands.is_empty() {
            for &m in &members {
                self.copy_node(m as usize)?;
            }
            return Ok(());
        }
        let ins = operands.iter().map(|&v| self.ensure(v)).collect::<Result<Vec<_>, _>>()?;
        let res = self
            .out
            .try_add(Op::Kernel(Box::new(Kernel { name: name.clone(), body })), &ins)
            .map_err(|e| format!("internal error: kernel `{name}`: {e}"))?;
        for (old, new) in results.iter().zip(res) {
            self.map[old.0 as usize] = Some(new);
        }
        Ok(())
    }
}

/// The kernel's name: the mnemonics of its ops in program order without repeats (constants,
/// broadcasts and reshapes are not members), whole words up to [`MAX_NAME`] characters; the
/// AdamW kernel is `adamw`.
fn kernel_name(cx: &Ctx, members: &[u32], core: &Core) -> String {
    if *core == Core::AdamW {
        return "adamw".to_string();
    }
    let mut parts: Vec<&str> = Vec::new();
    for &m in members {
        let mn = cx.g.nodes[m as usize].op.mnemonic();
        if !parts.contains(&mn) {
            parts.push(mn);
        }
    }
    let mut name = String::new();
    for p in parts {
        let extra = if name.is_empty() { p.len() } else { p.len() + 1 };
        if name.len() + extra > MAX_NAME {
            break;
        }
        if !name.is_empty() {
            name.push('_');
        }
        name.push_str(p);
    }
    name
}

/// The body of group `gid` (members sorted): inputs `in0..` for the operands in first-use
/// order, the absorbed chains on first use, the members in program order, and outputs `out0..`
/// for the exported values in program order. Returns the body, the operands and the exported
/// values (old values).
fn build_body(
    cx: &Ctx,
    gr: &Grouping,
    gid: u32,
    members: &[u32],
    exported: &[bool],
    name: &str,
) -> Result<(Graph, Vec<ValueId>, Vec<ValueId>), String> {
    let g = cx.g;
    let mut body = Graph::new(name, &[]);
    body.syms = g.syms.clone();
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    let mut operands = Vec::new();
    for &m in members {
        for r in cx.reads(m as usize) {
            if gr.group_of[cx.prod(r.root)] != gid && !map.contains_key(&r.root) {
                let iv = body.add1(Op::Input { name: format!("in{}", operands.len()), ty: g.ty(r.root).clone() }, &[]);
                map.insert(r.root, iv);
                operands.push(r.root);
            }
        }
    }
    let err = |e: String| format!("internal error: body of kernel `{name}`: {e}");
    for &m in members {
        let node = &g.nodes[m as usize];
        let ins = node.inputs.iter().map(|&v| body_value(cx, &mut body, &mut map, v)).collect::<Result<Vec<_>, _>>().map_err(err)?;
        let res = body.try_add(node.op.clone(), &ins).map_err(err)?;
        for (old, new) in node.results.iter().zip(res) {
            map.insert(*old, new);
        }
    }
    let mut results = Vec::new();
    for &m in members {
        for r in &g.nodes[m as usize].results {
            if exported[r.0 as usize] {
                body.output(&format!("out{}", results.len()), map[r]);
                results.push(*r);
            }
        }
    }
    Ok((body, operands, results))
}

/// The body value of old `v`: a mapped operand or member value, or an absorbed chain copied in
/// (operands first, without recursion).
fn body_value(cx: &Ctx, body: &mut Graph, map: &mut HashMap<ValueId, ValueId>, v: ValueId) -> Result<ValueId, String> {
    let mut stack: Vec<(ValueId, bool)> = vec![(v, false)];
    while let Some((u, expanded)) = stack.pop() {
        if map.contains_key(&u) {
            continue;
        }
        let p = cx.prod(u);
        let node = &cx.g.nodes[p];
        if expanded {
            let ins = node.inputs.iter().map(|x| map.get(x).copied().ok_or("an operand is not copied")).collect::<Result<Vec<_>, _>>()?;
            let res = body.try_add(node.op.clone(), &ins)?;
            for (old, new) in node.results.iter().zip(res) {
                map.insert(*old, new);
            }
            continue;
        }
        if cx.class[p] != Class::Absorb {
            return Err(format!("%{} is neither an operand nor a member", cx.names[u.0 as usize]));
        }
        stack.push((u, true));
        stack.extend(node.inputs.iter().rev().filter(|x| !map.contains_key(x)).map(|&x| (x, false)));
    }
    map.get(&v).copied().ok_or_else(|| format!("%{} was not copied", cx.names[v.0 as usize]))
}
