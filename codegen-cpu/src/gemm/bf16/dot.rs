//! The dot-product path (AVX512-BF16): BLIS-style packing of bf16 pairs and a `vdpbf16ps`
//! micro-kernel.
//!
//! Per tile: the tile's columns of `op(b)` are packed once into panels of [`NR`] columns, each
//! `[k pairs][NR]` of `u32` (the bf16 of rows `2q` and `2q + 1` of a column in the low and high
//! half); then per block of [`MC`] rows, those rows of `op(a)` are packed into panels of [`MR`]
//! rows, `[k pairs][MR]`. Odd `k`, rows past the tile and columns past it are padded with
//! zeros. The micro-kernel keeps an `MR x NR` block of f32 sums in 24 registers and, per pair,
//! broadcasts one `u32` of `a` per row against two 16-lane vectors of `b`; k is walked in
//! blocks of [`KC`] pairs so a `b` panel stays in L1 while every `a` panel of the block
//! passes over it. The block's sums go to per-thread f32 scratch, then the epilogue.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{Job, Tile};

/// Rows of a micro-tile.
const MR: usize = 12;
/// Columns of a micro-tile: two 16-lane vectors.
const NR: usize = 32;
/// Rows of `op(a)` packed at a time (a multiple of [`MR`]).
const MC: usize = 96;
/// k pairs per pass of the micro-kernel over a `b` panel.
const KC: usize = 128;

/// Per-thread buffers (grown, never shrunk): packed `a` and `b`, and the block's f32 sums.
#[derive(Default)]
struct Scratch {
    a: Vec<u32>,
    b: Vec<u32>,
    c: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `v[..len]`, growing `v` first if needed.
fn take<T: Copy + Default>(v: &mut Vec<T>, len: usize) -> &mut [T] {
    if v.len() < len {
        v.resize(len, T::default());
    }
    &mut v[..len]
}

/// Element `(r, c)` of the bf16 matrix at `src` with strides `(rs, cs)`, or 0 for `r >= rows`.
#[inline(always)]
unsafe fn at(src: *const u16, r: usize, c: usize, rows: usize, rs: isize, cs: isize) -> u32 {
    if r < rows {
        *src.offset(r as isize * rs + c as isize * cs) as u32
    } else {
        0
    }
}

/// Packs the `k x nt` matrix `op(b)` (strides `(rs, cs)`) into `dst`: panel `p`, pair `q`,
/// column `jj` at `(p * kp + q) * NR + jj`.
///
/// # Safety
/// `src` must cover the matrix; `dst` must hold `kp * nt.next_multiple_of(NR)` values.
unsafe fn pack_b(src: *const u16, k: usize, nt: usize, rs: isize, cs: isize, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    for p in 0..nt.div_ceil(NR) {
        let panel = &mut dst[p * kp * NR..(p + 1) * kp * NR];
        let cols = (nt - p * NR).min(NR);
        if cols < NR {
            panel.fill(0);
        }
        let src = src.offset((p * NR) as isize * cs);
        if cs == 1 {
            // Rows of `op(b)` are contiguous: interleave two rows at a time.
            for q in 0..kp {
                let out = &mut panel[q * NR..q * NR + cols];
                for (jj, o) in out.iter_mut().enumerate() {
                    *o = at(src, 2 * q, jj, k, rs, 1) | at(src, 2 * q + 1, jj, k, rs, 1) << 16;
                }
            }
        } else {
            // Columns are contiguous (`op(b)` transposed in memory): walk each column.
            for jj in 0..cols {
                for q in 0..kp {
                    panel[q * NR + jj] = at(src, 2 * q, jj, k, rs, cs) | at(src, 2 * q + 1, jj, k, rs, cs) << 16;
                }
            }
        }
    }
}

/// Packs the `mc x k` matrix `op(a)` (strides `(rs, cs)`) into `dst`: panel `r`, pair `q`, row
/// `ii` at `(r * kp + q) * MR + ii`.
///
/// # Safety
/// `src` must cover the matrix; `dst` must hold `kp * mc.next_multiple_of(MR)` values.
unsafe fn pack_a(src: *const u16, mc: usize, k: usize, rs: isize, cs: isize, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    for r in 0..mc.div_ceil(MR) {
        let panel = &mut dst[r * kp * MR..(r + 1) * kp * MR];
        let rows = (mc - r * MR).min(MR);
        if rows < MR {
            panel.fill(0);
        }
        let src = src.offset((r * MR) as isize * rs);
        // `op(a)` transposed: element `(k, i)` of the stored matrix, strides `(cs, rs)`.
        if cs == 1 {
            for ii in 0..rows {
                for q in 0..kp {
                    panel[q * MR + ii] = at(src, 2 * q, ii, k, 1, rs) | at(src, 2 * q + 1, ii, k, 1, rs) << 16;
                }
            }
        } else {
            for q in 0..kp {
                for ii in 0..rows {
                    panel[q * MR + ii] = at(src, 2 * q, ii, k, cs, rs) | at(src, 2 * q + 1, ii, k, cs, rs) << 16;
                }
            }
        }
    }
}

/// `c[MR x NR] (= or +=) a-panel · b-panel` over `kc` pairs; `c` has row stride `ldc`.
///
/// # Safety
/// `a` must hold `kc * MR` values, `b` `kc * NR`, `c` the block; the host must have
/// AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if !first {
        for (i, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm512_loadu_ps(c.add(i * ldc));
            acc[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
        }
    }
    for q in 0..kc {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR) as *const _));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR + 16) as *const _));
        for (i, acc) in acc.iter_mut().enumerate() {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(q * MR + i) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(c.add(i * ldc), acc[0]);
        _mm512_storeu_ps(c.add(i * ldc + 16), acc[1]);
    }
}

/// Computes tile `t` of `job` and its epilogue.
///
/// # Safety
/// The job's pointers must cover its spec, no other task may run tile `t`, and the host must
/// have AVX512-BF16.
pub(super) unsafe fn tile(job: &Job, t: usize) {
    let (s, tl) = (&job.spec, &job.tiling);
    let tile = tl.tile(t, s.n);
    let (a_off, b_off) = tl.operand_offsets(&tile);
    let (kp, ntp) = (s.k.div_ceil(2), tile.nt.next_multiple_of(NR));
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let sc = &mut *guard;
        let bp = take(&mut sc.b, kp * ntp);
        pack_b(job.b.0.offset(b_off), s.k, tile.nt, tl.b_rs, tl.b_cs, bp);
        let bp = bp.as_ptr();
        for ic in (0..tile.mt).step_by(MC) {
            let mc = MC.min(tile.mt - ic);
            let mcp = mc.next_multiple_of(MR);
            let ap = take(&mut sc.a, kp * mcp);
            pack_a(job.a.0.offset(a_off + ic as isize * tl.a_rs), mc, s.k, tl.a_rs, tl.a_cs, ap);
            let ap = ap.as_ptr();
            let c = take(&mut sc.c, mcp * ntp);
            if kp == 0 {
                c.fill(0.0);
            }
            let cp = c.as_mut_ptr();
            for pc in (0..kp).step_by(KC) {
                let kc = KC.min(kp - pc);
                for jr in 0..ntp / NR {
                    let b = bp.add((jr * kp + pc) * NR);
                    for ir in 0..mcp / MR {
                        kernel(ap.add((ir * kp + pc) * MR), b, kc, cp.add(ir * MR * ntp + jr * NR), ntp, pc == 0);
                    }
                }
            }
            job.finish(&Tile { i0: tile.i0 + ic, mt: mc, ..tile }, c, ntp);
        }
    });
}
