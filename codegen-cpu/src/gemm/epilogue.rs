//! Row epilogues applied to a tile right after its product: bias add, GELU, accumulation.

/// `sqrt(2 / pi)` as llm.c computes it: `sqrtf(2.0f / M_PI)` (the quotient in double,
/// rounded to f32, then an f32 square root).
#[inline(always)]
pub(crate) fn gelu_scale() -> f32 {
    ((2.0f64 / std::f64::consts::PI) as f32).sqrt()
}

/// GELU, tanh form, in f32 with llm.c's `gelu_forward` order of operations:
/// `cube = 0.044715 * x * x * x; 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + cube)))`.
#[inline]
pub fn gelu(x: f32) -> f32 {
    let cube = 0.044715f32 * x * x * x;
    0.5f32 * x * (1.0f32 + tanh(gelu_scale() * (x + cube)))
}

/// `tanh` as the Cranelift kernels compute it (`crate::math`: Cephes `tanhf` on Cephes `expf`,
/// 1.3 ulp), written branch-free so that loops over rows vectorize; glibc's `tanhf` costs
/// 11-15 ns an element and dominated the GELU epilogue.
#[inline(always)]
#[allow(clippy::excessive_precision)] // coefficients as published (Cephes)
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let p = ((((-5.704_988_7e-3f32 * z + 2.063_908_9e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z) - 3.333_328_2e-1;
    let small = p * z * x + x;
    let t = 1.0 - 2.0 / (exp(a + a) + 1.0);
    let large = if x < 0.0 { -t } else { t };
    if a < 0.625 {
        small
    } else {
        large
    }
}

/// `e^x` (Cephes `expf`, the same operations as `crate::math::exp`; within 1 ulp, vectorizes).
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn exp(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = if x > 89.0 { 89.0 } else { x };
    let x = if x < -104.0 { -104.0 } else { x };
    let tm = x * std::f32::consts::LOG2_E + MAGIC;
    let n = tm - MAGIC;
    let ni = tm.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = (x - n * 0.693_359_4) - n * -2.121_944_4e-4;
    let p =
        ((((1.987_569_1e-4f32 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 5.000_000_1e-1;
    let y = (p * (r * r) + r) + 1.0;
    let n1 = ni >> 1;
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    y * pow2(n1) * pow2(ni - n1)
}

/// `row += bias`.
#[inline]
pub(super) fn add_bias(row: &mut [f32], bias: &[f32]) {
    for (v, b) in row.iter_mut().zip(bias) {
        *v += *b;
    }
}

/// `row += product + bias` (the bias joins the product before the accumulator, as in the IR).
#[inline]
pub(super) fn accumulate_bias(row: &mut [f32], product: &[f32], bias: &[f32]) {
    for ((v, p), b) in row.iter_mut().zip(product).zip(bias) {
        *v += *p + *b;
    }
}

/// `pre` holds the product on entry and `t = product (+ bias)` on exit; `y = gelu(t)`, or
/// `y += gelu(t)` when `accumulate`.
#[inline]
pub(super) fn bias_gelu(pre: &mut [f32], y: &mut [f32], bias: Option<&[f32]>, accumulate: bool) {
    if let Some(bias) = bias {
        add_bias(pre, bias);
    }
    crate::vmath::gelu_rows(y, pre, accumulate);
}
