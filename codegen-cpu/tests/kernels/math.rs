//! The `exp`, `log` and `tanh` routines against f64, in ulps.

use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::interp::Tensor;
use fusec_ir::rng::Rng;
use fusec_ir::{DType, UnaryOp};

use super::harness::*;

/// The spacing of f32 values at `|x|` (subnormal spacing below the normal range).
fn ulp(x: f64) -> f64 {
    let e = x.abs().log2().floor().max(-126.0);
    2f64.powf(e - 23.0)
}

/// Error of `got` against the exact `want`, in ulps of `want` (0 for matching specials).
fn ulp_err(got: f32, want: f64) -> f64 {
    if want.is_nan() {
        return if got.is_nan() { 0.0 } else { f64::INFINITY };
    }
    if want.abs() > f32::MAX as f64 * (1.0 + 2f64.powi(-25)) || want.is_infinite() {
        return if got.is_infinite() && got.signum() as f64 == want.signum() { 0.0 } else { f64::INFINITY };
    }
    if want == 0.0 {
        return if got == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (got as f64 - want).abs() / ulp(want)
}

/// Max ulp error of exp, log and tanh over millions of inputs, through both the vector loop
/// (one long row) and the scalar tail (rows of 3 columns). Asserts: exp and log ≤ 2 ulp; tanh
/// ≤ 2 ulp (or 1e-7 absolute).
#[test]
fn math_ulp_errors() {
    let n: u64 = 3 << 20;
    let mut rng = Rng::new(99);
    let mut xe = Vec::with_capacity(n as usize);
    let mut xl = Vec::with_capacity(n as usize);
    let mut xt = Vec::with_capacity(n as usize);
    for i in 0..n {
        xe.push(match i % 4 {
            0 => rng.range(-1.0, 1.0),
            1 => rng.range(88.0, 89.0),
            2 => rng.range(-104.0, -85.0),
            _ => rng.range(-104.0, 89.0),
        } as f32 as f64);
        let bits = match i % 3 {
            0 => (rng.below(0x7f7f_ffff) + 1) as u32,
            1 => (rng.below(0x0080_0000) + 0x3f00_0000) as u32, // [0.5, 2)
            _ => (rng.below(0x0100_0000) + 0x3f40_0000) as u32, // around 1
        };
        xl.push(f32::from_bits(bits) as f64);
        xt.push(match i % 3 {
            0 => rng.range(-10.0, 10.0),
            1 => rng.range(-1.0, 1.0),
            _ => 10f64.powf(rng.range(-10.0, 0.0)) * if rng.chance(0.5) { 1.0 } else { -1.0 },
        } as f32 as f64);
    }
    for (i, v) in [0.0, f64::INFINITY, f64::NAN, -1.0, 1.0, f64::NEG_INFINITY, 88.72283, 88.72284, -103.97, -87.3].iter().enumerate() {
        xl[i] = *v;
        xe[i] = (*v as f32) as f64;
        xt[i] = (*v as f32) as f64;
    }
    let mut c = KernelCompiler::new().unwrap();
    for (shape, label) in [(vec![l(n)], "vector"), (vec![l(n / 3), l(3)], "scalar")] {
        let mut k = Body::new();
        let (a, b_, t) = (k.input(DType::F32, &shape), k.input(DType::F32, &shape), k.input(DType::F32, &shape));
        let (e, lg, th) = (k.un(UnaryOp::Exp, a), k.un(UnaryOp::Log, b_), k.un(UnaryOp::Tanh, t));
        let kernel = k.kernel("math", &[e, lg, th]);
        let dims: Vec<usize> = if shape.len() == 1 { vec![n as usize] } else { vec![n as usize / 3, 3] };
        let ins: Vec<Tensor> = [&xe, &xl, &xt].iter().map(|x| Tensor::new(DType::F32, dims.clone(), x.to_vec())).collect();
        let b = bind(1, 1);
        let ck = c.compile(&kernel, &b).unwrap();
        let out = execute(&ck, &kernel, &b, &ins, 1);
        let mut worst = [(0.0f64, 0.0f64); 3];
        for i in 0..n as usize {
            let refs = [xe[i].exp(), xl[i].ln(), xt[i].tanh()];
            for f in 0..3 {
                let got = out[f].data[i] as f32;
                let mut err = ulp_err(got, refs[f]);
                if f == 2 && (got as f64 - refs[f]).abs() <= 1e-7 {
                    err = err.min(2.0);
                }
                if err > worst[f].0 {
                    worst[f] = (err, [xe[i], xl[i], xt[i]][f]);
                }
            }
        }
        println!(
            "{label}: max ulp error exp {:.3} (at {}), log {:.3} (at {}), tanh {:.3} (at {})",
            worst[0].0, worst[0].1, worst[1].0, worst[1].1, worst[2].0, worst[2].1
        );
        assert!(worst[0].0 <= 2.0, "exp: {} ulp at {}", worst[0].0, worst[0].1);
        assert!(worst[1].0 <= 2.0, "log: {} ulp at {}", worst[1].0, worst[1].1);
        assert!(worst[2].0 <= 2.0, "tanh: {} ulp at {}", worst[2].0, worst[2].1);
    }
}
