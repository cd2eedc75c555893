//! `amp`: the mixed-precision policy, off unless `--precision bf16`.
//!
//! Matmul operands are cast to bf16 (f32 accumulation inside the matmul); each value is cast
//! once, so an activation that both a forward and a backward matmul read is kept in bf16 only.
//! A reshaped operand is cast before the reshape (`cast(reshape(x))` → `reshape(cast(x))`), so
//! the `[B*T, C]` view a weight gradient reads shares the cast of the `[B, T, C]` value the
//! input gradient reads — the logits gradient of GPT-2 124M is 3.3 GB of f32.
//! The product is cast back to f32 at once: master weights, optimizer state, LayerNorm
//! statistics, softmax, attention and the loss stay f32. Every cast is an explicit op — a
//! rounding point that later fusion keeps (a gemm's `out` dtype is exactly such a cast).

use std::collections::HashMap;

use fusec_ir::{DType, Graph, Op, Shape, ValueId};

use crate::rewrite::Copier;

/// The precision policies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Everything f32 (the pass does nothing).
    #[default]
    F32,
    /// bf16 matmul operands, f32 everything else.
    Bf16,
}

impl Precision {
    /// The names `--precision` accepts, in order.
    pub const NAMES: [&'static str; 2] = ["fp32", "bf16"];
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "fp32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(format!("unknown precision `{s}`; expected one of: {}", Precision::NAMES.join(", "))),
        }
    }
}

/// The bf16 copy of `v` (made once): a reshape of the copy of what `v` reshapes, if it is a
/// reshape. Walks a chain of reshapes back to its source without recursion.
fn to_bf16(out: &mut Graph, bf16_of: &mut HashMap<ValueId, ValueId>, v: ValueId) -> Result<ValueId, String> {
    // The reshapes from `v` back to a value with a copy, or to a value that is no reshape.
    let mut chain: Vec<(ValueId, Shape)> = Vec::new();
    let mut cur = v;
    let mut copy = loop {
        if let Some(&c) = bf16_of.get(&cur) {
            break c;
        }
        let p = out.producer(cur);
        match (&p.op, p.inputs.first()) {
            (Op::Reshape { shape }, Some(&src)) => {
                chain.push((cur, shape.clone()));
                cur = src;
            }
            _ => {
                let c = out.try_add(Op::Cast { to: DType::BF16 }, &[cur])?[0];
                bf16_of.insert(cur, c);
                break c;
            }
        }
    };
    for (old, shape) in chain.into_iter().rev() {
        copy = out.try_add(Op::Reshape { shape }, &[copy])?[0];
        bf16_of.insert(old, copy);
    }
    Ok(copy)
}

/// Applies the policy; see the module docs.
pub fn amp(g: &Graph, policy: Precision) -> Result<Graph, String> {
    if policy == Precision::F32 {
        return Ok(g.clone());
    }
    let mut c = Copier::new(g, "amp");
    let mut bf16_of: HashMap<ValueId, ValueId> = HashMap::new();
    for n in &g.nodes {
        let ins = c.get_all(&n.inputs)?;
        if let (Op::MatMul { .. }, Some(&r)) = (&n.op, n.results.first()) {
            if g.ty(r).dtype == DType::F32 {
                let casts = ins.iter().map(|&v| to_bf16(&mut c.out, &mut bf16_of, v)).collect::<Result<Vec<ValueId>, String>>()?;
                let y = c.out.try_add(n.op.clone(), &casts)?[0];
                let back = c.out.try_add(Op::Cast { to: DType::F32 }, &[y])?[0];
                c.set(r, back);
                continue;
            }
        }
        c.copy(n, &ins);
    }
    c.finish()
}
