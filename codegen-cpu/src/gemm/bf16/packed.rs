//! The packed paths: BLIS-style packing of bf16 operands and a register-blocked micro-kernel
//! ([`Micro`]): AMX tiles or AVX512-BF16 dot products on bf16 pairs, or f32 FMA on values
//! widened while packing (AVX-512F or AVX2), so widening costs no pass of its own.
//!
//! Per tile: the tile's columns of `op(b)` are packed once into panels of `NR` columns, each
//! `[k steps][NR]` of `u32` (a bf16 pair of rows `2q`, `2q + 1` in the low and high half, or
//! one widened f32); then per block of `MC` rows, those rows of `op(a)` are packed into panels
//! of `MR` rows, `[k steps][MR]`. Odd `k` (pairs), rows past the tile and columns past it are
//! padded with zeros. The micro-kernel keeps an `MR x NR` block of f32 sums in registers; k is
//! walked in blocks of `KC` steps so that a `b` panel stays in L1 while every `a` panel of the
//! block passes over it. The block's sums go to per-thread f32 scratch, then the epilogue.
//!
//! Panels packed once for a whole call and shared by its tiles come from [`super::shared`].

use std::cell::RefCell;

use super::shared::Shared;
use super::{widen_bits, Job, Tile};

/// A micro-kernel and its blocking.
pub(super) trait Micro {
    /// Rows and columns of the register block.
    const MR: usize;
    const NR: usize;
    /// k values per packed step: 2 (bf16 pairs) or 1 (widened f32).
    const KU: usize;
    /// Rows of `op(a)` packed at a time (a multiple of `MR`).
    const MC: usize;
    /// k steps per pass of the micro-kernel over a `b` panel.
    const KC: usize;
    /// Each block's k steps are padded with zeros to a multiple of this (AMX: whole tiles).
    const KPAD: usize = 1;
    /// Whether `a` panels are packed row by row (`[MR][k steps]`, AMX tiles) rather than step
    /// by step (`[k steps][MR]`, a broadcast per row and step).
    const A_ROWS: bool = false;

    /// The packed `u32` of k values `lo` (and `hi`, the next k, when `KU` is 2), as bf16 bits.
    fn pack(lo: u16, hi: u16) -> u32;

    /// `c[MR x NR] (= or +=) a-panel · b-panel` over `kc` steps; `c` has row stride `ldc`.
    ///
    /// # Safety
    /// `a` must hold `kc * MR` values, `b` `kc * NR`, `c` the block; the host must have the
    /// kernel's instruction set.
    unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool);
}

/// bf16 pairs for the dot-product kernel.
#[inline(always)]
pub(super) fn pack_pair(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// One value widened to f32, as bits.
#[inline(always)]
pub(super) fn pack_wide(lo: u16, _hi: u16) -> u32 {
    widen_bits(lo).to_bits()
}

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
pub(super) fn take<T: Copy + Default>(v: &mut Vec<T>, len: usize) -> &mut [T] {
    if v.len() < len {
        v.resize(len, T::default());
    }
    &mut v[..len]
}

/// Packs `lines` lines of a matrix whose k index runs down `src` with stride `ks_stride` and
/// whose lines are `line_stride` apart, into `dst`: step `q`, line `l` at `q * width + l`
/// (`width` lines per step, the rest left as they are). Steps whose k values all lie below `k`
/// read without checks; a last half-filled pair pads with zero.
///
/// # Safety
/// `src` must cover `k` values of every line; `dst` must hold `k.div_ceil(KU) * width` values.
#[inline(always)]
unsafe fn pack_lines<M: Micro>(
    src: *const u16,
    lines: usize,
    k: usize,
    k_stride: isize,
    line_stride: isize,
    width: usize,
    dst: &mut [u32],
) {
    let full = k / M::KU;
    let hi_off = if M::KU == 2 { k_stride } else { 0 };
    for q in 0..full {
        let base = src.offset((M::KU * q) as isize * k_stride);
        let out = &mut dst[q * width..q * width + lines];
        if line_stride == 1 {
            // Lines contiguous: a vectorizable map.
            let lo = std::slice::from_raw_parts(base, lines);
            let hi = std::slice::from_raw_parts(base.offset(hi_off), lines);
            for ((o, l), h) in out.iter_mut().zip(lo).zip(hi) {
                *o = M::pack(*l, *h);
            }
        } else {
            for (l, o) in out.iter_mut().enumerate() {
                let p = base.offset(l as isize * line_stride);
                *o = M::pack(*p, *p.offset(hi_off));
            }
        }
    }
    if full * M::KU < k {
        // The last pair has one value: its partner is zero.
        let base = src.offset((M::KU * full) as isize * k_stride);
        for (l, o) in dst[full * width..full * width + lines].iter_mut().enumerate() {
            *o = M::pack(*base.offset(l as isize * line_stride), 0);
        }
    }
}

/// Packs the `k x nt` matrix `op(b)` (strides `(rs, cs)`) into `dst`: panel `p`, step `q`,
/// column `jj` at `(p * ks + q) * NR + jj`, with `ks = k.div_ceil(KU)`.
///
/// # Safety
/// `src` must cover the matrix; `dst` must hold `ks * nt.next_multiple_of(NR)` values.
pub(super) unsafe fn pack_b<M: Micro>(src: *const u16, k: usize, nt: usize, rs: isize, cs: isize, dst: &mut [u32]) {
    let (ks, nr) = (steps::<M>(k), M::NR);
    for p in 0..nt.div_ceil(nr) {
        let panel = &mut dst[p * ks * nr..(p + 1) * ks * nr];
        let cols = (nt - p * nr).min(nr);
        if cols < nr || ks > k.div_ceil(M::KU) {
            panel.fill(0);
        }
        pack_lines::<M>(src.offset((p * nr) as isize * cs), cols, k, rs, cs, nr, panel);
    }
}

/// Packs the `mc x k` matrix `op(a)` (strides `(rs, cs)`) into `dst`: panel `r`, step `q`, row
/// `ii` at `(r * ks + q) * MR + ii`, or with `A_ROWS` at `(r * MR + ii) * ks + q`.
///
/// # Safety
/// `src` must cover the matrix; `dst` must hold `ks * mc.next_multiple_of(MR)` values.
pub(super) unsafe fn pack_a<M: Micro>(src: *const u16, mc: usize, k: usize, rs: isize, cs: isize, dst: &mut [u32]) {
    let (ks, mr) = (steps::<M>(k), M::MR);
    for r in 0..mc.div_ceil(mr) {
        let panel = &mut dst[r * ks * mr..(r + 1) * ks * mr];
        let rows = (mc - r * mr).min(mr);
        if rows < mr || ks > k.div_ceil(M::KU) {
            panel.fill(0);
        }
        let first = src.offset((r * mr) as isize * rs);
        if M::A_ROWS {
            for (ii, row) in panel.chunks_exact_mut(ks).take(rows).enumerate() {
                pack_lines::<M>(first.offset(ii as isize * rs), 1, k, cs, rs, 1, row);
            }
        } else {
            pack_lines::<M>(first, rows, k, cs, rs, mr, panel);
        }
    }
}

/// The packed steps of `k` values: pairs or values, padded to a multiple of `KPAD`.
pub(super) fn steps<M: Micro>(k: usize) -> usize {
    k.div_ceil(M::KU).next_multiple_of(M::KPAD)
}

/// Computes tile `t` of `job` with micro-kernel `M`, then its epilogue.
///
/// BLIS's loop order: per block of `KC` k steps, the block's rows of every tile column of
/// `op(b)` are packed (so they stay in L2 however long k is), then per block of `MC` rows,
/// those rows' part of `op(a)`, and the micro-kernel adds each `MR x NR` product into the
/// tile's f32 sums; after the last k block, each row block's epilogue runs while it is in
/// cache.
///
/// # Safety
/// The job's pointers must cover its spec, no other task may run tile `t`, and the host must
/// have `M`'s instruction set; `shared`'s panels, where present, must be this job's, packed,
/// and its sums slots, where given, must not be another task's.
pub(super) unsafe fn tile<M: Micro>(job: &Job, t: usize, shared: &Shared) {
    let (s, tl) = (&job.spec, &job.tiling);
    let tile = tl.tile(t, s.n);
    let (a_off, b_off) = tl.operand_offsets(&tile);
    let (ks, ntp, mtp) = (s.k.div_ceil(M::KU), tile.nt.next_multiple_of(M::NR), tile.mt.next_multiple_of(M::MR));
    let (a_src, b_src) = (job.a.0.offset(a_off), job.b.0.offset(b_off));
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let sc = &mut *guard;
        let c = match shared.sums {
            Some((sums, slot)) => std::slice::from_raw_parts_mut(sums.add(t * slot), mtp * ntp),
            None => take(&mut sc.c, mtp * ntp),
        };
        if ks == 0 {
            c.fill(0.0);
            job.finish(&tile, c, ntp);
            return;
        }
        let cp = c.as_mut_ptr();
        for kb in shared.blocks.clone().unwrap_or(0..ks.div_ceil(M::KC)) {
            let pc = kb * M::KC;
            let kc = M::KC.min(ks - pc);
            // k values `k0..k1` of this block, packed as `kp` steps.
            let (k0, k1) = (pc * M::KU, ((pc + kc) * M::KU).min(s.k));
            let kp = steps::<M>(k1 - k0);
            let bp = match &shared.b {
                Some(sb) => sb.at(tile.z, tile.j0 / tl.tile_n, kb, 0),
                None => {
                    let bp = take(&mut sc.b, kp * ntp);
                    pack_b::<M>(b_src.offset(k0 as isize * tl.b_rs), k1 - k0, tile.nt, tl.b_rs, tl.b_cs, bp);
                    bp.as_ptr()
                }
            };
            let last = pc + kc == ks;
            for ic in (0..tile.mt).step_by(M::MC) {
                let mc = M::MC.min(tile.mt - ic);
                let mcp = mc.next_multiple_of(M::MR);
                let ap = match &shared.a {
                    Some(sa) => sa.at(tile.z, tile.i0 / tl.tile_m, kb, ic / M::MC),
                    None => {
                        let ap = take(&mut sc.a, kp * mcp);
                        pack_a::<M>(a_src.offset(ic as isize * tl.a_rs + k0 as isize * tl.a_cs), mc, k1 - k0, tl.a_rs, tl.a_cs, ap);
                        ap.as_ptr()
                    }
                };
                for jr in 0..ntp / M::NR {
                    let b = bp.add(jr * kp * M::NR);
                    for ir in 0..mcp / M::MR {
                        let c = cp.add((ic + ir * M::MR) * ntp + jr * M::NR);
                        M::kernel(ap.add(ir * kp * M::MR), b, kp, c, ntp, pc == 0);
                    }
                }
                if last {
                    let rows = std::slice::from_raw_parts_mut(cp.add(ic * ntp), mc * ntp);
                    job.finish(&Tile { i0: tile.i0 + ic, mt: mc, ..tile }, rows, ntp);
                }
            }
        }
    });
}
