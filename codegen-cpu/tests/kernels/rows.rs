//! Long rows and the row-loop code paths: unrolled reductions at every remainder, NaN in a row
//! max, native `exp` / `tanh` against the generated code, one-hot picks and selects (target
//! logits, in and out of range), and cross-entropy / softmax on rows long enough for all of
//! them.

use fusec_codegen_cpu::isa::Isa;
use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::interp::Tensor;
use fusec_ir::rng::Rng;
use fusec_ir::{BinaryOp, CmpOp, DType, Op, ReduceOp, Shape, Type, UnaryOp};

use super::harness::*;

fn same_bits(a: &[Tensor], b: &[Tensor]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.data.iter().zip(&y.data).all(|(p, q)| (*p as f32).to_bits() == (*q as f32).to_bits()))
}

/// Row sums and maxima at every width around the unrolled loop's step (16 columns) and the
/// vector width (4): the loop, the remaining whole vectors and the scalar tail, each alone and
/// together; results against the interpreter and the same bits on 1 and 2 threads.
#[test]
fn row_reductions_at_every_remainder() {
    let mut c = KernelCompiler::new().unwrap();
    for cols in [1u64, 2, 3, 4, 5, 7, 8, 12, 15, 16, 17, 20, 28, 31, 32, 33, 36, 47, 48, 52, 64, 65, 100] {
        let d = [s("B"), s("T"), l(cols)];
        let mut k = Body::new();
        let x = k.input(DType::F32, &d);
        let sum = k.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![2] }, &[x]);
        let max = k.op(Op::Reduce { op: ReduceOp::Max, axes: vec![2] }, &[x]);
        let y = k.op(Op::Softmax, &[x]);
        let kernel = k.kernel("rows", &[sum, max, y]);
        let b = bind(3, 50);
        let ins = random_inputs(&kernel, &b, 40 + cols, 1, &[]);
        check(&mut c, &kernel, &b, &ins);
        let ck = c.compile(&kernel, &b).unwrap();
        assert!(same_bits(&execute(&ck, &kernel, &b, &ins, 1), &execute(&ck, &kernel, &b, &ins, 2)), "threads changed bits at C={cols}");
    }
}

/// A NaN anywhere in a row makes its max NaN (the vector max drops NaN; a flag restores it), in
/// each accumulator copy, the remaining vectors and the scalar tail; `-inf` rows stay `-inf`.
#[test]
fn row_max_propagates_nan() {
    let mut c = KernelCompiler::new().unwrap();
    let cols = 45usize; // 32 in the loop, 3 vectors after it, 1 scalar tail column
    let d = [l(cols as u64 + 3), l(cols as u64)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let max = k.op(Op::Reduce { op: ReduceOp::Max, axes: vec![1] }, &[x]);
    let kernel = k.kernel("rowmax", &[max]);
    let b = bind(1, 1);
    let rows = cols + 3;
    let mut data: Vec<f64> = (0..rows * cols).map(|i| ((i * 37) % 101) as f64 - 50.0).collect();
    for r in 0..cols {
        data[r * cols + r] = f64::NAN; // row r: NaN at column r
    }
    for v in &mut data[cols * cols..(cols + 1) * cols] {
        *v = f64::NEG_INFINITY;
    }
    let ins = vec![Tensor::new(DType::F32, vec![rows, cols], data.clone())];
    let ck = c.compile(&kernel, &b).unwrap();
    let got = execute(&ck, &kernel, &b, &ins, 1);
    for r in 0..rows {
        let g = got[0].data[r];
        let row = &data[r * cols..(r + 1) * cols];
        if row.iter().any(|v| v.is_nan()) {
            assert!(g.is_nan(), "row {r}: max {g}, want NaN");
        } else {
            let want = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
            assert_eq!(g, want, "row {r}");
        }
    }
}

/// Inputs for `exp` and `tanh`: random over several ranges, plus special values.
fn math_inputs(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = Rng::new(seed);
    let mut v: Vec<f64> = (0..n)
        .map(|i| match i % 4 {
            0 => rng.range(-1.0, 1.0),
            1 => rng.range(-110.0, 95.0),
            2 => rng.range(-10.0, 10.0),
            _ => 10f64.powf(rng.range(-40.0, 2.0)) * if rng.chance(0.5) { 1.0 } else { -1.0 },
        })
        .map(|x| x as f32 as f64)
        .collect();
    let special = [
        0.0,
        -0.0,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        88.72283,
        88.72284,
        89.5,
        -87.3,
        -103.97,
        -104.5,
        0.625,
        -0.625,
        1e-40,
        f32::MAX as f64,
        f32::MIN as f64,
    ];
    for (i, x) in special.iter().enumerate() {
        v[i * 7] = *x;
    }
    v
}

/// Compiles `kernel` at every instruction-set level the host supports and checks that all give
/// the bits of the generated code alone (`scalar`; NaN as NaN), and that the native routines
/// are called exactly at the levels that have them.
fn native_matches_inline(kernel: &fusec_ir::Kernel, b: &fusec_ir::Bindings, ins: &[Tensor], label: &str) {
    let mut inline = KernelCompiler::for_isa(Isa::Scalar).unwrap();
    let ki = inline.compile(kernel, b).unwrap();
    assert!(!ki.clif.contains("call_indirect"), "{}", ki.clif);
    let z = execute(&ki, kernel, b, ins, 1);
    let levels: Vec<Isa> = Isa::ALL.into_iter().filter(|i| *i != Isa::Scalar && i.supported()).collect();
    if levels.is_empty() {
        fusec_ir::testkit::skip("native row routines", "this host has neither AVX2 nor AVX-512F");
    }
    for isa in levels {
        let mut native = KernelCompiler::for_isa(isa).unwrap();
        let kn = native.compile(kernel, b).unwrap();
        assert!(kn.clif.contains("call_indirect"), "{label}: {isa:?} made no native call:\n{}", kn.clif);
        let a = execute(&kn, kernel, b, ins, 2);
        for (j, (p, q)) in a.iter().zip(&z).enumerate() {
            for (i, (u, v)) in p.data.iter().zip(&q.data).enumerate() {
                let (u, v) = (*u as f32, *v as f32);
                assert!(u.to_bits() == v.to_bits() || (u.is_nan() && v.is_nan()), "{label}, {isa:?}: result {j} element {i}: {u} vs {v}");
            }
        }
    }
}

/// Element `exp` and `tanh` of long rows (the native routines where the host has them) and
/// their row sums (which the routines return) give the same bits as the generated code,
/// including the masked tails of the native loop and special values; so do softmax and
/// cross-entropy, whose `exp` reads the logits directly.
#[test]
fn native_math_matches_generated_code() {
    for cols in [64u64, 1013, 1024] {
        let d = [s("B"), s("T"), l(cols)];
        let mut k = Body::new();
        let x = k.input(DType::F32, &d);
        let y = k.input(DType::F32, &d);
        let e = k.un(UnaryOp::Exp, x);
        let t = k.un(UnaryOp::Tanh, y);
        let g = k.op(Op::GeluGrad, &[y, x]);
        let es = k.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![2] }, &[e]);
        let ts = k.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![2] }, &[t]);
        let kernel = k.kernel("math_rows", &[e, t, g, es, ts]);
        let b = bind(2, 9);
        let n = 18 * cols as usize;
        let ins = vec![
            Tensor::new(DType::F32, vec![2, 9, cols as usize], math_inputs(n, cols)),
            Tensor::new(DType::F32, vec![2, 9, cols as usize], math_inputs(n, cols + 1)),
        ];
        native_matches_inline(&kernel, &b, &ins, &format!("math C={cols}"));

        let r = [s("B"), s("T")];
        let vocab = cols - 3;
        let mut k = Body::new();
        let x = k.input(DType::F32, &d);
        let tg = k.input(DType::I32, &r);
        let dl = k.input(DType::F32, &r);
        let loss = k.op(Op::CrossEntropy { vocab: cols }, &[x, tg]);
        let lp = k.op(Op::CrossEntropy { vocab }, &[x, tg]);
        let gr = k.op(Op::CrossEntropyGrad { vocab: cols }, &[x, tg, dl]);
        let sm = k.op(Op::Softmax, &[x]);
        let kernel = k.kernel("ce_rows", &[loss, lp, gr, sm]);
        let mut ins = random_inputs(&kernel, &b, 90 + cols, vocab, &[]);
        ins[0].data.iter_mut().for_each(|v| *v *= 5.0);
        // A row whose max is zero, with zeros of both signs (the native max may pick the other
        // sign; nothing downstream can see it).
        for (i, v) in ins[0].data[..cols as usize].iter_mut().enumerate() {
            *v = [0.0, -0.0, -1.5, -0.0][i % 4];
        }
        native_matches_inline(&kernel, &b, &ins, &format!("cross-entropy C={cols}"));

        // bf16 logits (the classifier of `--precision bf16`): the routines read the bf16 row.
        let mut k = Body::new();
        let x16 = k.input(DType::BF16, &d);
        let tg = k.input(DType::I32, &r);
        let dl = k.input(DType::F32, &r);
        let x = k.op(Op::Cast { to: DType::F32 }, &[x16]);
        let loss = k.op(Op::CrossEntropy { vocab }, &[x, tg]);
        let gr = k.op(Op::CrossEntropyGrad { vocab }, &[x, tg, dl]);
        let g16 = k.op(Op::Cast { to: DType::BF16 }, &[gr]);
        let sm = k.op(Op::Softmax, &[x]);
        let kernel = k.kernel("cast_ce_rows", &[loss, g16, sm]);
        let mut ins = random_inputs(&kernel, &b, 70 + cols, vocab, &[]);
        ins[0].data.iter_mut().for_each(|v| *v = fusec_ir::interp::round_to(DType::BF16, *v * 5.0));
        native_matches_inline(&kernel, &b, &ins, &format!("bf16 cross-entropy C={cols}"));
    }
}

/// The row sum of a one-hot selection `select(c == t, x, 0)` (a pick of one column) and a
/// one-hot select written out (the column loop assumes no hit and the hit column is written
/// after it), with targets in range, negative and past the end; at short and long rows.
#[test]
fn one_hot_picks_and_selects() {
    let mut c = KernelCompiler::new().unwrap();
    for cols in [5u64, 21, 300] {
        let d = [s("B"), s("T"), l(cols)];
        let mut k = Body::new();
        let x = k.input(DType::F32, &d);
        let t = k.input(DType::I32, &[s("B"), s("T")]);
        let g = k.input(DType::F32, &[s("B"), s("T")]);
        let ic = k.op(Op::Iota { axis: 2, ty: Type::new(DType::I32, Shape::from(d.to_vec())) }, &[]);
        let tb = k.bcast(t, &[0, 1], &d);
        let hit = k.op(Op::Compare(CmpOp::Eq), &[ic, tb]);
        let zero = k.constant(0.0, DType::F32, &d);
        let xe = k.un(UnaryOp::Exp, x);
        let picked_x = k.op(Op::Select, &[hit, xe, zero]);
        let picked = k.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![2] }, &[picked_x]);
        let one = k.constant(1.0, DType::F32, &d);
        let xm1 = k.bin(BinaryOp::Sub, xe, one);
        let sel = k.op(Op::Select, &[hit, xm1, xe]);
        let gb = k.bcast(g, &[0, 1], &d);
        let out = k.bin(BinaryOp::Mul, sel, gb);
        let kernel = k.kernel("one_hot", &[picked, out]);
        let b = bind(2, 40);
        let mut ins = random_inputs(&kernel, &b, 60 + cols, 1, &[]);
        let mut rng = Rng::new(cols);
        for v in &mut ins[1].data {
            *v = rng.below(cols + 6) as f64 - 3.0; // -3 ..= cols + 2
        }
        check(&mut c, &kernel, &b, &ins);
        let ck = c.compile(&kernel, &b).unwrap();
        assert!(same_bits(&execute(&ck, &kernel, &b, &ins, 1), &execute(&ck, &kernel, &b, &ins, 2)));
        // In place over the logits (as the memory planner may place a same-shaped result).
        let got = execute_in_place(&ck, &kernel, &b, &ins, &[(1, 0)], 2);
        let want = reference(&kernel, &b, &ins);
        got[1].check_close(&want[1], 1e-5, 1e-5).unwrap();
    }
}

/// Cross-entropy, its gradient and softmax over rows long enough for the native `exp`, the
/// picked target logit and the one-hot gradient fix-up (padded and unpadded vocabularies);
/// 1 and 2 threads give the same bits.
#[test]
fn cross_entropy_and_softmax_long_rows() {
    let mut c = KernelCompiler::new().unwrap();
    for (vocab, vp) in [(1000u64, 1024u64), (515, 515)] {
        let d = [s("B"), s("T"), l(vp)];
        let r = [s("B"), s("T")];
        let b = bind(2, 17);
        let mut k = Body::new();
        let x = k.input(DType::F32, &d);
        let t = k.input(DType::I32, &r);
        let dl = k.input(DType::F32, &r);
        let loss = k.op(Op::CrossEntropy { vocab }, &[x, t]);
        let g = k.op(Op::CrossEntropyGrad { vocab }, &[x, t, dl]);
        let y = k.op(Op::Softmax, &[x]);
        let kernel = k.kernel("ce_long", &[loss, g, y]);
        let mut ins = random_inputs(&kernel, &b, 70 + vp, vocab, &[]);
        ins[0].data.iter_mut().for_each(|v| *v *= 3.0);
        for (i, v) in ins[0].data.iter_mut().enumerate() {
            if i as u64 % vp >= vocab {
                *v = 1e30; // padding: never read by the reference
            }
        }
        let loss_k = {
            let mut k = Body::new();
            let x = k.input(DType::F32, &d);
            let t = k.input(DType::I32, &r);
            let loss = k.op(Op::CrossEntropy { vocab }, &[x, t]);
            k.kernel("cross_entropy", &[loss])
        };
        let grad_k = {
            let mut k = Body::new();
            let x = k.input(DType::F32, &d);
            let t = k.input(DType::I32, &r);
            let dl = k.input(DType::F32, &r);
            let g = k.op(Op::CrossEntropyGrad { vocab }, &[x, t, dl]);
            k.kernel("cross_entropy_grad", &[g])
        };
        check(&mut c, &loss_k, &b, &ins[..2]);
        check(&mut c, &grad_k, &b, &ins);
        if vocab == vp {
            check(&mut c, &kernel, &b, &ins);
        }
        let ck = c.compile(&grad_k, &b).unwrap();
        assert!(same_bits(&execute(&ck, &grad_k, &b, &ins, 1), &execute(&ck, &grad_k, &b, &ins, 2)));
    }
}
