//! `amp`: the mixed-precision policy, off unless `--precision bf16` (or `bf16+residual`).
//!
//! Like PyTorch's autocast, each op kind has a rule, and the rules are one table ([`POLICY`],
//! which `fusec dump --pass amp` prints above the graph):
//!
//! - **product** (`matmul`): bf16 operands, fp32 accumulation, a bf16 result — the activations
//!   (qkv, fc pre-activation, logits, activation gradients) are stored in bf16. A parameter
//!   gradient (a product that reaches an `adamw` or a `grad.P` output through adds and scales,
//!   or that is added to a graph input) is emitted as `gemm {out = f32}`: f32 accumulation and
//!   result, never rounded to bf16 — except under `bf16+residual` a fresh gradient that only its
//!   update reads (no accumulator, other contribution, clipping or all-reduce), which is stored
//!   in bf16 as llm.c stores gradients and widened inside the update. A reader that computes in
//!   f32 widens a bf16 product itself (inside its kernel: the product is stored once, in bf16).
//! - **bf16** (`attention`, `attention_grad`): q, k, v, out, dout and dqkv in bf16; the
//!   softmax statistics are f32 by the op's type rule.
//! - **f32** (LayerNorm and its gradient, softmax, cross-entropy, reductions, gather, scatter,
//!   AdamW): bf16 operands are widened — statistics, the loss, bias gradients, master weights
//!   and optimizer state stay f32. A LayerNorm output is f32 in the graph but only its bf16
//!   cast, made for the product that reads it, outlives the fused kernel.
//! - **follow** (elementwise ops, `gelu`, `gelu_grad`, views): the operands' type, so a bias
//!   add and GELU on a bf16 product stay bf16 (a broadcast operand — the bias — follows the
//!   others). Where full-size operands differ (the residual stream adding a bf16 projection to
//!   its f32 self), the residual policy decides: f32 as autocast does (`bf16`), or bf16 as
//!   llm.c does (`bf16+residual`, where LayerNorm's input gradient is narrowed too, so the
//!   stream's gradient is bf16 as well).
//!
//! **Weights.** In a training step whose AdamW writes a parameter back, the products read the
//! parameter's bf16 copy, a persistent input `bf16.P` (like `m.P`), and the update writes the
//! next copy in the same pass (`adamw`'s optional copy operand and result, output `bf16.P`);
//! the runtime fills the copies when it loads parameters. No weight is cast at each step.
//! Other programs (forward, gradients only) cast the weights they read.
//!
//! Each value is narrowed to bf16 once (through reshapes and broadcasts, so a weight is cast
//! before its transpose view and a bias before its broadcast); widening casts are made per use
//! so each fuses into its reader's kernel. Every cast is an explicit op — a rounding point that
//! fusion keeps. Graph outputs keep their declared dtypes.

use std::collections::{HashMap, HashSet};

use fusec_ir::{DType, Graph, Op, ValueId};

use crate::rewrite::{remove_dead_nodes, Copier, Uses};

/// The precision policies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Everything f32 (the pass does nothing).
    #[default]
    F32,
    /// bf16 activations and products, an f32 residual stream (autocast's choice).
    Bf16,
    /// As `Bf16`, with the residual stream and its gradient in bf16 too, and fresh weight
    /// gradients stored in bf16 (llm.c's choices).
    Bf16Residual,
}

impl Precision {
    /// The names `--precision` accepts, in order.
    pub const NAMES: [&'static str; 3] = ["fp32", "bf16", "bf16+residual"];

    /// Whether products and activations are bf16.
    pub fn is_bf16(self) -> bool {
        self != Precision::F32
    }

    /// The name `--precision` takes for it.
    pub fn name(self) -> &'static str {
        Precision::NAMES[self as usize]
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "fp32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "bf16+residual" => Ok(Precision::Bf16Residual),
            _ => Err(format!("unknown precision `{s}`; expected one of: {}", Precision::NAMES.join(", "))),
        }
    }
}

/// What an op kind does with its float operands and results under bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// bf16 operands, fp32 accumulation, bf16 result (f32 when accumulated into f32 state).
    Product,
    /// bf16 operands and tensor results (statistics f32 by the op's type).
    Bf16,
    /// f32 operands and results.
    F32,
    /// The operands' type; differing full-size operands follow the residual policy.
    Follow,
}

/// The policy table: op mnemonics and their rule, and why. Ops not listed follow their
/// operands ([`Rule::Follow`]); sources (`param`, `input`, `const`, `iota`) keep their types.
pub const POLICY: &[(&[&str], Rule, &str)] = &[
    (&["matmul"], Rule::Product, "tensor-core products; activations stored bf16, weight gradients f32 (bf16+residual: fresh ones bf16)"),
    (&["attention", "attention_grad"], Rule::Bf16, "q, k, v, out and their gradients stored bf16; lse f32"),
    (&["layernorm", "layernorm_grad"], Rule::F32, "statistics and normalization in f32"),
    (&["softmax", "softmax_grad", "cross_entropy", "cross_entropy_grad"], Rule::F32, "exponentials and the loss in f32"),
    (&["reduce_sum", "reduce_max"], Rule::F32, "sums (bias gradients, the loss) in f32"),
    (&["gather", "scatter_add"], Rule::F32, "embedding tables and their gradients are f32 master state"),
    (&["adamw"], Rule::F32, "master weights and moments in f32"),
];

/// The rule of `op`.
pub fn rule(op: &Op) -> Rule {
    let m = op.mnemonic();
    POLICY.iter().find(|(ops, _, _)| ops.contains(&m)).map_or(Rule::Follow, |&(_, r, _)| r)
}

/// The policy as `#` comment lines (printed by `fusec dump --pass amp`).
pub fn describe(p: Precision) -> String {
    let residual = if p == Precision::Bf16Residual { "bf16 and its gradient bf16 (llm.c)" } else { "f32 (autocast)" };
    let mut s = format!("# amp policy `{}`; residual stream: {residual}\n", p.name());
    for (ops, r, why) in POLICY {
        s += &format!("#   {:<58} {:<8} {why}\n", ops.join(", "), format!("{r:?}").to_lowercase());
    }
    s + "#   (other ops)                                                follow   the operands' type\n"
}

/// The prefix of the persistent bf16 copies of parameters (`bf16.wte`).
pub const COPY_PREFIX: &str = "bf16.";

/// The graph being rebuilt and the casts made so far.
struct Amp<'g> {
    c: Copier<'g>,
    /// The bf16 copy of each new value narrowed so far.
    narrowed: HashMap<ValueId, ValueId>,
    /// Parameters whose AdamW update (not yet copied) is written back: their copy inputs.
    copyable: HashMap<String, Option<ValueId>>,
}

impl Amp<'_> {
    fn dtype(&self, v: ValueId) -> DType {
        self.c.out.ty(v).dtype
    }

    /// `v` (a new value) in dtype `to`: itself, or a cast. Narrowing walks reshapes and
    /// broadcasts back to their source and casts it once; widening casts per use.
    fn convert(&mut self, v: ValueId, to: DType) -> Result<ValueId, String> {
        let from = self.dtype(v);
        if from == to || !from.is_float() {
            return Ok(v);
        }
        if to != DType::BF16 {
            return self.c.out.try_add(Op::Cast { to }, &[v]).map(|r| r[0]);
        }
        // The views from `v` back to a value with a copy, or to one that is no view.
        let mut chain: Vec<(ValueId, Op)> = Vec::new();
        let mut cur = v;
        let mut copy = loop {
            if let Some(&c) = self.narrowed.get(&cur) {
                break c;
            }
            let p = self.c.out.producer(cur);
            match (&p.op, p.inputs.first()) {
                (Op::Reshape { .. } | Op::Broadcast { .. }, Some(&src)) => {
                    chain.push((cur, p.op.clone()));
                    cur = src;
                }
                (Op::Param { name, ty }, _) if self.copyable.contains_key(name) => {
                    let (param, shape) = (name.clone(), ty.shape.clone());
                    let input = Op::Input { name: format!("{COPY_PREFIX}{param}"), ty: fusec_ir::Type::new(to, shape) };
                    let c = self.c.out.try_add(input, &[])?[0];
                    self.copyable.insert(param, Some(c));
                    self.narrowed.insert(cur, c);
                    break c;
                }
                _ => {
                    let c = self.c.out.try_add(Op::Cast { to }, &[cur])?[0];
                    self.narrowed.insert(cur, c);
                    break c;
                }
            }
        };
        for (old, op) in chain.into_iter().rev() {
            copy = self.c.out.try_add(op, &[copy])?[0];
            self.narrowed.insert(old, copy);
        }
        Ok(copy)
    }

    /// The dtype a `Follow` op computes in: that of its float operands, a broadcast operand
    /// following the others; where full-size operands differ, `residual`.
    fn follow(&self, ins: &[ValueId], residual: DType) -> Option<DType> {
        let floats: Vec<ValueId> = ins.iter().copied().filter(|&v| self.dtype(v).is_float()).collect();
        let full: Vec<DType> =
            floats.iter().filter(|&&v| !matches!(self.c.out.producer(v).op, Op::Broadcast { .. })).map(|&v| self.dtype(v)).collect();
        let pick = if full.is_empty() { floats.iter().map(|&v| self.dtype(v)).collect() } else { full };
        let first = *pick.first()?;
        Some(if pick.iter().all(|&d| d == first) { first } else { residual })
    }
}

fn param_name(g: &Graph, v: ValueId) -> String {
    match &g.producer(v).op {
        Op::Param { name, .. } => name.clone(),
        _ => String::new(),
    }
}

/// The parameters of `g` that an `adamw` updates and `g` writes back (outputs under their own
/// name), when no name `bf16.P` is taken.
fn written_back(g: &Graph) -> HashMap<String, Option<ValueId>> {
    let taken = |n: &str| g.nodes.iter().any(|x| crate::rewrite::source_name(&x.op) == Some(n)) || g.output_named(n).is_some();
    let mut out = HashMap::new();
    for n in g.nodes.iter().filter(|n| matches!(n.op, Op::AdamW { .. }) && n.inputs.len() == 7) {
        if let Op::Param { name, .. } = &g.producer(n.inputs[0]).op {
            if g.output_named(name) == Some(n.results[0]) && !taken(&format!("{COPY_PREFIX}{name}")) {
                out.insert(name.clone(), None);
            }
        }
    }
    out
}

/// The products whose results become parameter gradients: those reached backwards from an
/// `adamw`'s gradient operand or a `grad.P` output through adds, scales, views, casts and
/// all-reduces (a gradient summed from several products, clipped, fresh without an
/// accumulator, or averaged over the ranks).
fn gradient_products(g: &Graph) -> HashSet<ValueId> {
    let mut stack: Vec<ValueId> = g.nodes.iter().filter(|n| matches!(n.op, Op::AdamW { .. })).map(|n| n.inputs[1]).collect();
    stack.extend(g.outputs.iter().filter(|(n, _)| n.starts_with("grad.")).map(|(_, v)| *v));
    let (mut seen, mut out) = (HashSet::new(), HashSet::new());
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        let p = g.producer(v);
        match p.op {
            Op::MatMul { .. } => {
                out.insert(v);
            }
            Op::Binary(fusec_ir::BinaryOp::Add | fusec_ir::BinaryOp::Mul)
            | Op::Reshape { .. }
            | Op::Broadcast { .. }
            | Op::Cast { .. }
            | Op::AllReduce => {
                stack.extend(p.inputs.iter().copied())
            }
            _ => {}
        }
    }
    out
}

/// Whether old value `v` is accumulated into f32 state: a graph output, or only ever added to
/// a graph input (a gradient accumulator).
fn accumulated(g: &Graph, uses: &Uses, v: ValueId) -> bool {
    let users = &uses.users[v.0 as usize];
    uses.is_output[v.0 as usize]
        || (!users.is_empty()
            && users.iter().all(|&u| {
                let n = &g.nodes[u];
                n.op == Op::Binary(fusec_ir::BinaryOp::Add) && n.inputs.iter().any(|&i| matches!(g.producer(i).op, Op::Input { .. }))
            }))
}

/// Whether old value `v` is only ever the gradient operand of `adamw` updates, through
/// reshapes: a fresh gradient that no other contribution, accumulator, clipping or all-reduce
/// reads, so it can be stored in bf16 (llm.c's gradients) and widened inside the update.
fn fresh_sole_gradient(g: &Graph, uses: &Uses, v: ValueId) -> bool {
    let users = &uses.users[v.0 as usize];
    !uses.is_output[v.0 as usize]
        && !users.is_empty()
        && users.iter().all(|&u| {
            let n = &g.nodes[u];
            match n.op {
                Op::AdamW { .. } => n.inputs[1] == v && n.inputs.iter().filter(|&&i| i == v).count() == 1,
                Op::Reshape { .. } => fresh_sole_gradient(g, uses, n.results[0]),
                _ => false,
            }
        })
}

/// Applies the policy; see the module docs.
pub fn amp(g: &Graph, policy: Precision) -> Result<Graph, String> {
    if policy == Precision::F32 {
        return Ok(g.clone());
    }
    let residual = if policy == Precision::Bf16Residual { DType::BF16 } else { DType::F32 };
    let uses = Uses::of(g);
    let grads = gradient_products(g);
    let mut a = Amp { c: Copier::new(g, "amp"), narrowed: HashMap::new(), copyable: written_back(g) };
    let mut copies: Vec<(String, ValueId)> = vec![];
    for n in &g.nodes {
        let ins = a.c.get_all(&n.inputs)?;
        if n.inputs.is_empty() || matches!(n.op, Op::Cast { .. } | Op::Gemm(_) | Op::Kernel(_)) {
            // Sources, explicit casts and already fused ops keep their declared types (fused
            // ops get their operands in the declared types back).
            let mut conv = ins.clone();
            if !matches!(n.op, Op::Cast { .. }) {
                for (v, old) in conv.iter_mut().zip(&n.inputs) {
                    *v = a.convert(*v, g.ty(*old).dtype)?;
                }
            }
            a.c.copy(n, &conv);
            continue;
        }
        let to = match rule(&n.op) {
            Rule::Product | Rule::Bf16 => Some(DType::BF16),
            Rule::F32 => Some(DType::F32),
            Rule::Follow => a.follow(&ins, residual),
        };
        let mut conv = Vec::with_capacity(ins.len());
        for (i, &v) in ins.iter().enumerate() {
            // Attention's statistics operand (`lse`) is f32 by type.
            let keep = matches!(n.op, Op::AttentionGrad { .. }) && i == 2;
            conv.push(match to {
                Some(d) if !keep => a.convert(v, d)?,
                _ => v,
            });
        }
        if let Op::AdamW { .. } = n.op {
            // The update of a parameter whose products read its copy writes the next copy.
            let name = param_name(g, n.inputs[0]);
            if let Some(copy) = a.copyable.remove(&name).flatten() {
                conv.push(copy);
            }
        }
        // A parameter gradient is a product with an f32 result (`gemm {out = f32}`): f32
        // accumulation, never rounded to bf16 — except, under `bf16+residual`, a fresh gradient
        // that only its update reads, which is stored in bf16 as llm.c stores gradients.
        let op = match n.op {
            Op::MatMul { trans_a, trans_b } if grads.contains(&n.results[0]) || accumulated(g, &uses, n.results[0]) => {
                let bf16 = policy == Precision::Bf16Residual && fresh_sole_gradient(g, &uses, n.results[0]);
                let out = if bf16 { DType::BF16 } else { g.ty(n.results[0]).dtype };
                Op::Gemm(fusec_ir::Gemm { trans_a, trans_b, bias: false, gelu: false, out, accumulate: false })
            }
            _ => n.op.clone(),
        };
        let mut rs = a.c.out.try_add(op, &conv).map_err(|e| format!("amp: `{}`: {e}", n.op.mnemonic()))?;
        if let (Op::AdamW { .. }, Some(&copy)) = (&n.op, rs.get(3)) {
            copies.push((format!("{COPY_PREFIX}{}", param_name(g, n.inputs[0])), copy));
        }
        if residual == DType::BF16 && n.op == Op::LayerNormGrad {
            // The residual stream's gradient is bf16 too (llm.c): LayerNorm's input gradient is
            // narrowed, so the adds that carry the stream's gradient stay bf16.
            rs[0] = a.convert(rs[0], DType::BF16)?;
        }
        for (&old, &new) in n.results.iter().zip(rs.iter()) {
            a.c.set(old, new);
        }
    }
    // Outputs keep their declared dtypes.
    for (_, v) in &g.outputs {
        let (new, want) = (a.c.get(*v)?, g.ty(*v).dtype);
        let back = a.convert(new, want)?;
        a.c.set(*v, back);
    }
    let mut out = a.c.finish()?;
    for (name, v) in copies {
        out.output(&name, v);
    }
    Ok(remove_dead_nodes(&out))
}
