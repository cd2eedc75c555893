//! Causal attention on the CPU, as launches of its stages over packed `qkv [S, T, 3C]` on f32
//! or bf16 storage. Per (sequence, head), in parallel: the forward is `p = q k^T` (Scores), the
//! causal softmax of `scale * p` with its log-sum-exp (Softmax), `out = p v` (Values); the
//! backward reads the `p` its forward kept where every layer's fits a budget
//! (`launch::keep_scores`), or recomputes it from the saved log-sum-exp (Scores, Softmax with
//! `lse` given), then
//! `dp = dout v^T` (GradDp), `ds = scale p (dp - rowsum(dout out))` (GradDs), and `dq = ds k`,
//! `dk = ds^T q`, `dv = p^T dout` (GradQkv). The forward's stages are one launch and the
//! backward's another, each head running its stages in turn while its score matrix is in
//! cache (the profile names the launch after its stages). The products skip the zeros above
//! the diagonal: they run per block of [`CAUSAL_BLOCK`] rows over the keys up to the block's
//! last row, on `matmul_small` (AVX-512 register blocks where the host has them); `k` and `v`
//! are transposed once a head for `q k^T` and `dout v^T`, so the right operand's rows are
//! contiguous.
//!
//! Everything computes in f32. On bf16 storage each head's rows of `q`, `k`, `v`, `out` and
//! `dout` are widened (exactly) into per-thread buffers right before the stage reads them, and
//! a result (`out`, `dq`, `dk`, `dv`) is computed into such a buffer and rounded to bf16 (nearest
//! even) into its rows: one rounding of each result, as the interpreter's attention rounds
//! its results once, and no pass over whole tensors.

use std::cell::RefCell;

use fusec_codegen_cpu::convert::{round_rows, widen_rows};
use fusec_codegen_cpu::gemm::{exp, matmul_small, Mat};
use fusec_codegen_cpu::at_level;
use fusec_codegen_cpu::isa::current;
use fusec_ir::DType;
use rayon::prelude::*;

use crate::launches::{Attention, AttnDims};

/// One stage of causal attention (see the module docs).
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

/// The per-head score matrices `p` shared by every attention launch (launches run one at a
/// time), outside the memory plan, sized once for the largest attention; and, for the
/// layers whose backward reads the probabilities their forward kept (`launch::keep_scores`),
/// one `p` a layer, found by the layer's `lse` offset (its forward and backward share it).
/// Written only through the pointers taken when they were allocated (launches hold `&self`).
pub struct AttnScratch {
    /// The allocation `scores` and the kept slots point into.
    buf: Vec<f32>,
    scores: *mut f32,
    kept: Vec<(u64, usize, *mut f32)>,
}

impl AttnScratch {
    /// Scratch for these attention launches, each with whether its layer keeps `p`.
    pub fn new<'a>(attns: impl Iterator<Item = (&'a Attention, bool)>) -> AttnScratch {
        let attns: Vec<(&Attention, bool)> = attns.collect();
        let shared = attns.iter().map(|(a, _)| score_floats(a.dims)).max().unwrap_or(0);
        let mut layers: Vec<(u64, usize)> = vec![];
        for (a, _) in attns.iter().filter(|(a, keep)| *keep && !a.forward) {
            if !layers.iter().any(|(lse, _)| *lse == a.at.lse) {
                layers.push((a.at.lse, score_floats(a.dims)));
            }
        }
        let mut v = vec![0.0; shared + layers.iter().map(|l| l.1).sum::<usize>()];
        let scores = v.as_mut_ptr();
        let mut at = shared;
        let kept = layers
            .into_iter()
            .map(|(lse, n)| {
                // SAFETY: the layers' slots follow the shared scratch inside `v`.
                let p = unsafe { scores.add(at) };
                at += n;
                (lse, n, p)
            })
            .collect();
        AttnScratch { buf: v, scores, kept }
    }

    /// Bytes of score matrices, and how many layers keep their probabilities.
    pub fn size(&self) -> (u64, usize) {
        (self.buf.len() as u64 * 4, self.kept.len())
    }

    /// Where `a`'s probabilities are: with `keep`, its layer's kept `p` (found by its `lse`
    /// offset and its size), else the shared scratch.
    fn probs(&self, a: &Attention, keep: bool) -> *mut f32 {
        let len = score_floats(a.dims);
        let slot = self.kept.iter().find(|&&(lse, n, _)| keep && lse == a.at.lse && n == len);
        slot.map_or(self.scores, |&(_, _, p)| p)
    }

    /// Runs `stages` of `a` over the allocation at `base`: every (sequence, head) in parallel,
    /// each running the stages in turn (a head's stages touch only its own rows and score
    /// matrix); `keep`: its layer keeps its probabilities (`launch::keep_scores`).
    ///
    /// # Safety
    /// The attention's offsets must lie inside the allocation and hold its storage type; the
    /// backward's `p` must have been written first: by its forward (`keep`) or by its own
    /// Scores and Softmax stages.
    pub unsafe fn run(&self, base: *mut u8, stages: &[AttnStage], a: &Attention, keep: bool) {
        let at = |o: u64| base.add(o as usize);
        let bf16 = a.dtype == DType::BF16;
        let t = a.at;
        let ptrs = Ptrs {
            qkv: Storage { ptr: at(t.qkv), bf16 },
            out: Storage { ptr: at(t.out), bf16 },
            lse: at(t.lse) as *mut f32,
            dout: Storage { ptr: t.dout.map_or(std::ptr::null_mut(), at), bf16 },
            dqkv: Storage { ptr: t.dqkv.map_or(std::ptr::null_mut(), at), bf16 },
            p: self.probs(a, keep),
        };
        (0..a.dims.s * a.dims.h).into_par_iter().for_each(|sh| {
            fusec_codegen_cpu::thread_spans::task(|| {
                BUFS.with(|b| stages.iter().for_each(|&stage| head_stage(stage, a.dims, a.scale, &ptrs, sh, &mut b.borrow_mut())))
            });
        });
    }
}

/// Floats in one attention's per-head score matrices, all heads (`S H T²`).
fn score_floats(d: AttnDims) -> usize {
    d.s * d.h * d.t * d.t
}

/// An attention tensor in the arena.
#[derive(Clone, Copy)]
struct Storage {
    ptr: *mut u8,
    bf16: bool,
}

impl Storage {
    /// The `rows x d` matrix at element offset `off` with row stride `rs`, as an f32 view: the
    /// storage itself (f32), or its rows widened into `buf` (bf16).
    ///
    /// # Safety
    /// The matrix must lie inside the storage.
    unsafe fn view(self, off: usize, rows: usize, d: usize, rs: usize, buf: &mut Vec<f32>) -> Mat {
        if !self.bf16 {
            return Mat { ptr: (self.ptr as *const f32).add(off), rs: rs as isize, cs: 1 };
        }
        let b = take(buf, rows * d);
        widen_rows(b, (self.ptr as *const u16).add(off), rows, d, rs);
        Mat { ptr: b.as_ptr(), rs: d as isize, cs: 1 }
    }

    /// Where a product writes the `rows x d` matrix at element offset `off` with row stride
    /// `rs`: `(pointer, row stride)` into the storage (f32), or into `buf` (bf16, then
    /// [`Storage::commit`]).
    ///
    /// # Safety
    /// The matrix must lie inside the storage.
    unsafe fn target(self, off: usize, rows: usize, d: usize, rs: usize, buf: &mut Vec<f32>) -> (*mut f32, isize) {
        if self.bf16 {
            (take(buf, rows * d).as_mut_ptr(), d as isize)
        } else {
            ((self.ptr as *mut f32).add(off), rs as isize)
        }
    }

    /// Rounds a product that [`Storage::target`] put in `buf` into the storage (bf16 only).
    ///
    /// # Safety
    /// As [`Storage::target`], with the same arguments.
    unsafe fn commit(self, off: usize, rows: usize, d: usize, rs: usize, buf: &[f32]) {
        if !self.bf16 {
            return;
        }
        round_rows((self.ptr as *mut u16).add(off), buf, rows, d, rs);
    }
}

/// The tensors of one attention launch and the probabilities `p` (`S * H * T * T` floats).
struct Ptrs {
    qkv: Storage,
    out: Storage,
    lse: *mut f32,
    dout: Storage,
    dqkv: Storage,
    p: *mut f32,
}

// SAFETY: heads touch disjoint parts of the results and of the scratch.
unsafe impl Sync for Ptrs {}

thread_local! {
    /// Per-thread buffers (grown, never shrunk): four for widened heads and results before
    /// rounding, and the head's `ds` (`T x T`) from its `dp` stage to its gradients, per thread
    /// so that it stays in cache from one head to the next (a slot per head in one shared matrix
    /// was a first write to cold memory for every head).
    static BUFS: RefCell<[Vec<f32>; 5]> = const { RefCell::new([const { Vec::new() }; 5]) };
}

/// `v[..len]`, growing `v` first if needed.
fn take(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// Runs `stage` for head `sh` (sequence `sh / H`, head `sh % H`).
///
/// # Safety
/// As [`AttnScratch::stage`].
unsafe fn head_stage(stage: AttnStage, dm: AttnDims, scale: f32, a: &Ptrs, sh: usize, b: &mut [Vec<f32>; 5]) {
    let (t, d, c) = (dm.t, dm.d, dm.h * dm.d);
    let (s, head) = (sh / dm.h, sh % dm.h);
    // Element offsets of this head's part `k` (q, k, v) of `qkv` / `dqkv` (row stride 3C), and
    // of its columns of `out` / `dout` (row stride C).
    let part = |k: usize| s * t * 3 * c + k * c + head * d;
    let row = s * t * c + head * d;
    let p = std::slice::from_raw_parts_mut(a.p.add(sh * t * t), t * t);
    let pm = Mat { ptr: p.as_ptr(), rs: t as isize, cs: 1 };
    let [b0, b1, b2, b3, ds_buf] = b;
    match stage {
        AttnStage::Scores => {
            let (q, k) = (a.qkv.view(part(0), t, d, 3 * c, b0), a.qkv.view(part(1), t, d, 3 * c, b1));
            let kt = transposed(k, t, d, b2);
            for (r0, n, keys) in causal_blocks(t) {
                matmul_small(n, keys, d, p.as_mut_ptr().add(r0 * t), t as isize, shift(q, r0, 0), kt, false)
            }
        }
        AttnStage::Softmax { recompute } => {
            let lse = std::slice::from_raw_parts_mut(a.lse.add(sh * t), t);
            if recompute {
                causal_softmax(p, t, scale, None, lse)
            } else {
                causal_softmax(p, t, scale, Some(lse), &[])
            }
        }
        AttnStage::Values => {
            let v = a.qkv.view(part(2), t, d, 3 * c, b0);
            let (dst, rs) = a.out.target(row, t, d, c, b1);
            for (r0, n, keys) in causal_blocks(t) {
                matmul_small(n, d, keys, dst.offset(r0 as isize * rs), rs, shift(pm, r0, 0), v, false);
            }
            a.out.commit(row, t, d, c, b1);
        }
        AttnStage::GradDp => {
            let (dout, v) = (a.dout.view(row, t, d, c, b0), a.qkv.view(part(2), t, d, 3 * c, b1));
            let vt = transposed(v, t, d, b2);
            let ds = take(ds_buf, t * t).as_mut_ptr();
            for (r0, n, keys) in causal_blocks(t) {
                matmul_small(n, keys, d, ds.add(r0 * t), t as isize, shift(dout, r0, 0), vt, false)
            }
        }
        AttnStage::GradDs => {
            let (dout, out) = (a.dout.view(row, t, d, c, b0), a.out.view(row, t, d, c, b1));
            let ds = take(ds_buf, t * t);
            let line = |m: Mat, i: usize| std::slice::from_raw_parts(m.ptr.offset(i as isize * m.rs), d);
            at_level!(current(), grad_ds(ds, p, t, scale, |i| (line(dout, i), line(out, i))))
        }
        AttnStage::GradQkv => {
            let dsm = Mat { ptr: take(ds_buf, t * t).as_ptr(), rs: t as isize, cs: 1 };
            let (q, k, dout) = (a.qkv.view(part(0), t, d, 3 * c, b0), a.qkv.view(part(1), t, d, 3 * c, b1), a.dout.view(row, t, d, c, b2));
            for (which, lhs, rhs) in [(0, dsm, k), (1, dsm.t(), q), (2, pm.t(), dout)] {
                let (dst, rs) = a.dqkv.target(part(which), t, d, 3 * c, b3);
                for (r0, n, keys) in causal_blocks(t) {
                    let at = dst.offset(r0 as isize * rs);
                    if which == 0 {
                        // dq: a query row reads the keys up to its own.
                        matmul_small(n, d, keys, at, rs, shift(lhs, r0, 0), rhs, false);
                    } else {
                        // dk, dv: a key's sums run over the query rows from its own on.
                        matmul_small(n, d, t - r0, at, rs, shift(lhs, r0, r0), shift(rhs, r0, 0), false);
                    }
                }
                a.dqkv.commit(part(which), t, d, 3 * c, b3);
            }
        }
    }
}

/// Rows of a causal block: the products run block by block, each over the keys up to its last
/// row (for `dk`, `dv`: over the query rows from its first key on), so the zeros above the
/// diagonal are not multiplied. At `T = 256` the products do 62.5% of the full work.
const CAUSAL_BLOCK: usize = 64;

/// The causal row blocks of `t` rows: (first row, rows, keys up to the block's last row).
fn causal_blocks(t: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..t).step_by(CAUSAL_BLOCK).map(move |r0| {
        let n = CAUSAL_BLOCK.min(t - r0);
        (r0, n, r0 + n)
    })
}

/// The `cols x rows` transpose of the `rows x cols` view `m`, row-major in `buf`: the right
/// operand of `q k^T` and `dout v^T` with its rows contiguous, made once a head.
///
/// # Safety
/// `m` must cover its extent.
unsafe fn transposed(m: Mat, rows: usize, cols: usize, buf: &mut Vec<f32>) -> Mat {
    let out = take(buf, rows * cols);
    for i in 0..rows {
        let src = m.ptr.offset(i as isize * m.rs);
        for j in 0..cols {
            out[j * rows + i] = *src.offset(j as isize * m.cs);
        }
    }
    Mat { ptr: out.as_ptr(), rs: rows as isize, cs: 1 }
}

/// `m` from row `r` and column `c` on.
///
/// # Safety
/// The element must lie inside `m`'s memory.
unsafe fn shift(m: Mat, r: usize, c: usize) -> Mat {
    Mat { ptr: m.ptr.offset(r as isize * m.rs + c as isize * m.cs), ..m }
}

/// `ds[i, j] = scale p[i, j] (ds[i, j] - dout_i . out_i)` for `j <= i`, 0 above the diagonal;
/// `rows(i)` gives row `i` of `dout` and `out`.
#[inline(always)]
fn grad_ds<'a>(ds: &mut [f32], p: &[f32], t: usize, scale: f32, rows: impl Fn(usize) -> (&'a [f32], &'a [f32])) {
    for i in 0..t {
        let (dout, out) = rows(i);
        let dsum = dot(dout, out);
        let (row, masked) = ds[i * t..(i + 1) * t].split_at_mut(i + 1);
        row.iter_mut().zip(&p[i * t..=i * t + i]).for_each(|(x, pv)| *x = scale * pv * (*x - dsum));
        masked.fill(0.0);
    }
}

/// `p[i, j] = exp(scale * scores[i, j] - lse_i)` for `j <= i`, 0 above the diagonal. With
/// `lse_out`, the row's log-sum-exp is computed (and `p = e / sum`); otherwise it is read from
/// `lse_in`. Written as maps and 8-lane reductions so that the loops vectorize, and run at the
/// level in use ([`at_level`]).
fn causal_softmax(p: &mut [f32], t: usize, scale: f32, lse_out: Option<&mut [f32]>, lse_in: &[f32]) {
    at_level!(current(), softmax_rows(p, t, scale, lse_out, lse_in))
}

#[inline(always)]
fn softmax_rows(p: &mut [f32], t: usize, scale: f32, lse_out: Option<&mut [f32]>, lse_in: &[f32]) {
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
#[inline(always)]
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

#[inline(always)]
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

#[cfg(test)]
mod tests {
    use super::*;
    use fusec_codegen_cpu::isa::Isa;

    /// The softmax (both forms) and the score gradient give the same bits at every level this
    /// host has as in the SSE2 baseline.
    #[test]
    fn every_level_gives_the_baseline_bits() {
        let (t, d, scale) = (37, 24, 0.3f32);
        let mut x = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
        };
        let scores: Vec<f32> = (0..t * t).map(|_| next()).collect();
        let (dout, out): (Vec<f32>, Vec<f32>) = ((0..t * d).map(|_| next()).collect(), (0..t * d).map(|_| next()).collect());
        let dp: Vec<f32> = (0..t * t).map(|_| next()).collect();
        let run = |isa: Isa| {
            let (mut p, mut lse) = (scores.clone(), vec![0f32; t]);
            at_level!(isa, softmax_rows(&mut p, t, scale, Some(&mut lse), &[]));
            let mut again = scores.clone();
            at_level!(isa, softmax_rows(&mut again, t, scale, None, &lse));
            let mut ds = dp.clone();
            at_level!(isa, grad_ds(&mut ds, &p, t, scale, |i| (&dout[i * d..(i + 1) * d], &out[i * d..(i + 1) * d])));
            [p, lse, again, ds].map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>())
        };
        let base = run(Isa::Scalar);
        for isa in [Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.supported()) {
            assert_eq!(run(isa), base, "{isa:?}");
        }
    }
}
