//! `amp`: the mixed-precision policy, off unless `--precision bf16`.
//!
//! Matmul operands are cast to bf16 (f32 accumulation inside the matmul); each value is cast
//! once, so an activation that both a forward and a backward matmul read is kept in bf16 only.
//! The product is cast back to f32 at once: master weights, optimizer state, LayerNorm
//! statistics, softmax, attention and the loss stay f32. Every cast is an explicit op — a
//! rounding point that later fusion keeps (a gemm's `out` dtype is exactly such a cast).

use std::collections::HashMap;

use fusec_ir::{DType, Graph, Op, ValueId};

/// The precision policies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Everything f32 (the pass does nothing).
    #[default]
    F32,
    /// bf16 matmul operands, f32 everything else.
    Bf16,
}

/// Applies the policy; see the module docs.
pub fn amp(g: &Graph, policy: Precision) -> Result<Graph, String> {
    if policy == Precision::F32 {
        return Ok(g.clone());
    }
    let mut out = Graph::new(&g.name, &[]);
    out.syms = g.syms.clone();
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    let mut bf16_of: HashMap<ValueId, ValueId> = HashMap::new();
    for n in &g.nodes {
        let ins: Vec<ValueId> = n.inputs.iter().map(|v| map[v.0 as usize].expect("operands precede uses")).collect();
        if let Op::MatMul { .. } = n.op {
            if g.ty(n.results[0]).dtype == DType::F32 {
                let casts: Vec<ValueId> =
                    ins.iter().map(|&v| *bf16_of.entry(v).or_insert_with(|| out.add1(Op::Cast { to: DType::BF16 }, &[v]))).collect();
                let y = out.try_add(n.op.clone(), &casts)?[0];
                map[n.results[0].0 as usize] = Some(out.add1(Op::Cast { to: DType::F32 }, &[y]));
                continue;
            }
        }
        let tys = n.results.iter().map(|r| g.ty(*r).clone()).collect();
        for (old, new) in n.results.iter().zip(out.push_unchecked(n.op.clone(), &ins, tys)) {
            map[old.0 as usize] = Some(new);
        }
    }
    for (name, v) in &g.outputs {
        out.output(name, map[v.0 as usize].expect("outputs are defined"));
    }
    Ok(out)
}
