//! Native CPU implementations of the ops that stay their own launches after fusion: embedding
//! gather and its scatter-add adjoint, causal attention forward and backward, fills. f32 data,
//! rayon parallelism over independent rows or heads, deterministic (every sum has one order).

use fusec_codegen_cpu::gemm::{exp, matmul_strided, Mat};
use rayon::prelude::*;

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

/// Sizes of a packed attention: batch rows `s`, sequence `t`, heads `h`, head size `d`.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    /// Leading (batch) rows.
    pub s: usize,
    /// Sequence length.
    pub t: usize,
    /// Heads.
    pub h: usize,
    /// Head size.
    pub d: usize,
}

impl AttnDims {
    fn c(&self) -> usize {
        self.h * self.d
    }
}

/// The q, k or v matrix (`part` 0, 1, 2) of head `head` in batch row `s`: `[T, d]` with row
/// stride `3C`, read in place from the packed projections.
fn head_mat(qkv: &[f32], dm: AttnDims, s: usize, head: usize, part: usize) -> Mat {
    let c = dm.c();
    Mat { ptr: qkv[s * dm.t * 3 * c + part * c + head * dm.d..].as_ptr(), rs: 3 * c as isize, cs: 1 }
}

/// `p[i, j] = exp(scale * scores[i, j] - lse_i)` for `j <= i`, 0 above the diagonal (`lse`
/// computed here when `lse_out` is given, read from `lse_in` otherwise).
fn causal_softmax(p: &mut [f32], t: usize, scale: f32, lse_out: Option<&mut [f32]>, lse_in: &[f32]) {
    let mut lse_out = lse_out;
    for i in 0..t {
        let row = &mut p[i * t..(i + 1) * t];
        let l = match lse_out.as_deref_mut() {
            Some(out) => {
                let mut mx = f32::NEG_INFINITY;
                for x in &row[..=i] {
                    mx = mx.max(scale * x);
                }
                let mut sum = 0f32;
                for x in &row[..=i] {
                    sum += exp(scale * x - mx);
                }
                out[i] = mx + sum.ln();
                out[i]
            }
            None => lse_in[i],
        };
        for x in &mut row[..=i] {
            *x = exp(scale * *x - l);
        }
        row[i + 1..].fill(0.0);
    }
}

/// Causal attention on packed `qkv [S, T, 3C]`: `out [S, T, C]`, `lse [S, H, T]`. Per head
/// (one per thread): `scores = q k^T` and `out = p v` as GEMMs, the causal softmax in between.
pub fn attention(dm: AttnDims, scale: f32, qkv: &[f32], out: &mut [f32], lse: &mut [f32]) {
    let (t, d, c) = (dm.t, dm.d, dm.c());
    let out_ptr = SyncPtr(out.as_mut_ptr());
    lse.par_chunks_mut(t).enumerate().for_each(|(sh, lse_row)| {
        let (s, head) = (sh / dm.h, sh % dm.h);
        SCRATCH.with_borrow_mut(|buf| {
            let p = scratch(buf, t * t);
            let (q, k, v) = (head_mat(qkv, dm, s, head, 0), head_mat(qkv, dm, s, head, 1), head_mat(qkv, dm, s, head, 2));
            // SAFETY: views cover [T, d] in qkv; `p` is this thread's scratch; the output block
            // (rows of batch s, columns of this head) belongs to this (s, head) alone.
            unsafe {
                matmul_strided(t, t, d, p.as_mut_ptr(), t as isize, q, k.t(), false);
                causal_softmax(p, t, scale, Some(lse_row), &[]);
                let pm = Mat { ptr: p.as_ptr(), rs: t as isize, cs: 1 };
                matmul_strided(t, d, t, out_ptr.get().add(s * t * c + head * d), c as isize, pm, v, false);
            }
        });
    });
}

/// Gradient of packed causal attention: `dqkv [S, T, 3C]` from `qkv`, `out`, `lse`, `dout`.
/// Per head: `p` from the saved log-sum-exp, `dp = dout v^T`, `ds = scale p (dp - rowsum(dout
/// out))`, then `dq = ds k`, `dk = ds^T q`, `dv = p^T dout` as GEMMs.
pub fn attention_grad(dm: AttnDims, scale: f32, qkv: &[f32], out: &[f32], lse: &[f32], dout: &[f32], dqkv: &mut [f32]) {
    let (t, d, c) = (dm.t, dm.d, dm.c());
    let dq_ptr = SyncPtr(dqkv.as_mut_ptr());
    (0..dm.s * dm.h).into_par_iter().for_each(|sh| {
        let (s, head) = (sh / dm.h, sh % dm.h);
        SCRATCH.with_borrow_mut(|buf| {
            let (q, k, v) = (head_mat(qkv, dm, s, head, 0), head_mat(qkv, dm, s, head, 1), head_mat(qkv, dm, s, head, 2));
            let dout_m = Mat { ptr: dout[s * t * c + head * d..].as_ptr(), rs: c as isize, cs: 1 };
            let grow = scratch(buf, 2 * t * t);
            let (p, ds) = grow.split_at_mut(t * t);
            // SAFETY: as in `attention`; this (s, head) owns its q, k and v columns of dqkv.
            unsafe {
                matmul_strided(t, t, d, p.as_mut_ptr(), t as isize, q, k.t(), false);
                causal_softmax(p, t, scale, None, &lse[sh * t..(sh + 1) * t]);
                matmul_strided(t, t, d, ds.as_mut_ptr(), t as isize, dout_m, v.t(), false);
                for i in 0..t {
                    let at = s * t * c + i * c + head * d;
                    let dsum = dot(&dout[at..at + d], &out[at..at + d]);
                    for j in 0..t {
                        let x = &mut ds[i * t + j];
                        *x = if j <= i { scale * p[i * t + j] * (*x - dsum) } else { 0.0 };
                    }
                }
                let base = dq_ptr.get().add(s * t * 3 * c + head * d);
                let (pm, dsm) = (Mat { ptr: p.as_ptr(), rs: t as isize, cs: 1 }, Mat { ptr: ds.as_ptr(), rs: t as isize, cs: 1 });
                matmul_strided(t, d, t, base, 3 * c as isize, dsm, k, false);
                matmul_strided(t, d, t, base.add(c), 3 * c as isize, dsm.t(), q, false);
                matmul_strided(t, d, t, base.add(2 * c), 3 * c as isize, pm.t(), dout_m, false);
            }
        });
    });
}

thread_local! {
    /// Per-thread attention scratch (score matrices), grown once per size.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `n` scratch floats (grown, never shrunk: no allocation in steady state).
fn scratch(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
