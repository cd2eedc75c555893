//! What the AVX2 and AVX-512 row routines share: the polynomials, the prefetch schedule, and
//! the final combination of a row max's 16 lanes.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};

/// The Cephes `expf` polynomial, highest degree first (as `math::exp`).
#[allow(clippy::excessive_precision)]
pub(super) const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];
/// The Cephes `tanhf` polynomial (as `math::tanh`).
#[allow(clippy::excessive_precision)]
pub(super) const TANH_P: [f32; 5] = [-5.704_988_7e-3, 2.063_908_9e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328_2e-1];
/// `exp`'s argument range and Cody-Waite constants (as `math::exp`).
pub(super) const EXP_HI: f32 = 89.0;
pub(super) const EXP_LO: f32 = -104.0;
pub(super) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(super) const C1: f32 = 0.693_359_4;
#[allow(clippy::excessive_precision)]
pub(super) const C2: f32 = -2.121_944_4e-4;
/// `2^23 + 2^22`: adding it rounds to an integer held in the low mantissa bits.
pub(super) const MAGIC: f32 = 12_582_912.0;
/// `tanh` switches from the odd polynomial to `1 - 2 / (e^{2|x|} + 1)` at this `|x|`.
pub(super) const TANH_SMALL: f32 = 0.625;

/// Byte ranges to prefetch into L2 while a row is computed (the next row of up to three
/// operands and results), a few cache lines per 32 elements so the requests spread over it.
pub(super) struct Prefetch {
    streams: [(*const u8, usize); 3],
    per: usize,
}

impl Prefetch {
    /// The schedule for a row of `n` elements.
    pub(super) fn new(streams: [(*const u8, usize); 3], n: usize) -> Prefetch {
        let lines: usize = streams.iter().map(|s| s.1.div_ceil(64)).sum();
        Prefetch { streams, per: lines.div_ceil(n.div_ceil(32).max(1)) }
    }

    /// Issues the next iteration's prefetches (the addresses need not be valid memory).
    #[inline(always)]
    pub(super) fn step(&mut self) {
        let mut k = 0;
        for s in self.streams.iter_mut() {
            while k < self.per && s.1 > 0 {
                // SAFETY: a prefetch never faults, whatever the address.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(s.0 as *const i8) };
                s.0 = s.0.wrapping_add(64);
                s.1 = s.1.saturating_sub(64);
                k += 1;
            }
        }
    }
}

/// `max_nan(a, b)` of the generated code: `b` if `b > a` or `b` is NaN, else `a`.
#[inline(always)]
fn max_nan(a: f32, b: f32) -> f32 {
    if b > a || b.is_nan() {
        b
    } else {
        a
    }
}

/// An element type of source rows, read as f32 (bf16 widened exactly).
pub(super) trait Elem {
    /// Element `i` of the row at `src`.
    unsafe fn at(src: *const u8, i: usize) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn at(src: *const u8, i: usize) -> f32 {
        *(src as *const f32).add(i)
    }
}

impl Elem for u16 {
    #[inline(always)]
    unsafe fn at(src: *const u8, i: usize) -> f32 {
        f32::from_bits((*(src as *const u16).add(i) as u32) << 16)
    }
}

/// A row max from its 16 lane maxima `l` (column `c < n4` went to lane `c % 16`) and their NaN
/// flags, as the column loop combines them: copies `(0 ⊕ 1) ⊕ (2 ⊕ 3)` with
/// `a ⊕ b = a < b ? b : a`, NaN flags or-ed, NaN lanes set to NaN, then lanes
/// `(0 ⊕' 1) ⊕' (2 ⊕' 3)` with `max_nan`, then the tail columns `n4..n` in order.
///
/// # Safety
/// `src[n4..n]` must be valid for reads.
pub(super) unsafe fn combine_max<E: Elem>(l: &[f32; 16], nan: u16, src: *const u8, n4: usize, n: usize) -> f32 {
    let pick = |a: f32, b: f32| if a < b { b } else { a };
    let mut v = [0f32; 4];
    for (j, v) in v.iter_mut().enumerate() {
        let c = pick(pick(l[j], l[4 + j]), pick(l[8 + j], l[12 + j]));
        let flag = (nan >> j) & 1 | (nan >> (4 + j)) & 1 | (nan >> (8 + j)) & 1 | (nan >> (12 + j)) & 1;
        *v = if flag != 0 { f32::NAN } else { c };
    }
    let mut m = max_nan(max_nan(v[0], v[1]), max_nan(v[2], v[3]));
    for c in n4..n {
        m = max_nan(m, E::at(src, c));
    }
    m
}

/// The row sum from the 16 lane sums `l` (column `c < n4` added into lane `c % 16`) as the
/// column loop combines its partial sums: lane `4k + j` is lane `j` of accumulator copy `k`;
/// copies `(0 + 1) + (2 + 3)`, then lanes `(0 + 1) + (2 + 3)`.
#[inline(always)]
pub(super) fn tree_sum(l: &[f32; 16]) -> f32 {
    let mut v = [0f32; 4];
    for (j, v) in v.iter_mut().enumerate() {
        *v = (l[j] + l[4 + j]) + (l[8 + j] + l[12 + j]);
    }
    (v[0] + v[1]) + (v[2] + v[3])
}

/// The `extern "C"` entry points ([`super::RowFn`]) of a row map `$inner::<L>` for f32 and bf16
/// source rows (`F32s` / `Bf16s` of the invoking module).
macro_rules! row_fns {
    ($f32:ident, $bf16:ident, $inner:ident) => {
        /// The row map over an f32 source row ([`super::RowFn`]).
        ///
        /// # Safety
        /// `dst[..n]` must be valid for writes (or `dst` null) and `src[..n]` for reads (they
        /// may be the same buffer), and the host must have the instruction set named in the
        /// module (the prefetched ranges need not be valid).
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe extern "C" fn $f32(
            dst: *mut f32,
            n: u64,
            src: *const u8,
            shift: f32,
            a: *const u8,
            an: u64,
            b: *const u8,
            bn: u64,
            c: *const u8,
            cn: u64,
        ) -> f32 {
            $inner::<F32s>(dst, n, src, shift, [(a, an as usize), (b, bn as usize), (c, cn as usize)])
        }

        /// The row map over a bf16 source row (widened exactly: the f32 routine's results).
        ///
        /// # Safety
        /// As the f32 version, with `src[..n]` bf16.
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe extern "C" fn $bf16(
            dst: *mut f32,
            n: u64,
            src: *const u8,
            shift: f32,
            a: *const u8,
            an: u64,
            b: *const u8,
            bn: u64,
            c: *const u8,
            cn: u64,
        ) -> f32 {
            $inner::<Bf16s>(dst, n, src, shift, [(a, an as usize), (b, bn as usize), (c, cn as usize)])
        }
    };
}
pub(super) use row_fns;

/// The `extern "C"` entry points ([`super::MaxFn`]) of a row max `$inner::<L>` for f32 and bf16
/// source rows.
macro_rules! max_fns {
    ($f32:ident, $bf16:ident, $inner:ident) => {
        /// The row max of an f32 row ([`super::MaxFn`]).
        ///
        /// # Safety
        /// `src[..n]` must be valid for reads and the host must have the module's instruction
        /// set.
        pub(super) unsafe extern "C" fn $f32(src: *const u8, n: u64, n4: u64) -> f32 {
            $inner::<F32s>(src, n, n4)
        }

        /// The row max of a bf16 row (widened exactly).
        ///
        /// # Safety
        /// As the f32 version, with `src[..n]` bf16.
        pub(super) unsafe extern "C" fn $bf16(src: *const u8, n: u64, n4: u64) -> f32 {
            $inner::<Bf16s>(src, n, n4)
        }
    };
}
pub(super) use max_fns;

/// The scalar end of a GELU row: [`crate::gemm::gelu`] element by element.
pub(super) fn gelu_tail(y: &mut [f32], t: &[f32], accumulate: bool) {
    for (v, x) in y.iter_mut().zip(t) {
        *v = if accumulate { *v + crate::gemm::gelu(*x) } else { crate::gemm::gelu(*x) };
    }
}
