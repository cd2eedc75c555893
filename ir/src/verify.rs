//! The verifier: checks that a [`Graph`] is well formed before anything else trusts it.
//!
//! It runs after parsing and after every pass in debug builds and tests. It must never panic,
//! whatever the graph holds (out-of-range ids, dangling values, absurd dims): every check is
//! written against possibly-garbage input. Values are named in messages by their position in
//! definition order (`%k`), the same names the `.graph` printer uses.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::infer::result_types;
use crate::{Dim, Graph, Op, Shape, Type};

/// What is wrong with a graph: the node (index into [`Graph::nodes`]) if the problem belongs to
/// one, the node's mnemonic, and a message naming values positionally (`%k`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// The offending node, or `None` for graph-level problems (outputs, header).
    pub node: Option<usize>,
    /// The mnemonic of the offending node's op (`None` when `node` is `None`).
    pub op: Option<&'static str>,
    /// What is wrong.
    pub msg: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.node, self.op) {
            (Some(n), Some(op)) => write!(f, "node {n} (`{op}`): {}", self.msg),
            (Some(n), None) => write!(f, "node {n}: {}", self.msg),
            _ => f.write_str(&self.msg),
        }
    }
}

impl std::error::Error for VerifyError {}

/// Positional names of values: value number `k` is the `k`-th result in definition order
/// (walking nodes in order, results in order). Robust to ids that are out of range or repeated.
pub struct ValueNames(HashMap<u32, usize>);

impl ValueNames {
    /// Numbers every value defined by `g`'s nodes (the first definition wins on duplicates).
    pub fn new(g: &Graph) -> ValueNames {
        let mut m = HashMap::new();
        let mut k = 0usize;
        for n in &g.nodes {
            for r in &n.results {
                m.entry(r.0).or_insert(k);
                k += 1;
            }
        }
        ValueNames(m)
    }

    /// `%k` for a defined value, `%?(id N)` otherwise.
    pub fn name(&self, v: crate::ValueId) -> String {
        match self.0.get(&v.0) {
            Some(k) => format!("%{k}"),
            None => format!("%?(id {})", v.0),
        }
    }
}

/// Checks every structural and typing rule of the IR; the first violation is returned.
///
/// Kernel bodies are verified too, with the same rules plus their own: a body declares exactly
/// the enclosing graph's symbols and holds only `input`, `const`, `iota` and compute nodes (no
/// `param`, no nested `kernel`). An error inside a body is reported at the kernel node, and its
/// message names the node inside the body.
pub fn verify(g: &Graph) -> Result<(), VerifyError> {
    verify_graph(g, false)
}

/// [`verify`] of `g`, which is a kernel body when `in_body`.
fn verify_graph(g: &Graph, in_body: bool) -> Result<(), VerifyError> {
    let names = ValueNames::new(g);
    let syms: HashSet<&str> = g.syms.iter().map(|s| s.as_str()).collect();
    let graph_err = |msg: String| VerifyError { node: None, op: None, msg };

    let mut seen_sym = HashSet::new();
    for s in &g.syms {
        if s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || s.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(graph_err(format!("symbolic dim name `{s}` is not an identifier")));
        }
        if !seen_sym.insert(s.as_str()) {
            return Err(graph_err(format!("symbolic dim `{s}` is declared twice")));
        }
    }

    // defined[v] = true once an earlier node has produced v.
    let mut defined = vec![false; g.values.len()];
    let mut param_names: HashMap<&str, usize> = HashMap::new();
    let mut input_names: HashMap<&str, usize> = HashMap::new();

    for (i, node) in g.nodes.iter().enumerate() {
        let op_name = node.op.mnemonic();
        let err = |msg: String| VerifyError { node: Some(i), op: Some(op_name), msg };

        // Operands: existing values defined by earlier nodes.
        for (k, v) in node.inputs.iter().enumerate() {
            let idx = v.0 as usize;
            if idx >= g.values.len() {
                return Err(err(format!("operand {k} refers to a value that does not exist (id {})", v.0)));
            }
            if !defined[idx] {
                return Err(err(format!("operand {k} ({}) is used before it is defined", names.name(*v))));
            }
        }

        // Attributes, and what a kernel body may hold.
        check_attrs(&node.op, &syms).map_err(&err)?;
        if in_body {
            match &node.op {
                Op::Param { .. } => return Err(err("a kernel body cannot hold a `param` (parameters are operands)".to_string())),
                Op::Kernel(k) => return Err(err(format!("kernel `{}` is nested in a kernel body (kernels do not nest)", k.name))),
                _ => {}
            }
        }
        // A kernel's body must be sound before its type rule looks into it.
        if let Op::Kernel(k) = &node.op {
            check_kernel(k, g).map_err(&err)?;
        }

        // Results: fresh values pointing back at this node.
        for (j, r) in node.results.iter().enumerate() {
            let idx = r.0 as usize;
            let Some(info) = g.values.get(idx) else {
                return Err(err(format!("result {j} refers to a value that does not exist (id {})", r.0)));
            };
            if defined[idx] {
                return Err(err(format!("result {j} ({}) is defined more than once", names.name(*r))));
            }
            if info.node.0 as usize != i || info.index as usize != j {
                return Err(err(format!(
                    "result {j} ({}) records its producer as node {} result {}",
                    names.name(*r),
                    info.node.0,
                    info.index
                )));
            }
            check_type(&info.ty, &syms).map_err(|m| err(format!("result {j} ({}): {m}", names.name(*r))))?;
            defined[idx] = true;
        }

        // Types: the declared result types are exactly what the type rules give.
        let tys: Vec<&Type> = node.inputs.iter().map(|v| &g.values[v.0 as usize].ty).collect();
        if let Op::Concat { axis } = node.op {
            if !concat_len_fits(&tys, axis) {
                return Err(err("concatenated length overflows".to_string()));
            }
        }
        let expected = result_types(&node.op, &tys).map_err(&err)?;
        if expected.len() != node.results.len() {
            return Err(err(format!("`{op_name}` produces {} result(s), node has {}", expected.len(), node.results.len())));
        }
        for (j, (r, want)) in node.results.iter().zip(&expected).enumerate() {
            let have = &g.values[r.0 as usize].ty;
            if have != want {
                return Err(err(format!("result {j} ({}) is declared {have}, expected {want}", names.name(*r))));
            }
        }

        // Names of sources.
        match &node.op {
            Op::Param { name, .. } | Op::Input { name, .. } => {
                let is_param = matches!(node.op, Op::Param { .. });
                if name.is_empty() {
                    return Err(err("empty name".to_string()));
                }
                let (own, other) = if is_param { (&mut param_names, &input_names) } else { (&mut input_names, &param_names) };
                if let Some(prev) = own.insert(name.as_str(), i) {
                    return Err(err(format!("name `{name}` is already used by node {prev}")));
                }
                if let Some(prev) = other.get(name.as_str()) {
                    return Err(err(format!("name `{name}` is already used by node {prev} (params and inputs share one namespace)")));
                }
            }
            _ => {}
        }
    }

    if let Some(idx) = defined.iter().position(|d| !d) {
        return Err(graph_err(format!("value id {idx} is not produced by any node")));
    }

    let mut out_names = HashSet::new();
    for (name, v) in &g.outputs {
        if name.is_empty() {
            return Err(graph_err(format!("output {} has an empty name", names.name(*v))));
        }
        if !out_names.insert(name.as_str()) {
            return Err(graph_err(format!("output name `{name}` is used twice")));
        }
        if (v.0 as usize) >= g.values.len() {
            return Err(graph_err(format!("output `{name}` refers to a value that does not exist (id {})", v.0)));
        }
    }
    Ok(())
}

/// Checks the body of a kernel of `g`: `g`'s symbols, and every rule of a body.
fn check_kernel(k: &crate::Kernel, g: &Graph) -> Result<(), String> {
    if k.body.syms != g.syms {
        return Err(format!(
            "the body of kernel `{}` declares symbols ({}) but the graph declares ({})",
            k.name,
            k.body.syms.join(", "),
            g.syms.join(", ")
        ));
    }
    verify_graph(&k.body, true).map_err(|e| format!("in the body of kernel `{}`: {e}", k.name))
}

/// Checks a dim: nonzero and only declared symbols, in normalized (sorted) order.
fn check_dim(d: &Dim, syms: &HashSet<&str>) -> Result<(), String> {
    if d.coef == 0 {
        return Err(format!("dim `{d}` is zero (zero-size tensors are not allowed)"));
    }
    for s in &d.syms {
        if !syms.contains(s.as_str()) {
            return Err(format!("symbolic dim `{s}` is not declared in the graph header"));
        }
    }
    if !d.syms.windows(2).all(|w| w[0] <= w[1]) {
        return Err(format!("dim `{d}` is not normalized (symbols must be sorted)"));
    }
    Ok(())
}

fn check_shape(s: &Shape, syms: &HashSet<&str>) -> Result<(), String> {
    s.0.iter().try_for_each(|d| check_dim(d, syms))
}

fn check_type(t: &Type, syms: &HashSet<&str>) -> Result<(), String> {
    check_shape(&t.shape, syms).map_err(|m| format!("type {t}: {m}"))
}

/// Attribute checks that the type rules do not cover.
fn check_attrs(op: &Op, syms: &HashSet<&str>) -> Result<(), String> {
    match op {
        Op::Param { ty, .. } | Op::Input { ty, .. } | Op::Iota { ty, .. } => check_type(ty, syms),
        Op::Const { value, ty } => {
            check_type(ty, syms)?;
            if value.is_nan() {
                return Err("constant is NaN".to_string());
            }
            if !ty.dtype.is_float() {
                let r = value.round_ties_even();
                if !value.is_finite() || r < i32::MIN as f64 || r > i32::MAX as f64 {
                    return Err(format!("constant {value} does not fit in {}", ty.dtype));
                }
            }
            Ok(())
        }
        Op::Reshape { shape } | Op::Broadcast { shape, .. } => check_shape(shape, syms),
        Op::ScatterAdd { rows } => check_dim(rows, syms),
        Op::Slice { start, end, .. } if start >= end => Err(format!("slice {start}..{end} is empty")),
        Op::CrossEntropy { vocab } | Op::CrossEntropyGrad { vocab } | Op::CrossEntropyWithGrad { vocab } if *vocab > i32::MAX as u64 => {
            Err(format!("vocab {vocab} does not fit in i32"))
        }
        Op::LayerNorm { eps } if !(eps.is_finite() && *eps > 0.0) => Err(format!("layernorm eps must be positive, found {eps}")),
        Op::AdamW { eps, weight_decay, .. } if !eps.is_finite() || !weight_decay.is_finite() => {
            Err("adamw eps and weight_decay must be finite".to_string())
        }
        Op::Gemm(gm) if !gm.out.is_float() => Err(format!("gemm result dtype must be a float type, found {}", gm.out)),
        _ => Ok(()),
    }
}

/// Guards against arithmetic the type rules would overflow on (concat sums its axis lengths).
fn concat_len_fits(tys: &[&Type], axis: usize) -> bool {
    let mut total = 0u64;
    for t in tys {
        if let Some(n) = t.shape.0.get(axis).and_then(|d| d.as_lit()) {
            match total.checked_add(n) {
                Some(s) => total = s,
                None => return false,
            }
        }
    }
    true
}
