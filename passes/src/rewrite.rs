//! Small graph-building helpers shared by the passes.

use fusec_ir::{BinaryOp, Graph, Op, Type, UnaryOp, ValueId};

/// Appends ops to a graph; the passes build only well-typed nodes, so type errors are bugs.
pub struct Emit<'a> {
    /// The graph being extended.
    pub g: &'a mut Graph,
}

impl Emit<'_> {
    /// A single-result op.
    pub fn op(&mut self, op: Op, ins: &[ValueId]) -> ValueId {
        self.g.add1(op, ins)
    }
    /// `a OP b`.
    pub fn bin(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        self.g.add1(Op::Binary(op), &[a, b])
    }
    /// `OP x`.
    pub fn un(&mut self, op: UnaryOp, x: ValueId) -> ValueId {
        self.g.add1(Op::Unary(op), &[x])
    }
    /// A splat constant of type `ty`.
    pub fn splat(&mut self, value: f64, ty: &Type) -> ValueId {
        self.g.add1(Op::Const { value, ty: ty.clone() }, &[])
    }
    /// A splat constant shaped like `like`.
    pub fn splat_like(&mut self, value: f64, like: ValueId) -> ValueId {
        let ty = self.g.ty(like).clone();
        self.splat(value, &ty)
    }
    /// A named input.
    pub fn input(&mut self, name: &str, ty: &Type) -> ValueId {
        self.g.add1(Op::Input { name: name.to_string(), ty: ty.clone() }, &[])
    }
    /// `x * c` for a constant `c`.
    pub fn scale(&mut self, x: ValueId, c: f64) -> ValueId {
        let k = self.splat_like(c, x);
        self.bin(BinaryOp::Mul, x, k)
    }
    /// Sum of `x` over every axis, as a scalar (or `x` itself when it is a scalar).
    pub fn sum_all(&mut self, x: ValueId) -> ValueId {
        let rank = self.g.ty(x).shape.rank();
        if rank == 0 {
            return x;
        }
        self.g.add1(Op::Reduce { op: fusec_ir::ReduceOp::Sum, axes: (0..rank).collect() }, &[x])
    }
    /// Broadcasts a scalar to the shape of `like`.
    pub fn broadcast_scalar(&mut self, s: ValueId, like: ValueId) -> ValueId {
        let shape = self.g.ty(like).shape.clone();
        if shape.rank() == 0 {
            return s;
        }
        self.g.add1(Op::Broadcast { dims: vec![], shape }, &[s])
    }
}

/// Copies `g` without the nodes that no output depends on. Parameters and inputs always stay:
/// they are the graph's interface. Value numbering stays in program order.
pub fn remove_dead_nodes(g: &Graph) -> Graph {
    let mut live = vec![false; g.values.len()];
    for (_, v) in &g.outputs {
        live[v.0 as usize] = true;
    }
    let mut keep = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate().rev() {
        let interface = matches!(n.op, Op::Param { .. } | Op::Input { .. });
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
    let mut out = Graph::new(&g.name, &[]);
    out.syms = g.syms.clone();
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let get = |map: &Vec<Option<ValueId>>, v: &ValueId| map[v.0 as usize].ok_or_else(|| format!("value {v:?} used before it is rebuilt"));
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(r) = replacements.remove(&i) {
            let ins = r.inputs.iter().map(|v| get(&map, v)).collect::<Result<Vec<_>, _>>()?;
            let res = out.try_add(r.op, &ins)?;
            for (old, new) in r.exposes.iter().zip(res) {
                map[old.0 as usize] = Some(new);
            }
            continue;
        }
        if deleted[i] {
            continue;
        }
        let ins = n.inputs.iter().map(|v| get(&map, v)).collect::<Result<Vec<_>, _>>()?;
        let tys = n.results.iter().map(|r| g.ty(*r).clone()).collect();
        for (old, new) in n.results.iter().zip(out.push_unchecked(n.op.clone(), &ins, tys)) {
            map[old.0 as usize] = Some(new);
        }
    }
    for (name, v) in &g.outputs {
        out.output(name, get(&map, v)?);
    }
    Ok(remove_dead_nodes(&out))
}
