//! Layout ops (reshape is in the dispatcher), gather and scatter-add.

use super::{strided_copy, strides, Tensor};
use crate::DType;

/// Operand axis `i` becomes result axis `dims[i]`; size-1 operand axes and new axes repeat.
pub(super) fn broadcast(x: &Tensor, dims: &[usize], shape: Vec<usize>) -> Tensor {
    let xs = strides(&x.shape);
    let mut st = vec![0usize; shape.len()];
    for (i, &d) in dims.iter().enumerate() {
        if x.shape[i] != 1 {
            st[d] = xs[i];
        }
    }
    let data = strided_copy(&shape, &st, 0, &x.data);
    Tensor { dtype: x.dtype, shape, data }
}

/// Result axis `i` is operand axis `perm[i]`.
pub(super) fn permute(x: &Tensor, perm: &[usize]) -> Tensor {
    let xs = strides(&x.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let st: Vec<usize> = perm.iter().map(|&p| xs[p]).collect();
    let data = strided_copy(&shape, &st, 0, &x.data);
    Tensor { dtype: x.dtype, shape, data }
}

/// Elements `start..end` along `axis`.
pub(super) fn slice(x: &Tensor, axis: usize, start: usize, end: usize) -> Tensor {
    let st = strides(&x.shape);
    let mut shape = x.shape.clone();
    shape[axis] = end - start;
    let data = strided_copy(&shape, &st, start * st[axis], &x.data);
    Tensor { dtype: x.dtype, shape, data }
}

/// Operands joined along `axis`.
pub(super) fn concat(xs: &[&Tensor], axis: usize) -> Tensor {
    let first = xs[0];
    let outer: usize = first.shape[..axis].iter().product();
    let inner: usize = first.shape[axis + 1..].iter().product();
    let mut shape = first.shape.clone();
    shape[axis] = xs.iter().map(|t| t.shape[axis]).sum();
    let mut data = Vec::with_capacity(shape.iter().product());
    for o in 0..outer {
        for t in xs {
            let chunk = t.shape[axis] * inner;
            data.extend_from_slice(&t.data[o * chunk..(o + 1) * chunk]);
        }
    }
    Tensor { dtype: first.dtype, shape, data }
}

/// Checks an index against `0..n`.
fn index(v: f64, pos: usize, n: usize, what: &str) -> Result<usize, String> {
    if v >= 0.0 && (v as usize) < n {
        Ok(v as usize)
    } else {
        Err(format!("{what} index {v} at position {pos} is out of range 0..{n}"))
    }
}

/// `out[s, c] = table[idx[s], c]`.
pub(super) fn gather(table: &Tensor, idx: &Tensor) -> Result<Tensor, String> {
    let (n, c) = (table.shape[0], table.shape[1]);
    let mut data = Vec::with_capacity(idx.data.len() * c);
    for (s, &i) in idx.data.iter().enumerate() {
        let r = index(i, s, n, "gather")?;
        data.extend_from_slice(&table.data[r * c..(r + 1) * c]);
    }
    let mut shape = idx.shape.clone();
    shape.push(c);
    Ok(Tensor { dtype: table.dtype, shape, data })
}

/// Zeros plus `out[idx[s], c] += src[s, c]` in increasing `s` (f64 accumulation for floats,
/// wrapping for i32).
pub(super) fn scatter_add(src: &Tensor, idx: &Tensor, rows: usize) -> Result<Tensor, String> {
    let c = *src.shape.last().expect("scatter_add source has rank >= 1");
    let mut data = vec![0.0; rows * c];
    for (s, &i) in idx.data.iter().enumerate() {
        let r = index(i, s, rows, "scatter_add")?;
        let (dst, from) = (&mut data[r * c..(r + 1) * c], &src.data[s * c..(s + 1) * c]);
        for (d, &x) in dst.iter_mut().zip(from) {
            *d = if src.dtype == DType::I32 { (*d as i32).wrapping_add(x as i32) as f64 } else { *d + x };
        }
    }
    Ok(Tensor { dtype: src.dtype, shape: vec![rows, c], data })
}
