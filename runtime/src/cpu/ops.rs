//! Native CPU implementations of the ops that stay their own launches after fusion: embedding
//! gather and its scatter-add adjoint, causal attention forward and backward, fills. f32 data,
//! rayon parallelism over independent rows or heads, deterministic (every sum has one order).

use fusec_codegen_cpu::gemm::{exp, matmul_strided, Mat};
use rayon::prelude::*;

pub use crate::launches::AttnDims;

/// `out[s, :] = table[idx[s], :]`; an index outside the table is an error.
pub fn gather(table: &[f32], cols: usize, idx: &[i32], out: &mut [f32]) -> Result<(), String> {
    let rows = table.len() / cols;
    if let Some((s, &i)) = idx.iter().enumerate().find(|(_, &i)| i < 0 || i as usize >= rows) {
        return Err(format!("gather: index {i} at position {s} is outside the table's {rows} rows"));
    }
    out.par_chunks_mut(cols).zip(idx.par_iter()).for_each(|(o, &i)| {
        let i = i as usize;
        o.copy_from_slice(&table[i * cols..(i + 1) * cols]);
    });
    Ok(())
}

/// `out = 0; out[idx[s], :] += src[s, :]` in increasing `s` (columns split across threads).
pub fn scatter_add(src: &[f32], cols: usize, idx: &[i32], out: &mut [f32]) -> Result<(), String> {
    let rows = out.len() / cols;
    if let Some((s, &i)) = idx.iter().enumerate().find(|(_, &i)| i < 0 || i as usize >= rows) {
        return Err(format!("scatter_add: index {i} at position {s} is outside the {rows} rows"));
    }
    out.fill(0.0);
    // Each thread owns a band of columns of every row: rows are visited in order by all bands.
    let band = cols.div_ceil(rayon::current_num_threads().max(1)).max(16).min(cols);
    let out_ptr = SyncPtr(out.as_mut_ptr());
    (0..cols.div_ceil(band)).into_par_iter().for_each(|b| {
        let (c0, c1) = (b * band, ((b + 1) * band).min(cols));
        for (s, &i) in idx.iter().enumerate() {
            let (src_row, dst) = (&src[s * cols..], i as usize * cols);
            for c in c0..c1 {
                // SAFETY: bands are disjoint column ranges, so no two threads touch one element.
                unsafe { *out_ptr.get().add(dst + c) += src_row[c] };
            }
        }
    });
    Ok(())
}

/// A raw pointer that may cross threads (disjoint writes are the caller's promise).
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `p[i, j] = exp(scale * scores[i, j] - lse_i)` for `j <= i`, 0 above the diagonal. With
/// `lse_out`, the row's log-sum-exp is computed (and `p = e / sum`); otherwise it is read from
/// `lse_in`. Written as maps and 8-lane reductions so that the loops vectorize.
fn causal_softmax(p: &mut [f32], t: usize, scale: f32, lse_out: Option<&mut [f32]>, lse_in: &[f32]) {
    let mut lse_out = lse_out;
    for i in 0..t {
        let (row, masked) = p[i * t..(i + 1) * t].split_at_mut(i + 1);
        masked.fill(0.0);
        match lse_out.as_deref_mut() {
            Some(out) => {
                let mx = scale * lanes(row, f32::NEG_INFINITY, f32::max);
                row.iter_mut().for_each(|x| *x = exp(scale * *x - mx));
                let sum = lanes(row, 0.0, |a, b| a + b);
                out[i] = mx + sum.ln();
                let inv = 1.0 / sum;
                row.iter_mut().for_each(|x| *x *= inv);
            }
            None => {
                let l = lse_in[i];
                row.iter_mut().for_each(|x| *x = exp(scale * *x - l));
            }
        }
    }
}

/// A reduction over 8 interleaved lanes, combined in a fixed order (deterministic, vectorizes).
fn lanes(x: &[f32], init: f32, f: impl Fn(f32, f32) -> f32 + Copy) -> f32 {
    let mut acc = [init; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] = f(acc[k], c[k]);
        }
    }
    let mut r = f(f(f(acc[0], acc[1]), f(acc[2], acc[3])), f(f(acc[4], acc[5]), f(acc[6], acc[7])));
    for &v in tail {
        r = f(r, v);
    }
    r
}

/// The stages of causal attention on packed `qkv [S, T, 3C]`. Each is its own launch, so the
/// profile times the GEMMs as GEMMs. Per head, the forward is `p = q k^T` (Scores), the causal
/// softmax of `scale * p` with its log-sum-exp (Softmax), `out = p v` (Values); the backward
/// recomputes `p` from the saved log-sum-exp (Scores, Softmax with `lse` given), then
/// `dp = dout v^T` (GradDp), `ds = scale p (dp - rowsum(dout out))` (GradDs), and
/// `dq = ds k`, `dk = ds^T q`, `dv = p^T dout` (GradQkv).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnStage {
    /// `p = q k^T`.
    Scores,
    /// Causal softmax of `scale * p` in place; computes `lse` (forward) or reads it (backward).
    Softmax { recompute: bool },
    /// `out = p v`.
    Values,
    /// `ds = dout v^T`.
    GradDp,
    /// `ds = scale p (ds - rowsum(dout out))`, masked.
    GradDs,
    /// `dq, dk, dv` into `dqkv`.
    GradQkv,
}

/// The tensors an attention stage reads or writes (null where unused) and the per-head score
/// scratch `p` and `ds` (`S * H * T * T` floats each).
#[derive(Clone, Copy)]
pub struct AttnPtrs {
    /// Packed projections.
    pub qkv: *const f32,
    /// Forward output `[S, T, C]`.
    pub out: *mut f32,
    /// Log-sum-exp `[S, H, T]`.
    pub lse: *mut f32,
    /// Output gradient `[S, T, C]`.
    pub dout: *const f32,
    /// Packed projection gradient `[S, T, 3C]`.
    pub dqkv: *mut f32,
    /// Probabilities per head.
    pub p: *mut f32,
    /// Score gradients per head.
    pub ds: *mut f32,
}

unsafe impl Send for AttnPtrs {}
unsafe impl Sync for AttnPtrs {}

/// Runs one attention stage for every (batch row, head) in parallel.
///
/// # Safety
/// Every pointer the stage uses must cover its tensor; heads touch disjoint parts of the
/// outputs and of the scratch.
pub unsafe fn attention_stage(stage: AttnStage, dm: AttnDims, scale: f32, a: AttnPtrs) {
    let (t, d, c) = (dm.t, dm.d, dm.h * dm.d);
    let shared = &a;
    (0..dm.s * dm.h).into_par_iter().for_each(|sh| {
        let a = *shared; // the whole struct (Sync), not its raw-pointer fields
        let (s, head) = (sh / dm.h, sh % dm.h);
        let part = |k: usize| Mat { ptr: a.qkv.add(s * t * 3 * c + k * c + head * d), rs: 3 * c as isize, cs: 1 };
        let (q, k, v) = (part(0), part(1), part(2));
        let p = std::slice::from_raw_parts_mut(a.p.add(sh * t * t), t * t);
        let pm = Mat { ptr: p.as_ptr(), rs: t as isize, cs: 1 };
        let row = |x: *const f32| Mat { ptr: x.add(s * t * c + head * d), rs: c as isize, cs: 1 };
        match stage {
            AttnStage::Scores => matmul_strided(t, t, d, p.as_mut_ptr(), t as isize, q, k.t(), false),
            AttnStage::Softmax { recompute } => {
                let lse = std::slice::from_raw_parts_mut(a.lse.add(sh * t), t);
                if recompute {
                    causal_softmax(p, t, scale, None, lse)
                } else {
                    causal_softmax(p, t, scale, Some(lse), &[])
                }
            }
            AttnStage::Values => matmul_strided(t, d, t, a.out.add(s * t * c + head * d), c as isize, pm, v, false),
            AttnStage::GradDp => matmul_strided(t, t, d, a.ds.add(sh * t * t), t as isize, row(a.dout), v.t(), false),
            AttnStage::GradDs => {
                let ds = std::slice::from_raw_parts_mut(a.ds.add(sh * t * t), t * t);
                for i in 0..t {
                    let at = s * t * c + i * c + head * d;
                    let dsum = dot(std::slice::from_raw_parts(a.dout.add(at), d), std::slice::from_raw_parts(a.out.add(at), d));
                    let (row, masked) = ds[i * t..(i + 1) * t].split_at_mut(i + 1);
                    row.iter_mut().zip(&p[i * t..=i * t + i]).for_each(|(x, pv)| *x = scale * pv * (*x - dsum));
                    masked.fill(0.0);
                }
            }
            AttnStage::GradQkv => {
                let dsm = Mat { ptr: a.ds.add(sh * t * t), rs: t as isize, cs: 1 };
                let base = a.dqkv.add(s * t * 3 * c + head * d);
                matmul_strided(t, d, t, base, 3 * c as isize, dsm, k, false);
                matmul_strided(t, d, t, base.add(c), 3 * c as isize, dsm.t(), q, false);
                matmul_strided(t, d, t, base.add(2 * c), 3 * c as isize, pm.t(), row(a.dout), false);
            }
        }
    });
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}
