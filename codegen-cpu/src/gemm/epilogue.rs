//! Row epilogues applied to a tile right after its product: bias add, GELU, accumulation.

/// `sqrt(2 / pi)` as llm.c computes it: `sqrtf(2.0f / M_PI)` (the quotient in double,
/// rounded to f32, then an f32 square root).
#[inline(always)]
fn gelu_scale() -> f32 {
    ((2.0f64 / std::f64::consts::PI) as f32).sqrt()
}

/// GELU, tanh form, in f32 with llm.c's `gelu_forward` order of operations:
/// `cube = 0.044715 * x * x * x; 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + cube)))`.
#[inline]
pub fn gelu(x: f32) -> f32 {
    let cube = 0.044715f32 * x * x * x;
    0.5f32 * x * (1.0f32 + (gelu_scale() * (x + cube)).tanh())
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
    if accumulate {
        for (v, t) in y.iter_mut().zip(pre.iter()) {
            *v += gelu(*t);
        }
    } else {
        for (v, t) in y.iter_mut().zip(pre.iter()) {
            *v = gelu(*t);
        }
    }
}
