//! Composite ops: LayerNorm, softmax, cross-entropy, causal attention, AdamW, and their
//! gradients. Each is written as the textbook loop over rows (llm.c's CPU code is the model).

use super::{round_to, Rounding, Tensor};
use crate::DType;

fn like(x: &Tensor, data: Vec<f64>) -> Tensor {
    Tensor { dtype: x.dtype, shape: x.shape.clone(), data }
}

/// The tensor viewed as `rows` rows of its last dim: (rows, last). A scalar is one row of one
/// element (the type rules let `softmax_grad` take rank-0 operands).
fn rows_of(x: &Tensor) -> (usize, usize) {
    let c = x.shape.last().copied().unwrap_or(1);
    (x.data.len() / c, c)
}

fn stat(x: &Tensor, data: Vec<f64>) -> Tensor {
    Tensor { dtype: x.dtype, shape: x.shape[..x.shape.len() - 1].to_vec(), data }
}

/// `(y, mean, rstd)` with biased variance: `rstd = 1/sqrt(var + eps)`, `y = (x-mean)*rstd*w + b`.
pub(super) fn layernorm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Vec<Tensor> {
    let (rows, c) = rows_of(x);
    let (mut y, mut means, mut rstds) = (Vec::with_capacity(x.data.len()), Vec::with_capacity(rows), Vec::with_capacity(rows));
    for r in 0..rows {
        let xr = &x.data[r * c..(r + 1) * c];
        let mean = xr.iter().sum::<f64>() / c as f64;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        y.extend((0..c).map(|i| (xr[i] - mean) * rstd * w.data[i] + b.data[i]));
        means.push(mean);
        rstds.push(rstd);
    }
    vec![like(x, y), stat(x, means), stat(x, rstds)]
}

/// llm.c's `layernorm_backward` from the saved statistics: `(dx, dw, db)`.
pub(super) fn layernorm_grad(dy: &Tensor, x: &Tensor, w: &Tensor, mean: &Tensor, rstd: &Tensor) -> Vec<Tensor> {
    let (rows, c) = rows_of(x);
    let mut dx = Vec::with_capacity(x.data.len());
    let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
    let mut norm = vec![0.0; c];
    for r in 0..rows {
        let (xr, dyr) = (&x.data[r * c..(r + 1) * c], &dy.data[r * c..(r + 1) * c]);
        let (mu, rs) = (mean.data[r], rstd.data[r]);
        let (mut dnorm_mean, mut dnorm_norm_mean) = (0.0, 0.0);
        for i in 0..c {
            norm[i] = (xr[i] - mu) * rs;
            let dnorm = dyr[i] * w.data[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm[i];
        }
        dnorm_mean /= c as f64;
        dnorm_norm_mean /= c as f64;
        for i in 0..c {
            let dnorm = dyr[i] * w.data[i];
            dx.push((dnorm - dnorm_mean - norm[i] * dnorm_norm_mean) * rs);
            dw[i] += dyr[i] * norm[i];
            db[i] += dyr[i];
        }
    }
    vec![like(x, dx), like(w, dw), like(w, db)]
}

/// Max-subtracted softmax of one row into `out`.
fn softmax_row(xr: &[f64], out: &mut Vec<f64>) {
    let m = xr.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
    let start = out.len();
    out.extend(xr.iter().map(|&v| (v - m).exp()));
    let sum: f64 = out[start..].iter().sum();
    for v in &mut out[start..] {
        *v /= sum;
    }
}

/// Softmax over the last axis.
pub(super) fn softmax(x: &Tensor) -> Tensor {
    let (rows, n) = rows_of(x);
    let mut y = Vec::with_capacity(x.data.len());
    for r in 0..rows {
        softmax_row(&x.data[r * n..(r + 1) * n], &mut y);
    }
    like(x, y)
}

/// `y * (dy - sum(dy * y))` per row.
pub(super) fn softmax_grad(y: &Tensor, dy: &Tensor) -> Tensor {
    let (rows, n) = rows_of(y);
    let mut dx = Vec::with_capacity(y.data.len());
    for r in 0..rows {
        let (yr, dr) = (&y.data[r * n..(r + 1) * n], &dy.data[r * n..(r + 1) * n]);
        let dot: f64 = yr.iter().zip(dr).map(|(a, b)| a * b).sum();
        dx.extend(yr.iter().zip(dr).map(|(a, b)| a * (b - dot)));
    }
    like(y, dx)
}

/// `max + ln(sum(exp(x - max)))` of a row.
fn logsumexp(xr: &[f64]) -> f64 {
    let m = xr.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
    m + xr.iter().map(|&v| (v - m).exp()).sum::<f64>().ln()
}

fn target(t: f64, row: usize, vocab: usize) -> Result<usize, String> {
    if t >= 0.0 && (t as usize) < vocab {
        Ok(t as usize)
    } else {
        Err(format!("target {t} at position {row} is out of range 0..{vocab}"))
    }
}

/// `logsumexp(logits[.., :vocab]) - logits[target]` per row.
pub(super) fn cross_entropy(logits: &Tensor, targets: &Tensor, vocab: usize) -> Result<Tensor, String> {
    let (rows, vp) = rows_of(logits);
    let mut loss = Vec::with_capacity(rows);
    for r in 0..rows {
        let lr = &logits.data[r * vp..r * vp + vocab];
        let t = target(targets.data[r], r, vocab)?;
        loss.push(logsumexp(lr) - lr[t]);
    }
    Ok(stat(logits, loss))
}

/// `(softmax(logits[:vocab]) - onehot(target)) * dloss`, zero in the padding columns.
pub(super) fn cross_entropy_grad(logits: &Tensor, targets: &Tensor, dloss: &Tensor, vocab: usize) -> Result<Tensor, String> {
    let (rows, vp) = rows_of(logits);
    let mut d = Vec::with_capacity(logits.data.len());
    for r in 0..rows {
        let t = target(targets.data[r], r, vocab)?;
        let start = d.len();
        softmax_row(&logits.data[r * vp..r * vp + vocab], &mut d);
        d[start + t] -= 1.0;
        for v in &mut d[start..] {
            *v *= dloss.data[r];
        }
        d.extend(std::iter::repeat_n(0.0, vp - vocab));
    }
    Ok(like(logits, d))
}

/// Heads and sizes of a `[..., T, D]` attention operand: (heads, T, D).
fn attn_dims(q: &Tensor) -> (usize, usize, usize) {
    let r = q.shape.len();
    let (t, d) = (q.shape[r - 2], q.shape[r - 1]);
    (q.data.len() / (t * d), t, d)
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Causal attention: `(out, lse)` with `s = scale q k^T` over `j <= i`.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Vec<Tensor> {
    let (heads, t, d) = attn_dims(q);
    let mut out = vec![0.0; q.data.len()];
    let mut lse = Vec::with_capacity(heads * t);
    let mut s = vec![0.0; t];
    for h in 0..heads {
        let base = h * t * d;
        let r = |i: usize| base + i * d..base + (i + 1) * d;
        for i in 0..t {
            for (j, sj) in s[..=i].iter_mut().enumerate() {
                *sj = scale * dot(&q.data[r(i)], &k.data[r(j)]);
            }
            let l = logsumexp(&s[..=i]);
            lse.push(l);
            let o = &mut out[r(i)];
            for (j, sj) in s[..=i].iter().enumerate() {
                let p = (sj - l).exp();
                for (oc, vc) in o.iter_mut().zip(&v.data[r(j)]) {
                    *oc += p * vc;
                }
            }
        }
    }
    vec![like(q, out), stat(q, lse)]
}

/// Gradient of causal attention from `(q, k, v, out, lse, dout)`: `p = exp(s - lse)` for
/// `j <= i`, `dv = p^T dout`, `dp = dout v^T`, `ds = p (dp - rowsum(dout * out))`,
/// `dq = scale ds k`, `dk = scale ds^T q`. (`rowsum(dout * out)` equals `rowsum(dp * p)` when
/// `out` is the forward's output; it is the form backends use.)
fn attention_grad(ins: &[&Tensor], scale: f64) -> Vec<Tensor> {
    let (q, k, v, out, lse, dout) = (ins[0], ins[1], ins[2], ins[3], ins[4], ins[5]);
    let (heads, t, d) = attn_dims(q);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.data.len()], vec![0.0; q.data.len()], vec![0.0; q.data.len()]);
    for h in 0..heads {
        let base = h * t * d;
        let r = |i: usize| base + i * d..base + (i + 1) * d;
        for i in 0..t {
            let l = lse.data[h * t + i];
            let dsum = dot(&dout.data[r(i)], &out.data[r(i)]);
            for j in 0..=i {
                let p = (scale * dot(&q.data[r(i)], &k.data[r(j)]) - l).exp();
                let dp = dot(&dout.data[r(i)], &v.data[r(j)]);
                let ds = p * (dp - dsum);
                for c in 0..d {
                    dv[base + j * d + c] += p * dout.data[base + i * d + c];
                    dq[base + i * d + c] += scale * ds * k.data[base + j * d + c];
                    dk[base + j * d + c] += scale * ds * q.data[base + i * d + c];
                }
            }
        }
    }
    vec![like(q, dq), like(q, dk), like(q, dv)]
}

/// One AdamW step: `(p', m', v')`. `p'` is computed from `m'` and `v'` as they are output (so
/// rounded to f32 first in F32 mode, as llm.c does).
pub(super) fn adamw(ins: &[&Tensor], [b1, b2, eps, wd]: [f64; 4], prec: Rounding) -> Vec<Tensor> {
    let (p, g, m, v) = (ins[0], ins[1], ins[2], ins[3]);
    let (lr, bc1, bc2) = (ins[4].data[0], ins[5].data[0], ins[6].data[0]);
    let rnd = |x: f64| {
        if prec == Rounding::F32 {
            round_to(p.dtype, x)
        } else {
            x
        }
    };
    let n = p.data.len();
    let (mut np, mut nm, mut nv) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        let gi = g.data[i];
        let mi = rnd(b1 * m.data[i] + (1.0 - b1) * gi);
        let vi = rnd(b2 * v.data[i] + (1.0 - b2) * gi * gi);
        let mhat = mi / bc1;
        let vhat = vi / bc2;
        np.push(p.data[i] - lr * (mhat / (vhat.sqrt() + eps) + wd * p.data[i]));
        nm.push(mi);
        nv.push(vi);
    }
    // The low-precision copy is `p'` rounded to f32 (as the parameter is) and then, by the
    // caller, to the copy's dtype.
    let copy = ins.get(7).map(|c| like(c, np.iter().map(|&x| rnd(x)).collect()));
    let mut out = vec![like(p, np), like(p, nm), like(p, nv)];
    out.extend(copy);
    out
}

/// `[S, T, 3C]` packed projections split into `[S, heads, T, D]` queries, keys and values.
fn unpack_qkv(qkv: &Tensor, heads: usize) -> [Tensor; 3] {
    let r = qkv.shape.len();
    let (t, c) = (qkv.shape[r - 2], qkv.shape[r - 1] / 3);
    let s: usize = qkv.shape[..r - 2].iter().product();
    let d = c / heads;
    let mut shape = qkv.shape[..r - 2].to_vec();
    shape.extend([heads, t, d]);
    std::array::from_fn(|part| {
        let mut data = Vec::with_capacity(s * t * c);
        for si in 0..s {
            for h in 0..heads {
                for ti in 0..t {
                    let at = (si * t + ti) * 3 * c + part * c + h * d;
                    data.extend_from_slice(&qkv.data[at..at + d]);
                }
            }
        }
        Tensor { dtype: qkv.dtype, shape: shape.clone(), data }
    })
}

/// `[S, heads, T, D]` per-head rows written back as `[S, T, heads * D]` (into `width` channels
/// starting at channel `offset`).
fn pack_heads(x: &Tensor, dst: &mut [f64], width: usize, offset: usize) {
    let r = x.shape.len();
    let (heads, t, d) = (x.shape[r - 3], x.shape[r - 2], x.shape[r - 1]);
    let s = x.data.len() / (heads * t * d);
    for si in 0..s {
        for h in 0..heads {
            for ti in 0..t {
                let src = ((si * heads + h) * t + ti) * d;
                let at = (si * t + ti) * width + offset + h * d;
                dst[at..at + d].copy_from_slice(&x.data[src..src + d]);
            }
        }
    }
}

/// Packed causal attention: `qkv: [S, T, 3C]` to `(out: [S, T, C], lse: [S, heads, T])`.
pub(super) fn attention_packed(qkv: &Tensor, heads: usize, scale: f64) -> Vec<Tensor> {
    let [q, k, v] = unpack_qkv(qkv, heads);
    let [out_h, lse] = <[Tensor; 2]>::try_from(attention(&q, &k, &v, scale)).expect("two results");
    let r = qkv.shape.len();
    let c = qkv.shape[r - 1] / 3;
    let mut shape = qkv.shape.clone();
    shape[r - 1] = c;
    let mut out = vec![0.0; qkv.data.len() / 3];
    pack_heads(&out_h, &mut out, c, 0);
    vec![Tensor { dtype: qkv.dtype, shape, data: out }, Tensor { dtype: DType::F32, ..lse }]
}

/// Gradient of packed attention from `(qkv, out, lse, dout)`: `dqkv: [S, T, 3C]`.
pub(super) fn attention_grad_packed(ins: &[&Tensor], heads: usize, scale: f64) -> Tensor {
    let (qkv, out, lse, dout) = (ins[0], ins[1], ins[2], ins[3]);
    let [q, k, v] = unpack_qkv(qkv, heads);
    let per_head = |x: &Tensor| {
        // [S, T, C] viewed as the value part of a packed tensor, then split into heads.
        let r = x.shape.len();
        let c = x.shape[r - 1];
        let mut padded = x.shape.clone();
        padded[r - 1] = 3 * c;
        let mut data = vec![0.0; x.data.len() * 3];
        for (row, chunk) in x.data.chunks(c).enumerate() {
            data[row * 3 * c + 2 * c..(row + 1) * 3 * c].copy_from_slice(chunk);
        }
        let [_, _, h] = unpack_qkv(&Tensor { dtype: x.dtype, shape: padded, data }, heads);
        h
    };
    let grads = attention_grad(&[&q, &k, &v, &per_head(out), lse, &per_head(dout)], scale);
    let c = qkv.shape[qkv.shape.len() - 1] / 3;
    let mut dqkv = vec![0.0; qkv.data.len()];
    for (part, gh) in grads.iter().enumerate() {
        pack_heads(gh, &mut dqkv, 3 * c, part * c);
    }
    Tensor { dtype: qkv.dtype, shape: qkv.shape.clone(), data: dqkv }
}
