//! Generation of the fused ops: `gemm` with random epilogues and `kernel` around a small random
//! elementwise / reduction body.

use super::Gen;
use crate::infer::result_types;
use crate::{DType, Gemm, Graph, Kernel, Op, Shape, Type};

/// The step kinds (see `Gen::step_kind`) a kernel body is made of: unary, binary, compare,
/// select, cast, broadcast, reductions, GELU (and its gradient) or softmax, layernorm.
const BODY_STEPS: [u64; 12] = [0, 1, 2, 3, 4, 6, 10, 11, 15, 16, 17, 30];

impl Gen<'_> {
    /// A `gemm` with random flags: any transposes, batched or shared `b`, any subset of bias,
    /// GELU and accumulate, and a result dtype that is the operands' or another float type.
    pub(super) fn gemm(&mut self) {
        let (trans_a, trans_b, a, b) = self.matmul_operands();
        let mm = result_types(&Op::MatMul { trans_a, trans_b }, &[self.g.ty(a), self.g.ty(b)])
            .expect("matmul_operands gives well-typed operands")
            .remove(0);
        let (bias, gelu, accumulate) = (self.rng.chance(0.5), self.rng.chance(0.5), self.rng.chance(0.5));
        let out = match self.rng.below(4) {
            0 | 1 => mm.dtype,
            2 => DType::BF16,
            _ => self.fdtype(),
        };
        let mut ins = vec![a, b];
        if bias {
            let n = mm.shape.0.last().expect("matmul results have rank >= 2").clone();
            ins.push(self.value_of(&Type::new(mm.dtype, Shape::from(vec![n]))));
        }
        if accumulate {
            ins.push(self.value_of(&mm.with_dtype(out)));
        }
        self.g.add(Op::Gemm(Gemm { trans_a, trans_b, bias, gelu, out, accumulate }), &ins);
    }

    /// A `kernel` whose body is a few random elementwise and reduction nodes over one or two
    /// inputs (often typed like existing values), named after the body's ops; its operands are
    /// values of the body inputs' types.
    pub(super) fn kernel(&mut self) {
        let outer: Vec<Type> = self.g.values.iter().map(|v| v.ty.clone()).collect();
        let body_graph = Graph { name: String::new(), syms: self.g.syms.clone(), ..Graph::default() };
        let mut sub = Gen { rng: &mut *self.rng, o: self.o.clone(), g: body_graph, serial: self.serial, body: true };
        for _ in 0..1 + sub.rng.below(2) {
            let ty = if !outer.is_empty() && sub.rng.chance(0.7) {
                outer[sub.rng.below(outer.len() as u64) as usize].clone()
            } else {
                let (d, r) = (sub.fdtype(), sub.rank(0, 3));
                Type::new(d, sub.shape(r))
            };
            let name = sub.name("x");
            sub.g.add1(Op::Input { name, ty }, &[]);
        }
        for _ in 0..1 + sub.rng.below(4) {
            let k = sub.pick(&BODY_STEPS);
            sub.step_kind(k);
        }
        let n_out = 1 + sub.rng.below(2);
        sub.outputs(n_out, "y");
        let (mut body, serial) = (sub.g, sub.serial);
        self.serial = serial;
        body.name = kernel_name(&body);
        let ins: Vec<_> = body.inputs().into_iter().map(|(_, v)| body.ty(v).clone()).collect();
        let ins: Vec<_> = ins.iter().map(|t| self.value_of(t)).collect();
        let name = body.name.clone();
        self.g.add(Op::Kernel(Box::new(Kernel { name, body })), &ins);
    }
}

/// A kernel name from the mnemonics of its body's compute nodes, in order (repeats merged, at
/// most four): `add_tanh`, `reduce_sum_exp`; `copy` when it has none.
pub(crate) fn kernel_name(body: &Graph) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for n in &body.nodes {
        let m = n.op.mnemonic();
        if !n.op.is_source() && parts.last() != Some(&m) && parts.len() < 4 {
            parts.push(m);
        }
    }
    if parts.is_empty() {
        "copy".to_string()
    } else {
        parts.join("_")
    }
}
