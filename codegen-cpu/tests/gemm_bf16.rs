//! `gemm_bf16` on the path of every instruction-set level the host supports (AVX512-BF16 dot
//! products, FMA on operands widened while packing, widened operands through the `gemm` crate)
//! against the interpreter's `gemm` node: every transpose, batch,
//! shared-`b`, epilogue and result type, at sizes that cross the packing blocks (odd k, k past
//! one block of pairs, rows past one packed block, partial micro-tiles).

use std::collections::HashMap;

use fusec_codegen_cpu::gemm::{gemm_bf16_on, Bf16Out};
use fusec_codegen_cpu::isa::Isa;
use fusec_ir::interp::{random_feeds, run, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::assert_close_slice;
use fusec_ir::{Bindings, DType, Dim, Gemm, GemmSpec, Graph, Op, Shape, Type};
use half::bf16;

/// The paths this host can run, one per instruction-set level: widened operands through the
/// `gemm` crate (`scalar`), FMA on operands widened while packing (`avx2`, `avx512`), dot
/// products (`avx512bf16`), AMX tiles (`amx`).
fn paths() -> Vec<Isa> {
    let v: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.supported()).collect();
    if !Isa::Avx512Bf16.supported() {
        fusec_ir::testkit::skip("bf16 dot-product products", "this host has no AVX512-BF16");
    }
    if !Isa::Amx.supported() {
        fusec_ir::testkit::not_on_this_host("bf16 products on AMX tiles", "this host has no AMX (or Linux did not grant its tile state)");
    }
    v
}

/// A graph of one `gemm` node on inputs `x0`, `x1`, ... and its `GemmSpec`.
fn gemm_graph(gm: &Gemm, batch: usize, m: usize, n: usize, k: usize, shared: bool) -> (Graph, GemmSpec) {
    let mat = |r: usize, c: usize, t: bool, b: bool, dt: DType| {
        let mut d = if b { vec![Dim::lit(batch as u64)] } else { vec![] };
        let (r, c) = if t { (c, r) } else { (r, c) };
        d.extend([Dim::lit(r as u64), Dim::lit(c as u64)]);
        Type::new(dt, Shape::from(d))
    };
    let mut tys = vec![mat(m, k, gm.trans_a, true, DType::BF16), mat(k, n, gm.trans_b, !shared, DType::BF16)];
    if gm.bias {
        tys.push(Type::new(DType::BF16, Shape::from(vec![Dim::lit(n as u64)])));
    }
    if gm.accumulate {
        tys.push(mat(m, n, false, true, gm.out));
    }
    let mut g = Graph::new("t", &[]);
    let ids: Vec<_> = tys.iter().enumerate().map(|(i, t)| g.add1(Op::Input { name: format!("x{i}"), ty: t.clone() }, &[])).collect();
    for (j, r) in g.add(Op::Gemm(gm.clone()), &ids).into_iter().enumerate() {
        g.output(&format!("out{j}"), r);
    }
    let mut s = GemmSpec::new(m, n, k);
    (s.batch, s.trans_a, s.trans_b, s.b_shared) = (batch, gm.trans_a, gm.trans_b, shared);
    (s.bias, s.gelu, s.accumulate) = (gm.bias, gm.gelu, gm.accumulate);
    (g, s)
}

fn to_bf16(t: &Tensor) -> Vec<bf16> {
    t.data.iter().map(|&x| bf16::from_f32(x as f32)).collect()
}

/// `(y, pre_gelu)` of `gemm_bf16_on(isa, ...)` as f64.
fn cpu(isa: Isa, s: &GemmSpec, feeds: &HashMap<String, Tensor>, out: DType, threads: usize) -> (Vec<f64>, Vec<f64>) {
    let x = |i: usize| to_bf16(&feeds[&format!("x{i}")]);
    let (a, b) = (x(0), x(1));
    let bias = s.bias.then(|| x(2));
    let acc = s.accumulate.then(|| &feeds[&format!("x{}", 2 + s.bias as usize)]);
    let mut pre = vec![bf16::NAN; if s.gelu { s.y_len() } else { 0 }];
    let pre_arg = s.gelu.then_some(&mut pre[..]);
    let y: Vec<f64> = if out == DType::F32 {
        let mut y: Vec<f32> = acc.map_or(vec![f32::NAN; s.y_len()], |t| t.data.iter().map(|&v| v as f32).collect());
        gemm_bf16_on(isa, s, &a, &b, bias.as_deref(), Bf16Out::F32(&mut y), pre_arg, threads);
        y.iter().map(|&v| v as f64).collect()
    } else {
        let mut y = acc.map_or(vec![bf16::NAN; s.y_len()], to_bf16);
        gemm_bf16_on(isa, s, &a, &b, bias.as_deref(), Bf16Out::Bf16(&mut y), pre_arg, threads);
        y.iter().map(|v| v.to_f64()).collect()
    };
    (y, pre.iter().map(|v| v.to_f64()).collect())
}

/// The exact product of the bf16 operands (f64), for plain products with an f32 result.
fn exact(s: &GemmSpec, feeds: &HashMap<String, Tensor>) -> Vec<f64> {
    let (a, b) = (&feeds["x0"].data, &feeds["x1"].data);
    let acc = s.accumulate.then(|| &feeds[&format!("x{}", 2 + s.bias as usize)].data);
    let (m, n, k) = (s.m, s.n, s.k);
    let mut y = vec![0.0; s.y_len()];
    for z in 0..s.batch {
        let bz = if s.b_shared { 0 } else { z * k * n };
        for i in 0..m {
            for j in 0..n {
                let mut t = 0.0;
                for p in 0..k {
                    let av = if s.trans_a { a[z * m * k + p * m + i] } else { a[z * m * k + i * k + p] };
                    let bv = if s.trans_b { b[bz + j * k + p] } else { b[bz + p * n + j] };
                    t += av * bv;
                }
                let o = z * m * n + i * n + j;
                y[o] = t + acc.map_or(0.0, |a| a[o]);
            }
        }
    }
    y
}

/// Checks bf16-rounded values against the interpreter's: each within one bf16 rounding of the
/// largest value on its way (`scale`: the f32 sum may fall on the other side of a rounding
/// boundary than the exact sum, at the product, the bias add, GELU or the accumulation), and
/// at least `percent` % of them equal (rounding at other points than the interpreter would
/// leave far fewer equal).
fn check_rounded(what: &str, got: &[f64], want: &[f64], scale: &[f64], percent: usize) {
    for (j, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = 1.2 / 128.0 * (w.abs() + s) + 1e-5;
        assert!(
            (g - w).abs() <= tol || (g.is_nan() && w.is_nan()),
            "{what}: element {j} is {g:e}, the interpreter's {w:e} (tolerance {tol:e})"
        );
    }
    let same = got.iter().zip(want).filter(|(g, w)| g == w).count();
    assert!(same * 100 >= got.len() * percent, "{what}: only {same} of {} values equal the interpreter's", got.len());
}

/// Per element, the magnitudes on the way to `y`: product, bias and accumulator.
fn scales(s: &GemmSpec, feeds: &HashMap<String, Tensor>) -> Vec<f64> {
    let plain = GemmSpec { accumulate: false, ..*s };
    let bias = s.bias.then(|| &feeds["x2"].data);
    let acc = s.accumulate.then(|| &feeds[&format!("x{}", 2 + s.bias as usize)].data);
    let prod = exact(&plain, feeds);
    (0..prod.len()).map(|o| prod[o].abs() + bias.map_or(0.0, |b| b[o % s.n].abs()) + acc.map_or(0.0, |a| a[o].abs())).collect()
}

#[test]
fn bf16_products_round_like_the_interpreter_on_every_path() {
    let mut rng = Rng::new(5);
    let shapes = [(1, 5, 7, 1, false), (2, 37, 45, 3, true), (2, 130, 70, 257, false), (1, 200, 33, 300, true), (3, 13, 64, 64, true), (1, 70, 256, 300, false), (2, 150, 256, 100, true)];
    let mut cases = 0;
    for (batch, m, n, k, shared) in shapes {
        for flags in 0..64u32 {
            let bit = |i: u32| flags >> i & 1 == 1;
            let out = if bit(5) { DType::BF16 } else { DType::F32 };
            let gm = Gemm { trans_a: bit(0), trans_b: bit(1), bias: bit(2), gelu: bit(3), out, accumulate: bit(4) };
            let (g, s) = gemm_graph(&gm, batch, m, n, k, shared);
            let feeds = random_feeds(&g, &Bindings::default(), &mut rng, 1).unwrap();
            let want = run(&g, &Bindings::default(), &feeds, Rounding::F32).unwrap();
            let what = |isa: Isa, r: &str| format!("{r} of {gm:?}, batch {batch} shared {shared} m {m} n {n} k {k}, {isa:?}");
            let scale = scales(&s, &feeds);
            for isa in paths() {
                let (y, pre) = cpu(isa, &s, &feeds, out, 2);
                assert_eq!((y.clone(), pre.clone()), cpu(isa, &s, &feeds, out, 1), "{}: threads changed bits", what(isa, "y"));
                if out == DType::F32 && !s.bias && !s.gelu {
                    // f32 accumulation and result, never rounded to bf16.
                    assert_close_slice(&what(isa, "y"), &y, &exact(&s, &feeds), 1e-5, 1e-5);
                } else {
                    // GELU in f32 loses relative precision where `1 + tanh` cancels (x < -2),
                    // which moves more roundings than the product's f32 sum does.
                    check_rounded(&what(isa, "y"), &y, &want[0].data, &scale, if s.gelu { 80 } else { 99 });
                }
                if s.gelu {
                    check_rounded(&what(isa, "pre_gelu"), &pre, &want[1].data, &scale, 99);
                }
            }
            cases += 1;
        }
    }
    assert_eq!(cases, shapes.len() * 64);
}

#[test]
fn bf16_products_keep_nan_and_infinity() {
    // A NaN operand makes its row NaN (quiet, through every rounding); an infinite bias stays
    // infinite.
    let gm = Gemm { trans_a: false, trans_b: true, bias: true, gelu: false, out: DType::BF16, accumulate: false };
    let (g, s) = gemm_graph(&gm, 1, 3, 40, 8, true);
    let mut feeds = random_feeds(&g, &Bindings::default(), &mut Rng::new(9), 1).unwrap();
    feeds.get_mut("x0").unwrap().data[8] = f64::NAN; // row 1
    feeds.get_mut("x2").unwrap().data[5] = f64::INFINITY;
    for isa in paths() {
        let (y, _) = cpu(isa, &s, &feeds, DType::BF16, 1);
        for j in 0..40 {
            assert!(y[40 + j].is_nan(), "{isa:?}: column {j} of the NaN row is {}", y[40 + j]);
            for i in [0, 2] {
                assert_eq!(y[i * 40 + 5], f64::INFINITY, "{isa:?}");
            }
        }
    }
}
