//! Small graph-building helpers shared by the passes.

use std::collections::HashSet;

use fusec_ir::text::quote;
use fusec_ir::{BinaryOp, Graph, Node, Op, Type, UnaryOp, ValueId};
use smallvec::SmallVec;

/// Appends ops to a graph through [`Graph::try_add`]: a type error (which a pass must never
/// produce from a verified graph, but which attributes taken from user input can cause) comes
/// back as an `Err` naming the op, never as a panic. New inputs must not reuse a parameter or
/// input name.
pub struct Emit<'a> {
    /// The graph being extended.
    pub g: &'a mut Graph,
    /// Every parameter and input name of `g`.
    names: HashSet<String>,
}

impl<'a> Emit<'a> {
    /// Starts appending to `g`.
    pub fn new(g: &'a mut Graph) -> Emit<'a> {
        let names = g.nodes.iter().filter_map(|n| source_name(&n.op).map(str::to_string)).collect();
        Emit { g, names }
    }
    /// An op and all its results.
    pub fn ops(&mut self, op: Op, ins: &[ValueId]) -> Result<SmallVec<[ValueId; 3]>, String> {
        let m = op.mnemonic();
        self.g.try_add(op, ins).map_err(|e| format!("building `{m}`: {e}"))
    }
    /// A single-result op.
    pub fn op(&mut self, op: Op, ins: &[ValueId]) -> Result<ValueId, String> {
        let m = op.mnemonic();
        self.ops(op, ins)?.first().copied().ok_or_else(|| format!("building `{m}`: it has no result"))
    }
    /// `a OP b`.
    pub fn bin(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, String> {
        self.op(Op::Binary(op), &[a, b])
    }
    /// `OP x`.
    pub fn un(&mut self, op: UnaryOp, x: ValueId) -> Result<ValueId, String> {
        self.op(Op::Unary(op), &[x])
    }
    /// A splat constant of type `ty`.
    pub fn splat(&mut self, value: f64, ty: &Type) -> Result<ValueId, String> {
        self.op(Op::Const { value, ty: ty.clone() }, &[])
    }
    /// A splat constant shaped like `like`.
    pub fn splat_like(&mut self, value: f64, like: ValueId) -> Result<ValueId, String> {
        let ty = self.g.ty(like).clone();
        self.splat(value, &ty)
    }
    /// A named input; refused if a parameter or input of that name exists already.
    pub fn input(&mut self, name: &str, ty: &Type) -> Result<ValueId, String> {
        if !self.names.insert(name.to_string()) {
            return Err(format!("the graph already has a parameter or input named {}", quote(name)));
        }
        self.op(Op::Input { name: name.to_string(), ty: ty.clone() }, &[])
    }
    /// `x * c` for a constant `c`.
    pub fn scale(&mut self, x: ValueId, c: f64) -> Result<ValueId, String> {
        let k = self.splat_like(c, x)?;
        self.bin(BinaryOp::Mul, x, k)
    }
    /// Sum of `x` over every axis, as a scalar (or `x` itself when it is a scalar).
    pub fn sum_all(&mut self, x: ValueId) -> Result<ValueId, String> {
        let rank = self.g.ty(x).shape.rank();
        if rank == 0 {
            return Ok(x);
        }
        self.op(Op::Reduce { op: fusec_ir::ReduceOp::Sum, axes: (0..rank).collect() }, &[x])
    }
    /// Broadcasts a scalar to the shape of `like`.
    pub fn broadcast_scalar(&mut self, s: ValueId, like: ValueId) -> Result<ValueId, String> {
        let shape = self.g.ty(like).shape.clone();
        if shape.rank() == 0 {
            return Ok(s);
        }
        self.op(Op::Broadcast { dims: vec![], shape }, &[s])
    }
}

/// The name of a `param` or `input` op.
pub fn source_name(op: &Op) -> Option<&str> {
    match op {
        Op::Param { name, .. } | Op::Input { name, .. } => Some(name),
        _ => None,
    }
}

/// Declares output `name` of `g` unless an output of that name exists already (`taken` holds
/// the output names so far; the caller fills it from `g.outputs`).
pub fn output_unique(g: &mut Graph, taken: &mut HashSet<String>, name: &str, v: ValueId) -> Result<(), String> {
    if !taken.insert(name.to_string()) {
        return Err(format!("the graph already has an output named {}", quote(name)));
    }
    g.output(name, v);
    Ok(())
}

/// Copies `g` without the nodes that no output depends on. Parameters and inputs always stay:
/// they are the graph's interface; so do collectives (`all_reduce`, `from_owners`): every rank
/// must issue the same ones, also those whose results this rank does not read (with ZeRO-1, the
/// gradients of parameters other ranks update). Value numbering stays in program order.
pub fn remove_dead_nodes(g: &Graph) -> Graph {
    let mut live = vec![false; g.values.len()];
    for (_, v) in &g.outputs {
        live[v.0 as usize] = true;
    }
    let mut keep = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate().rev() {
        let interface = matches!(n.op, Op::Param { .. } | Op::Input { .. }) || n.op.is_collective();
        if interface || n.results.iter().any(|r| live[r.0 as usize]) {
            keep[i] = true;
            for v in &n.inputs {
                live[v.0 as usize] = true;
            }
        }
    }
    let mut out = Graph::new(&g.name, &[]);
    out.syms = g.syms.clone();
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    for (n, _) in g.nodes.iter().zip(&keep).filter(|(_, k)| **k) {
        let ins: Vec<ValueId> = n.inputs.iter().map(|v| map[v.0 as usize].expect("inputs precede uses")).collect();
        let tys = n.results.iter().map(|r| g.ty(*r).clone()).collect();
        for (old, new) in n.results.iter().zip(out.push_unchecked(n.op.clone(), &ins, tys)) {
            map[old.0 as usize] = Some(new);
        }
    }
    for (name, v) in &g.outputs {
        out.output(name, map[v.0 as usize].expect("outputs are live"));
    }
    out
}

/// For every value, the indices of the nodes that use it (in program order, repeats removed),
/// and whether it is a graph output.
pub struct Uses {
    /// Using nodes per value.
    pub users: Vec<Vec<usize>>,
    /// Whether the value is a graph output.
    pub is_output: Vec<bool>,
}

impl Uses {
    /// Computes the uses of every value of `g`.
    pub fn of(g: &Graph) -> Uses {
        let mut users = vec![Vec::new(); g.values.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            for v in &n.inputs {
                let u: &mut Vec<usize> = &mut users[v.0 as usize];
                if u.last() != Some(&i) {
                    u.push(i);
                }
            }
        }
        let mut is_output = vec![false; g.values.len()];
        for (_, v) in &g.outputs {
            is_output[v.0 as usize] = true;
        }
        Uses { users, is_output }
    }
}

/// Positional value names (`%N`, as printed) of a graph's values.
pub fn value_names(g: &Graph) -> Vec<String> {
    let mut names = vec![String::new(); g.values.len()];
    let mut k = 0;
    for n in &g.nodes {
        for r in &n.results {
            names[r.0 as usize] = format!("%{k}");
            k += 1;
        }
    }
    names
}

/// A graph being rebuilt from an old one in program order: each old value's new value, the
/// nodes copied as they are, the outputs mapped at the end. `rebuild`, `amp` and `recompute`
/// copy graphs through it.
pub struct Copier<'g> {
    /// The graph being rebuilt.
    pub old: &'g Graph,
    /// The new graph.
    pub out: Graph,
    map: Vec<Option<ValueId>>,
    pass: &'static str,
}

impl<'g> Copier<'g> {
    /// An empty copy of `old` (name and symbols); `pass` names errors.
    pub fn new(old: &'g Graph, pass: &'static str) -> Copier<'g> {
        let mut out = Graph::new(&old.name, &[]);
        out.syms = old.syms.clone();
        Copier { old, out, map: vec![None; old.values.len()], pass }
    }
    /// The new value of old `v`.
    pub fn get(&self, v: ValueId) -> Result<ValueId, String> {
        self.map.get(v.0 as usize).copied().flatten().ok_or_else(|| format!("{}: value {v:?} is used before it is defined", self.pass))
    }
    /// The new values of old values.
    pub fn get_all(&self, vs: &[ValueId]) -> Result<Vec<ValueId>, String> {
        vs.iter().map(|v| self.get(*v)).collect()
    }
    /// Old `v` is now `new`.
    pub fn set(&mut self, v: ValueId, new: ValueId) {
        self.map[v.0 as usize] = Some(new);
    }
    /// Appends a copy of old node `n` with operands `ins` (new values), keeping its declared
    /// result types, and maps its results.
    pub fn copy(&mut self, n: &Node, ins: &[ValueId]) {
        let tys = n.results.iter().map(|r| self.old.ty(*r).clone()).collect();
        for (old, new) in n.results.iter().zip(self.out.push_unchecked(n.op.clone(), ins, tys)) {
            self.map[old.0 as usize] = Some(new);
        }
    }
    /// The new graph, with the old outputs mapped.
    pub fn finish(mut self) -> Result<Graph, String> {
        for (name, v) in &self.old.outputs {
            let new = self.get(*v)?;
            self.out.output(name, new);
        }
        Ok(self.out)
    }
}

/// A node that replaces a matched pattern: emitted at the position of the pattern's root node;
/// `exposes[i]` is the old value that the new node's result `i` stands for.
pub struct Replacement {
    /// The new op.
    pub op: Op,
    /// Its operands (values of the old graph).
    pub inputs: Vec<ValueId>,
    /// Old values replaced by the results, in result order.
    pub exposes: Vec<ValueId>,
}

/// Rebuilds `g` in program order with the replacements (keyed by root node index) applied and
/// the `deleted` nodes dropped, then removes nodes left dead. The caller guarantees that each
/// replacement's operands are defined before its root and that every use of an exposed value
/// comes after the root.
pub fn rebuild(g: &Graph, mut replacements: std::collections::HashMap<usize, Replacement>, deleted: &[bool]) -> Result<Graph, String> {
    let mut c = Copier::new(g, "rebuild");
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(r) = replacements.remove(&i) {
            let ins = c.get_all(&r.inputs)?;
            let res = c.out.try_add(r.op, &ins)?;
            for (old, new) in r.exposes.iter().zip(res) {
                c.set(*old, new);
            }
        } else if !deleted[i] {
            let ins = c.get_all(&n.inputs)?;
            c.copy(n, &ins);
        }
    }
    Ok(remove_dead_nodes(&c.finish()?))
}
