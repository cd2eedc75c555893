//! Small single-threaded products on AVX-512 registers, for attention's per-head stages
//! (`64 × keys × 64` and `64 × 64 × keys` blocks): the `gemm` crate packs both operands on every
//! call and ran these at about 60% of its large products' rate. Here the right operand's rows
//! are read in place (attention makes them contiguous), the left operand's elements are
//! broadcast from wherever they are, and each 6-row by 64-column block of the result stays in 24
//! registers over the whole contraction.

use super::strided::{matmul_strided, Mat};

/// Rows of the result a register block holds.
const MR: usize = 6;
/// Largest product [`matmul_small`] takes on (elements of `dst`, and contraction length).
const MAX_MN: usize = 64 * 1024;
const MAX_K: usize = 4096;

/// `dst = lhs · rhs` (`accumulate`: `dst += lhs · rhs`), as [`matmul_strided`]: a plain
/// product that is small and whose right operand has contiguous rows, on a host with AVX-512F,
/// runs on the register blocks above (every element one FMA chain over `k` in order); anything
/// else is [`matmul_strided`].
///
/// # Safety
/// As [`matmul_strided`].
pub unsafe fn matmul_small(m: usize, n: usize, k: usize, dst: *mut f32, dst_rs: isize, lhs: Mat, rhs: Mat, accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if !accumulate && rhs.cs == 1 && m * n <= MAX_MN && k <= MAX_K && k > 0 && enabled() {
            return avx512::run(m, n, k, dst, dst_rs, lhs, rhs.ptr, rhs.rs);
        }
    }
    matmul_strided(m, n, k, dst, dst_rs, lhs, rhs, accumulate)
}

/// AVX-512F on this host, unless `FUSEC_SMALL_PRODUCTS=0` keeps the crate (for comparisons).
#[cfg(target_arch = "x86_64")]
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FUSEC_SMALL_PRODUCTS").map_or(true, |v| v != "0") && std::arch::is_x86_feature_detected!("avx512f"))
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Mat, MR};

    /// [`super::matmul_small`]'s product with `b` row-major (row stride `b_rs`, unit column
    /// stride).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run(m: usize, n: usize, k: usize, dst: *mut f32, dst_rs: isize, a: Mat, b: *const f32, b_rs: isize) {
        let mut j0 = 0;
        while j0 < n {
            let w = (n - j0).min(64);
            let mut i0 = 0;
            while i0 < m {
                let rows = (m - i0).min(MR);
                let a0 = Mat { ptr: a.ptr.offset(i0 as isize * a.rs), ..a };
                let c0 = dst.offset(i0 as isize * dst_rs + j0 as isize);
                let b0 = b.add(j0);
                match rows {
                    6 => block::<6>(k, w, c0, dst_rs, a0, b0, b_rs),
                    5 => block::<5>(k, w, c0, dst_rs, a0, b0, b_rs),
                    4 => block::<4>(k, w, c0, dst_rs, a0, b0, b_rs),
                    3 => block::<3>(k, w, c0, dst_rs, a0, b0, b_rs),
                    2 => block::<2>(k, w, c0, dst_rs, a0, b0, b_rs),
                    _ => block::<1>(k, w, c0, dst_rs, a0, b0, b_rs),
                }
                i0 += rows;
            }
            j0 += w;
        }
    }

    /// `R` rows by `w <= 64` columns of the result: four 16-lane vectors a row, the last masked.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block<const R: usize>(k: usize, w: usize, c: *mut f32, c_rs: isize, a: Mat, b: *const f32, b_rs: isize) {
        let masks: [__mmask16; 4] = std::array::from_fn(|v| {
            let left = w.saturating_sub(16 * v).min(16);
            ((1u32 << left) - 1) as __mmask16
        });
        let mut s = [[_mm512_setzero_ps(); 4]; R];
        for p in 0..k {
            let bp = b.offset(p as isize * b_rs);
            let bv: [__m512; 4] = std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], bp.add(16 * v)));
            let ap = a.ptr.offset(p as isize * a.cs);
            for (i, row) in s.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*ap.offset(i as isize * a.rs));
                for v in 0..4 {
                    row[v] = _mm512_fmadd_ps(x, bv[v], row[v]);
                }
            }
        }
        for (i, row) in s.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                _mm512_mask_storeu_ps(c.offset(i as isize * c_rs + 16 * v as isize), masks[v], *x);
            }
        }
    }
}
