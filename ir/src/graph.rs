//! The graph: SSA values produced by nodes kept in a deterministic topological order.
//!
//! Nodes are stored in the order they were added; every input must already exist, so insertion
//! order is a topological order, and it is the order the printer, the interpreter and the passes
//! walk. Values are printed by position (`%0`, `%1`, ...), never by internal id.

use smallvec::SmallVec;

use crate::infer::result_types;
use crate::{Op, Type};

/// A value (one result of one node).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

/// A node index in [`Graph::nodes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// One operation applied to values, producing one or more values.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What the node computes.
    pub op: Op,
    /// Operands, in the op's order.
    pub inputs: SmallVec<[ValueId; 4]>,
    /// Results, in the op's order.
    pub results: SmallVec<[ValueId; 3]>,
}

/// Where a value comes from and its type.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueInfo {
    /// Its type.
    pub ty: Type,
    /// The producing node.
    pub node: NodeId,
    /// Which result of that node.
    pub index: u16,
}

/// A whole program: symbolic dims, nodes in order, and named outputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    /// The graph's name, printed in the header.
    pub name: String,
    /// Declared symbolic dims (e.g. `B`, `T`).
    pub syms: Vec<String>,
    /// Nodes in topological (insertion) order.
    pub nodes: Vec<Node>,
    /// Every value, indexed by [`ValueId`].
    pub values: Vec<ValueInfo>,
    /// Named results of the graph, in order.
    pub outputs: Vec<(String, ValueId)>,
}

impl Graph {
    /// An empty graph with the given name and symbolic dims.
    pub fn new(name: &str, syms: &[&str]) -> Graph {
        Graph { name: name.to_string(), syms: syms.iter().map(|s| s.to_string()).collect(), ..Graph::default() }
    }

    /// Appends a node after checking its operand types; returns its results.
    pub fn try_add(&mut self, op: Op, inputs: &[ValueId]) -> Result<SmallVec<[ValueId; 3]>, String> {
        for v in inputs {
            if v.0 as usize >= self.values.len() {
                return Err(format!("operand {v:?} does not exist"));
            }
        }
        let tys: Vec<&Type> = inputs.iter().map(|v| &self.values[v.0 as usize].ty).collect();
        let out = result_types(&op, &tys)?;
        Ok(self.push_unchecked(op, inputs, out.into_iter().collect()))
    }

    /// Appends a node with the given result types without checking them (the parser uses this
    /// to keep the declared types; the verifier checks them later).
    pub fn push_unchecked(&mut self, op: Op, inputs: &[ValueId], tys: Vec<Type>) -> SmallVec<[ValueId; 3]> {
        let node = NodeId(self.nodes.len() as u32);
        let mut results = SmallVec::new();
        for (i, ty) in tys.into_iter().enumerate() {
            let id = ValueId(self.values.len() as u32);
            self.values.push(ValueInfo { ty, node, index: i as u16 });
            results.push(id);
        }
        self.nodes.push(Node { op, inputs: inputs.iter().copied().collect(), results: results.clone() });
        results
    }

    /// Appends a node that builders know to be well-typed; panics with the type error otherwise
    /// (a builder bug, never user input).
    pub fn add(&mut self, op: Op, inputs: &[ValueId]) -> SmallVec<[ValueId; 3]> {
        let m = op.mnemonic();
        self.try_add(op, inputs).unwrap_or_else(|e| panic!("builder produced an ill-typed `{m}`: {e}"))
    }

    /// Like [`Graph::add`] for single-result ops.
    pub fn add1(&mut self, op: Op, inputs: &[ValueId]) -> ValueId {
        self.add(op, inputs)[0]
    }

    /// Declares a named output.
    pub fn output(&mut self, name: &str, v: ValueId) {
        self.outputs.push((name.to_string(), v));
    }

    /// The type of a value.
    pub fn ty(&self, v: ValueId) -> &Type {
        &self.values[v.0 as usize].ty
    }

    /// The node that produces a value.
    pub fn producer(&self, v: ValueId) -> &Node {
        &self.nodes[self.values[v.0 as usize].node.0 as usize]
    }

    /// The value of the named output, if any.
    pub fn output_named(&self, name: &str) -> Option<ValueId> {
        self.outputs.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    /// Parameters in order: (name, value).
    pub fn params(&self) -> Vec<(&str, ValueId)> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Param { name, .. } => Some((name.as_str(), n.results[0])),
                _ => None,
            })
            .collect()
    }

    /// Inputs in order: (name, value).
    pub fn inputs(&self) -> Vec<(&str, ValueId)> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Input { name, .. } => Some((name.as_str(), n.results[0])),
                _ => None,
            })
            .collect()
    }

    /// For every value, how many node operands and outputs use it.
    pub fn use_counts(&self) -> Vec<u32> {
        let mut c = vec![0u32; self.values.len()];
        for n in &self.nodes {
            for v in &n.inputs {
                c[v.0 as usize] += 1;
            }
        }
        for (_, v) in &self.outputs {
            c[v.0 as usize] += 1;
        }
        c
    }
}
