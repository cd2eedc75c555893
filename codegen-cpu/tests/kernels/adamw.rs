//! The multi-tensor AdamW kernel: against the interpreter, and its bf16 weight copies (rounded
//! in native code after each block of rows) against the rounded f32 results.

use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::{BinaryOp, DType, Dim, Kernel, Op};

use super::harness::*;

/// A multi-tensor AdamW kernel over parameters of `shapes` (the second with a gradient
/// accumulation prologue, the first without weight decay), with bf16 weight copies if `copies`:
/// the kernel, the inputs that must be positive, and (copy result, old copy operand) pairs.
fn adamw_kernel(shapes: Vec<Vec<Dim>>, copies: bool) -> (Kernel, Vec<usize>, Vec<(usize, usize)>) {
    let mut k = Body::new();
    let lr = k.input(DType::F32, &[]);
    let bc1 = k.input(DType::F32, &[]);
    let bc2 = k.input(DType::F32, &[]);
    let (mut outs, mut positive, mut pairs) = (vec![], vec![1, 2], vec![]);
    for (i, shape) in shapes.into_iter().enumerate() {
        let p = k.input(DType::F32, &shape);
        let mut g = k.input(DType::F32, &shape);
        if i == 1 {
            let g2 = k.input(DType::F32, &shape);
            g = k.bin(BinaryOp::Add, g, g2);
        }
        let m = k.input(DType::F32, &shape);
        let v = k.input(DType::F32, &shape);
        positive.push(k.n_in - 1);
        let mut ins = vec![p, g, m, v, lr, bc1, bc2];
        if copies {
            ins.push(k.input(DType::BF16, &shape));
            pairs.push((outs.len() + 3, k.n_in - 1));
        }
        let wd = if i == 0 { 0.0 } else { 0.1 };
        outs.extend(k.g.add(Op::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: wd }, &ins));
    }
    (k.kernel("adamw", &outs), positive, pairs)
}

/// The multi-tensor AdamW kernel: three parameters of different shapes, one with a gradient
/// accumulation prologue; shared lr and bias corrections; results in place semantics aside.
#[test]
fn adamw_multi_tensor() {
    let mut c = KernelCompiler::new().unwrap();
    let (kernel, positive, _) = adamw_kernel(vec![vec![l(37)], vec![l(6), l(64)], vec![l(5), l(3), l(7)]], false);
    let b = bind(1, 1);
    let mut ins = random_inputs(&kernel, &b, 13, 1, &positive);
    ins[0].data[0] = 1e-3;
    check(&mut c, &kernel, &b, &ins);
}

/// AdamW writing bf16 copies of its parameters (as `--precision bf16` runs it): the copies are
/// rounded after each block of rows in native code, not in the generated loop, and are exactly
/// the f32 results rounded to bf16 (nearest, ties to even, NaN quiet), at every thread count, in
/// place over the old copies as the memory planner puts them.
#[test]
fn adamw_bf16_copies_are_the_rounded_results() {
    let mut c = KernelCompiler::new().unwrap();
    let shapes = vec![vec![l(37)], vec![l(300), l(64)], vec![l(5), l(3), l(7)], vec![l(2), l(20000)]];
    let (kernel, positive, copies) = adamw_kernel(shapes, true);
    let b = bind(1, 1);
    let mut ins = random_inputs(&kernel, &b, 31, 1, &positive);
    ins[0].data[0] = 1e-3;
    check(&mut c, &kernel, &b, &ins);
    // A NaN and an infinite gradient (NaN parameters after the step) for the rounding below.
    ins[4].data[3] = f64::NAN;
    ins[4].data[5] = f64::INFINITY;
    let ck = c.compile(&kernel, &b).unwrap();
    assert_eq!(ck.native_narrows(), 4, "every copy is rounded after its blocks of rows");
    assert!(ck.clif.contains("4 bf16 copies of f32 results are rounded natively"), "the dump says so:\n{}", ck.clif);
    for threads in [1, 2] {
        for got in [execute(&ck, &kernel, &b, &ins, threads), execute_in_place(&ck, &kernel, &b, &ins, &copies, threads)] {
            for &(copy, _) in &copies {
                let (p, h) = (&got[copy - 3], &got[copy]);
                for (i, (&x, &y)) in p.data.iter().zip(&h.data).enumerate() {
                    let want = fusec_ir::interp::round_to(DType::BF16, x);
                    assert!(want.to_bits() == y.to_bits() || (want.is_nan() && y.is_nan()), "result {copy}[{i}]: {y} is not {x} rounded ({want})");
                }
                assert!(p.data.iter().any(|x| x.is_nan()) == (copy == 3), "the NaN gradient reaches the first parameter only");
            }
        }
    }
}
