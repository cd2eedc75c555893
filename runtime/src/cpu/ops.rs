//! Native CPU implementations of the ops that stay their own launches after fusion: embedding
//! gather and its scatter-add adjoint, causal attention forward and backward, fills. f32 data,
//! rayon parallelism over independent rows or heads, deterministic (every sum has one order).

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

/// Causal attention on packed `qkv [S, T, 3C]`: `out [S, T, C]`, `lse [S, H, T]`.
pub fn attention(dm: AttnDims, scale: f32, qkv: &[f32], out: &mut [f32], lse: &mut [f32]) {
    let AttnDims { t, h, d, .. } = dm;
    let c = dm.c();
    let out_ptr = SyncPtr(out.as_mut_ptr());
    lse.par_chunks_mut(t).enumerate().for_each(|(sh, lse_row)| {
        let (s, head) = (sh / h, sh % h);
        SCORES.with_borrow_mut(|scores| {
            if scores.len() < t {
                scores.resize(t, 0.0); // once per thread and size: no allocation in steady state
            }
            for i in 0..t {
                let q = &qkv[(s * t + i) * 3 * c + head * d..][..d];
                let mut mx = f32::NEG_INFINITY;
                for (j, sc) in scores[..=i].iter_mut().enumerate() {
                    let k = &qkv[(s * t + j) * 3 * c + c + head * d..][..d];
                    *sc = scale * dot(q, k);
                    mx = mx.max(*sc);
                }
                let mut sum = 0f32;
                for sc in &scores[..=i] {
                    sum += (sc - mx).exp();
                }
                let l = mx + sum.ln();
                lse_row[i] = l;
                // SAFETY: (s, head, i) owns out[s, i, head*d .. head*d + d]; heads are disjoint.
                let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add((s * t + i) * c + head * d), d) };
                o.fill(0.0);
                for (j, sc) in scores[..=i].iter().enumerate() {
                    let p = (sc - l).exp();
                    let v = &qkv[(s * t + j) * 3 * c + 2 * c + head * d..][..d];
                    for (oc, vc) in o.iter_mut().zip(v) {
                        *oc += p * vc;
                    }
                }
            }
        });
    });
}

thread_local! {
    /// One row of attention scores per thread.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Gradient of packed causal attention: `dqkv [S, T, 3C]` from `qkv`, `out`, `lse`, `dout`.
pub fn attention_grad(dm: AttnDims, scale: f32, qkv: &[f32], out: &[f32], lse: &[f32], dout: &[f32], dqkv: &mut [f32]) {
    let AttnDims { s: sn, t, h, d } = dm;
    let c = dm.c();
    dqkv.fill(0.0);
    let dq_ptr = SyncPtr(dqkv.as_mut_ptr());
    (0..sn * h).into_par_iter().for_each(|sh| {
        let (s, head) = (sh / h, sh % h);
        let row = |i: usize, part: usize| (s * t + i) * 3 * c + part * c + head * d;
        let at = |i: usize| (s * t + i) * c + head * d;
        for i in 0..t {
            let l = lse[sh * t + i];
            let dsum = dot(&dout[at(i)..][..d], &out[at(i)..][..d]);
            let q = &qkv[row(i, 0)..][..d];
            for j in 0..=i {
                let k = &qkv[row(j, 1)..][..d];
                let v = &qkv[row(j, 2)..][..d];
                let p = (scale * dot(q, k) - l).exp();
                let dp = dot(&dout[at(i)..][..d], v);
                let ds = p * (dp - dsum);
                // SAFETY: (s, head) owns every dqkv element of its head; heads run in parallel.
                unsafe {
                    let base = dq_ptr.get();
                    for x in 0..d {
                        *base.add(row(j, 2) + x) += p * dout[at(i) + x];
                        *base.add(row(i, 0) + x) += scale * ds * k[x];
                        *base.add(row(j, 1) + x) += scale * ds * q[x];
                    }
                }
            }
        }
    });
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
