//! The reference interpreter: naive, obviously-correct loops over the unfused IR. It is the
//! oracle every pass and backend is compared against, so it favours clarity over speed (it only
//! avoids per-element allocation and lookups).
//!
//! Every tensor stores its elements as `f64` whatever its dtype. In [`Rounding::F32`] each op
//! computes in `f64` and then rounds every result element to its declared dtype (f32, bf16 and
//! f16 round to nearest, ties to even; i32 values are exact integers). Reductions and
//! contractions therefore accumulate in `f64` and round once, which is at least as accurate as
//! the f32 accumulation backends and llm.c use. In [`Rounding::F64`] float results are never
//! rounded (i32 stays integer), which makes finite-difference checks meaningful.
//!
//! The fused ops are defined by what they replace: `gemm` rounds after each step of its
//! epilogue exactly as the separate nodes would, and `kernel` runs its body through the same
//! run loop, so a fused graph and its unfused form agree bit for bit in both precisions.

mod composite;
mod elementwise;
mod fused;
mod layout;
mod reduce;

use std::collections::HashMap;
use std::fmt;

use crate::rng::Rng;
use crate::verify::verify;
use crate::{Bindings, DType, Graph, Op, Type};

/// How the interpreter rounds float results (the mixed-precision *policy* is
/// `fusec_passes::amp::Precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rounding {
    /// Round every result to its declared dtype (the semantics backends implement).
    F32,
    /// Keep every float result in f64 (for finite differences and error analysis).
    F64,
}

/// A dense row-major tensor; elements are held as `f64` for every dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// The declared element type (what the values are rounded to).
    pub dtype: DType,
    /// Concrete dims, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` elements in row-major order.
    pub data: Vec<f64>,
}

impl Tensor {
    /// A tensor from its parts; panics if `data` does not have the shape's element count.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<f64>) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "tensor data does not match shape {shape:?}");
        Tensor { dtype, shape, data }
    }
    /// All zeros.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        Tensor { dtype, shape, data: vec![0.0; n] }
    }
    /// A rank-0 tensor holding `v`.
    pub fn scalar(dtype: DType, v: f64) -> Tensor {
        Tensor { dtype, shape: vec![], data: vec![v] }
    }
    /// An f32 tensor from f32 values.
    pub fn from_f32(shape: Vec<usize>, v: &[f32]) -> Tensor {
        Tensor::new(DType::F32, shape, v.iter().map(|&x| x as f64).collect())
    }
    /// An i32 tensor from i32 values.
    pub fn from_i32(shape: Vec<usize>, v: &[i32]) -> Tensor {
        Tensor::new(DType::I32, shape, v.iter().map(|&x| x as f64).collect())
    }
    /// The elements as f32 (rounded to nearest).
    pub fn to_f32(&self) -> Vec<f32> {
        self.data.iter().map(|&x| x as f32).collect()
    }
    /// The elements as i32 (truncated; meant for i32 tensors).
    pub fn to_i32(&self) -> Vec<i32> {
        self.data.iter().map(|&x| x as i32).collect()
    }
    /// The element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Random contents: standard normal values rounded to `dtype` for floats, uniform integers in
    /// `0..int_hi` for i32 (`int_hi` ≥ 1; e.g. the table size for gather indices).
    pub fn random(rng: &mut Rng, shape: Vec<usize>, dtype: DType, int_hi: u64) -> Tensor {
        let n = shape.iter().product();
        let data = (0..n).map(|_| if dtype.is_float() { round_to(dtype, rng.normal()) } else { rng.below(int_hi.max(1)) as f64 }).collect();
        Tensor { dtype, shape, data }
    }
    /// Checks `|self - reference| <= atol + rtol * |reference|` elementwise (NaN never passes,
    /// equal infinities do); the error names the worst element.
    pub fn check_close(&self, reference: &Tensor, atol: f64, rtol: f64) -> Result<(), String> {
        if self.shape != reference.shape || self.dtype != reference.dtype {
            return Err(format!("type {}{:?} differs from reference {}{:?}", self.dtype, self.shape, reference.dtype, reference.shape));
        }
        let mut worst: Option<(usize, f64)> = None;
        for (i, (&a, &r)) in self.data.iter().zip(&reference.data).enumerate() {
            let ok = a == r || (a - r).abs() <= atol + rtol * r.abs();
            if !ok {
                let excess = if (a - r).is_nan() { f64::INFINITY } else { (a - r).abs() / (atol + rtol * r.abs()) };
                if worst.is_none_or(|(_, w)| excess > w) {
                    worst = Some((i, excess));
                }
            }
        }
        match worst {
            None => Ok(()),
            Some((i, _)) => {
                Err(format!("element {i} is {} but the reference is {} (atol {atol}, rtol {rtol})", self.data[i], reference.data[i]))
            }
        }
    }
}

/// A failed evaluation: the node it happened at (index into [`Graph::nodes`]) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterpError {
    /// The node being evaluated, or `None` for problems with the graph or its feeds as a whole.
    pub node: Option<usize>,
    /// What went wrong.
    pub msg: String,
}

impl fmt::Display for InterpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.node {
            Some(n) => write!(f, "node {n}: {}", self.msg),
            None => f.write_str(&self.msg),
        }
    }
}

impl std::error::Error for InterpError {}

/// Runs `g` and returns its outputs in `g.outputs` order. `feeds` holds every `Param` and
/// `Input` by name, each exactly of its declared dtype and (bound) shape.
pub fn run(g: &Graph, bindings: &Bindings, feeds: &HashMap<String, Tensor>, prec: Rounding) -> Result<Vec<Tensor>, InterpError> {
    check_graph(g)?;
    run_outputs(g, bindings, Feeds::Named(feeds), prec)
}

/// Runs `g` and returns every value, indexed by [`crate::ValueId`] (for debugging and for
/// comparing graphs before and after a pass).
pub fn run_all(g: &Graph, bindings: &Bindings, feeds: &HashMap<String, Tensor>, prec: Rounding) -> Result<Vec<Tensor>, InterpError> {
    check_graph(g)?;
    let vals = execute(g, bindings, Feeds::Named(feeds), prec, |_, _| {})?;
    Ok(vals.into_iter().map(|v| v.expect("every value was computed")).collect())
}

/// Where the sources of a graph get their values.
#[derive(Clone, Copy)]
enum Feeds<'a> {
    /// Params and inputs by name (a whole graph).
    Named(&'a HashMap<String, Tensor>),
    /// The `k`-th `input` node receives the `k`-th tensor (a kernel body and its operands).
    Ordered(&'a [&'a Tensor]),
}

/// Runs a verified graph, dropping each value after its last use; returns the outputs.
fn run_outputs(g: &Graph, bindings: &Bindings, feeds: Feeds, prec: Rounding) -> Result<Vec<Tensor>, InterpError> {
    let mut last_use = vec![usize::MAX; g.values.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        for v in &n.inputs {
            last_use[v.0 as usize] = i;
        }
    }
    let mut keep = vec![false; g.values.len()];
    for (_, v) in &g.outputs {
        keep[v.0 as usize] = true;
    }
    let vals = execute(g, bindings, feeds, prec, |node, vals| {
        for v in &g.nodes[node].inputs {
            let v = v.0 as usize;
            if last_use[v] == node && !keep[v] {
                vals[v] = None;
            }
        }
    })?;
    Ok(g.outputs.iter().map(|(_, v)| vals[v.0 as usize].clone().expect("output was computed")).collect())
}

/// Runs the body of a kernel on its operands (the body was verified with its kernel).
pub(super) fn run_body(body: &Graph, bindings: &Bindings, ins: &[&Tensor], prec: Rounding) -> Result<Vec<Tensor>, InterpError> {
    run_outputs(body, bindings, Feeds::Ordered(ins), prec)
}

/// Random feeds for every `Param` and `Input` of `g` (see [`Tensor::random`]; i32 values lie in
/// `0..int_hi`).
pub fn random_feeds(g: &Graph, bindings: &Bindings, rng: &mut Rng, int_hi: u64) -> Result<HashMap<String, Tensor>, String> {
    let mut feeds = HashMap::new();
    for n in &g.nodes {
        if let Op::Param { name, ty } | Op::Input { name, ty } = &n.op {
            feeds.insert(name.clone(), Tensor::random(rng, concrete_shape(ty, bindings)?, ty.dtype, int_hi));
        }
    }
    Ok(feeds)
}

/// The largest element count the interpreter will allocate for one tensor.
const MAX_NUMEL: usize = 1 << 31;

/// The concrete shape of `ty` under `b`, refusing unbound symbols, zero dims and absurd sizes.
pub fn concrete_shape(ty: &Type, b: &Bindings) -> Result<Vec<usize>, String> {
    let s = ty.shape.eval(b)?;
    if s.contains(&0) {
        return Err(format!("type {} has a zero dim under the bindings (zero-size tensors are not allowed)", ty.shape.bind(b)));
    }
    let n = s.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    match n {
        Some(n) if n <= MAX_NUMEL => Ok(s),
        _ => Err(format!("type {} is too large under the bindings ({s:?})", ty.shape.bind(b))),
    }
}

/// The interpreter only runs graphs that verify.
fn check_graph(g: &Graph) -> Result<(), InterpError> {
    verify(g).map_err(|e| InterpError { node: e.node, msg: format!("graph does not verify: {e}") })
}

/// Evaluates the nodes of a verified graph in order; `after_node` may drop dead values.
fn execute(
    g: &Graph,
    bindings: &Bindings,
    feeds: Feeds,
    prec: Rounding,
    mut after_node: impl FnMut(usize, &mut Vec<Option<Tensor>>),
) -> Result<Vec<Option<Tensor>>, InterpError> {
    let mut vals: Vec<Option<Tensor>> = vec![None; g.values.len()];
    let mut next_input = 0usize;
    for (i, node) in g.nodes.iter().enumerate() {
        let err = |msg: String| InterpError { node: Some(i), msg: format!("`{}`: {msg}", node.op.mnemonic()) };
        let outs: Vec<(DType, Vec<usize>)> = node
            .results
            .iter()
            .map(|r| {
                let ty = &g.values[r.0 as usize].ty;
                concrete_shape(ty, bindings).map(|s| (ty.dtype, s))
            })
            .collect::<Result<_, _>>()
            .map_err(&err)?;
        let results = match &node.op {
            Op::Param { name, .. } | Op::Input { name, .. } => {
                let t = match feeds {
                    Feeds::Named(m) => m.get(name),
                    Feeds::Ordered(ts) if matches!(node.op, Op::Input { .. }) => {
                        next_input += 1;
                        ts.get(next_input - 1).copied()
                    }
                    Feeds::Ordered(_) => None,
                };
                let t = t.ok_or_else(|| err(format!("no feed for `{name}`")))?;
                vec![check_feed(name, t, &outs[0], prec).map_err(&err)?]
            }
            op => {
                let ins: Vec<&Tensor> = node.inputs.iter().map(|v| vals[v.0 as usize].as_ref().expect("operand computed")).collect();
                match op {
                    Op::Kernel(k) => fused::kernel(k, &ins, bindings, prec).map_err(&err)?,
                    _ => eval(op, &ins, &outs, prec).map_err(&err)?,
                }
            }
        };
        for (j, (mut t, (dtype, shape))) in results.into_iter().zip(outs).enumerate() {
            if t.shape != shape || t.dtype != dtype || t.data.len() != t.numel() {
                return Err(err(format!("internal error: result {j} is {}{:?}, declared {dtype}{shape:?}", t.dtype, t.shape)));
            }
            if prec == Rounding::F32 && dtype.is_float() {
                round_slice(dtype, &mut t.data);
            }
            vals[node.results[j].0 as usize] = Some(t);
        }
        after_node(i, &mut vals);
    }
    Ok(vals)
}

fn check_feed(name: &str, t: &Tensor, (dtype, shape): &(DType, Vec<usize>), prec: Rounding) -> Result<Tensor, String> {
    if t.dtype != *dtype || t.shape != *shape {
        return Err(format!("feed `{name}` is {}{:?} but is declared {dtype}{shape:?}", t.dtype, t.shape));
    }
    if t.data.len() != t.numel() {
        return Err(format!("feed `{name}` holds {} elements for shape {:?}", t.data.len(), t.shape));
    }
    if *dtype == DType::I32 {
        if let Some(x) = t.data.iter().find(|x| x.fract() != 0.0 || **x < i32::MIN as f64 || **x > i32::MAX as f64) {
            return Err(format!("feed `{name}` holds {x}, which is not an i32"));
        }
    }
    let mut t = t.clone();
    if prec == Rounding::F32 && dtype.is_float() {
        round_slice(*dtype, &mut t.data);
    }
    Ok(t)
}

/// Evaluates one non-feed op on concrete inputs; `outs` are the declared result dtypes and
/// shapes. Results are not yet rounded.
fn eval(op: &Op, ins: &[&Tensor], outs: &[(DType, Vec<usize>)], prec: Rounding) -> Result<Vec<Tensor>, String> {
    use Op::*;
    let out = |k: usize| outs[k].clone();
    let one = |t: Tensor| Ok(vec![t]);
    match op {
        Param { .. } | Input { .. } => unreachable!("sources are fed"),
        Const { value, .. } => {
            let (dtype, shape) = out(0);
            let v = if prec == Rounding::F32 || dtype == DType::I32 { round_to(dtype, *value) } else { *value };
            let n = shape.iter().product();
            one(Tensor { dtype, shape, data: vec![v; n] })
        }
        Iota { axis, .. } => one(elementwise::iota(*axis, out(0))),
        Unary(u) => one(elementwise::unary(*u, ins[0])),
        Binary(b) => elementwise::binary(*b, ins[0], ins[1]).map(|t| vec![t]),
        Compare(c) => one(elementwise::compare(*c, ins[0], ins[1])),
        Select => one(elementwise::select(ins[0], ins[1], ins[2])),
        Cast { to } => elementwise::cast(ins[0], *to).map(|t| vec![t]),
        Gelu => one(elementwise::gelu(ins[0])),
        GeluGrad => one(elementwise::gelu_grad(ins[0], ins[1])),
        Reshape { .. } => one(Tensor { dtype: ins[0].dtype, shape: out(0).1, data: ins[0].data.clone() }),
        Broadcast { dims, .. } => one(layout::broadcast(ins[0], dims, out(0).1)),
        Permute { perm } => one(layout::permute(ins[0], perm)),
        Slice { axis, start, end } => one(layout::slice(ins[0], *axis, *start as usize, *end as usize)),
        Concat { axis } => one(layout::concat(ins, *axis)),
        Gather => layout::gather(ins[0], ins[1]).map(|t| vec![t]),
        ScatterAdd { .. } => layout::scatter_add(ins[0], ins[1], out(0).1[0]).map(|t| vec![t]),
        Reduce { op, axes } => one(reduce::reduce(*op, ins[0], axes)),
        MatMul { trans_a, trans_b } => one(reduce::matmul(ins[0], ins[1], *trans_a, *trans_b, out(0).1)),
        LayerNorm { eps } => Ok(composite::layernorm(ins[0], ins[1], ins[2], *eps)),
        LayerNormGrad => Ok(composite::layernorm_grad(ins[0], ins[1], ins[2], ins[3], ins[4])),
        Softmax => one(composite::softmax(ins[0])),
        AllReduce | FromOwners { .. } => Ok(ins.iter().map(|t| (*t).clone()).collect()),
        SoftmaxGrad => one(composite::softmax_grad(ins[0], ins[1])),
        CrossEntropy { vocab } => composite::cross_entropy(ins[0], ins[1], *vocab as usize).map(|t| vec![t]),
        CrossEntropyGrad { vocab } => composite::cross_entropy_grad(ins[0], ins[1], ins[2], *vocab as usize).map(|t| vec![t]),
        CrossEntropyWithGrad { vocab } => Ok(vec![
            composite::cross_entropy(ins[0], ins[1], *vocab as usize)?,
            composite::cross_entropy_grad(ins[0], ins[1], ins[2], *vocab as usize)?,
        ]),
        Attention { heads, scale } => Ok(composite::attention_packed(ins[0], *heads as usize, *scale)),
        AttentionGrad { heads, scale } => Ok(vec![composite::attention_grad_packed(ins, *heads as usize, *scale)]),
        AdamW { beta1, beta2, eps, weight_decay } => Ok(composite::adamw(ins, [*beta1, *beta2, *eps, *weight_decay], prec)),
        Gemm(gm) => fused::gemm(gm, ins, outs, prec),
        Kernel(_) => unreachable!("kernels are run by `execute`"),
    }
}

/// `x` rounded to `dtype`: f32, bf16 and f16 round to nearest with ties to even (overflow gives
/// infinity, NaN stays NaN); i32 rounds to the nearest integer (ties to even) without clamping.
pub fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        // bf16: 7 fraction bits, exponents -126..=127. f16: 10 fraction bits, -14..=15.
        DType::BF16 => match x as f32 {
            // An f32 value (parameters, every f32 result): RNE on its bits, 50x faster.
            f if f as f64 == x => bf16_of_f32(f) as f64,
            _ => round_binary(x, 7, -126, 127),
        },
        DType::F16 => round_binary(x, 10, -14, 15),
        DType::I32 => x.round_ties_even(),
    }
}

/// `f` rounded to bf16 (nearest, ties to even; NaN stays NaN), as an f32: what the CUDA
/// prelude's `f32_to_bf16` computes.
pub fn bf16_of_f32(f: f32) -> f32 {
    if f.is_nan() {
        return f;
    }
    let u = f.to_bits();
    f32::from_bits(u.wrapping_add(0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
}

pub(super) fn round_slice(dtype: DType, xs: &mut [f64]) {
    for x in xs {
        *x = round_to(dtype, *x);
    }
}

/// Rounds `x` to a binary format with `frac` fraction bits and normal exponents `emin..=emax`
/// (with gradual underflow), to nearest, ties to even. Done directly from f64 (not via f32) so
/// there is no double rounding.
fn round_binary(x: f64, frac: i32, emin: i32, emax: i32) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let biased = ((x.to_bits() >> 52) & 0x7ff) as i32;
    let e = (biased - 1023).max(emin); // f64 subnormals are far below emin.
    let quantum = 2f64.powi(e - frac);
    // Scaling by a power of two is exact; round_ties_even is the RNE step.
    let r = (x / quantum).round_ties_even() * quantum;
    if r.abs() >= 2f64.powi(emax + 1) {
        f64::INFINITY.copysign(x)
    } else {
        r
    }
}

/// Row-major strides of `shape`.
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Gathers `src[base + Σ idx_i * strides[i]]` for every index of `shape` in row-major order.
pub(crate) fn strided_copy(shape: &[usize], strides: &[usize], base: usize, src: &[f64]) -> Vec<f64> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let Some((&last, outer)) = shape.split_last() else {
        out.push(src[base]);
        return out;
    };
    let s_last = strides[shape.len() - 1];
    let mut idx = vec![0usize; outer.len()];
    let mut off = base;
    loop {
        for k in 0..last {
            out.push(src[off + k * s_last]);
        }
        // Advance the odometer over the outer axes.
        let mut ax = outer.len();
        loop {
            if ax == 0 {
                return out;
            }
            ax -= 1;
            idx[ax] += 1;
            off += strides[ax];
            if idx[ax] < outer[ax] {
                break;
            }
            off -= strides[ax] * idx[ax];
            idx[ax] = 0;
        }
    }
}
