//! Elementwise ops, `iota`, casts and GELU. Results are unrounded; the run loop rounds them.

use super::{strides, Tensor};
use crate::{BinaryOp, CmpOp, DType, UnaryOp};

/// `sqrt(2 / pi)`, the GELU tanh-form constant.
const GELU_SCALE: f64 = 0.797_884_560_802_865_4;

fn map(x: &Tensor, dtype: DType, f: impl Fn(f64) -> f64) -> Tensor {
    Tensor { dtype, shape: x.shape.clone(), data: x.data.iter().map(|&v| f(v)).collect() }
}

fn zip(a: &Tensor, b: &Tensor, dtype: DType, f: impl Fn(f64, f64) -> f64) -> Tensor {
    Tensor { dtype, shape: a.shape.clone(), data: a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect() }
}

/// Element `[i0, .., in]` is `i_axis`.
pub(super) fn iota(axis: usize, (dtype, shape): (DType, Vec<usize>)) -> Tensor {
    let st = strides(&shape);
    let n: usize = shape.iter().product();
    let data = (0..n).map(|k| ((k / st[axis]) % shape[axis]) as f64).collect();
    Tensor { dtype, shape, data }
}

/// Unary float functions.
pub(super) fn unary(u: UnaryOp, x: &Tensor) -> Tensor {
    let f: fn(f64) -> f64 = match u {
        UnaryOp::Neg => |v| -v,
        UnaryOp::Exp => f64::exp,
        UnaryOp::Log => f64::ln,
        UnaryOp::Sqrt => f64::sqrt,
        UnaryOp::Rsqrt => |v| 1.0 / v.sqrt(),
        UnaryOp::Tanh => f64::tanh,
        UnaryOp::Recip => |v| 1.0 / v,
    };
    map(x, x.dtype, f)
}

/// NaN-propagating max.
pub(super) fn max_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// NaN-propagating min.
fn min_nan(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// Binary ops. Floats compute in f64; i32 uses wrapping two's-complement arithmetic with
/// division truncating toward zero (division by zero is an error).
pub(super) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor, String> {
    if a.dtype.is_float() {
        let f: fn(f64, f64) -> f64 = match op {
            BinaryOp::Add => |x, y| x + y,
            BinaryOp::Sub => |x, y| x - y,
            BinaryOp::Mul => |x, y| x * y,
            BinaryOp::Div => |x, y| x / y,
            BinaryOp::Max => max_nan,
            BinaryOp::Min => min_nan,
        };
        return Ok(zip(a, b, a.dtype, f));
    }
    if op == BinaryOp::Div && b.data.contains(&0.0) {
        return Err("i32 division by zero".to_string());
    }
    let f: fn(i32, i32) -> i32 = match op {
        BinaryOp::Add => i32::wrapping_add,
        BinaryOp::Sub => i32::wrapping_sub,
        BinaryOp::Mul => i32::wrapping_mul,
        BinaryOp::Div => i32::wrapping_div,
        BinaryOp::Max => |x, y| x.max(y),
        BinaryOp::Min => |x, y| x.min(y),
    };
    Ok(zip(a, b, a.dtype, |x, y| f(x as i32, y as i32) as f64))
}

/// Comparisons (IEEE: NaN compares unequal to everything); 1 where true.
pub(super) fn compare(c: CmpOp, a: &Tensor, b: &Tensor) -> Tensor {
    let f: fn(f64, f64) -> bool = match c {
        CmpOp::Lt => |x, y| x < y,
        CmpOp::Le => |x, y| x <= y,
        CmpOp::Gt => |x, y| x > y,
        CmpOp::Ge => |x, y| x >= y,
        CmpOp::Eq => |x, y| x == y,
        CmpOp::Ne => |x, y| x != y,
    };
    zip(a, b, DType::I32, |x, y| f(x, y) as i32 as f64)
}

/// `cond != 0 ? a : b`.
pub(super) fn select(cond: &Tensor, a: &Tensor, b: &Tensor) -> Tensor {
    let data = cond.data.iter().zip(a.data.iter().zip(&b.data)).map(|(&c, (&x, &y))| if c != 0.0 { x } else { y }).collect();
    Tensor { dtype: a.dtype, shape: a.shape.clone(), data }
}

/// Conversion. To a float dtype the run loop does the rounding (in F32 mode); to i32, floats
/// truncate toward zero and must be finite and in range.
pub(super) fn cast(x: &Tensor, to: DType) -> Result<Tensor, String> {
    if to != DType::I32 || x.dtype == DType::I32 {
        return Ok(map(x, to, |v| v));
    }
    let mut data = Vec::with_capacity(x.data.len());
    for &v in &x.data {
        let t = v.trunc();
        if !(t >= i32::MIN as f64 && t <= i32::MAX as f64) {
            return Err(format!("cannot cast {v} to i32 (out of range)"));
        }
        data.push(t);
    }
    Ok(Tensor { dtype: to, shape: x.shape.clone(), data })
}

/// GELU, tanh form: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub(super) fn gelu(x: &Tensor) -> Tensor {
    map(x, x.dtype, |v| 0.5 * v * (1.0 + (GELU_SCALE * (v + 0.044715 * v * v * v)).tanh()))
}

/// `dy` times the derivative of the tanh-form GELU at `x` (llm.c's `gelu_backward`).
pub(super) fn gelu_grad(x: &Tensor, dy: &Tensor) -> Tensor {
    zip(x, dy, x.dtype, |v, d| {
        let arg = GELU_SCALE * (v + 0.044715 * v * v * v);
        let th = arg.tanh();
        let sech2 = 1.0 / (arg.cosh() * arg.cosh());
        let local = 0.5 * (1.0 + th) + v * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * v * v);
        local * d
    })
}
