//! The row routines in 16 lanes (AVX-512F).

use std::arch::x86_64::*;

use super::x86::{combine_max, tree_sum, Elem, Prefetch, C1, C2, EXP_HI, EXP_LO, EXP_P, LOG2E, MAGIC, TANH_P, TANH_SMALL};

#[inline(always)]
unsafe fn splat(x: f32) -> __m512 {
    _mm512_set1_ps(x)
}

/// `c[0] x^n + ...`, as `Fx::horner`: multiply, then add, one rounding each.
#[inline(always)]
unsafe fn horner(x: __m512, cs: &[f32]) -> __m512 {
    let mut p = splat(cs[0]);
    for &c in &cs[1..] {
        p = _mm512_mul_ps(p, x);
        p = _mm512_add_ps(p, splat(c));
    }
    p
}

/// `math::exp` on 16 lanes.
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    let hi = splat(EXP_HI);
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, hi), x, hi);
    let lo = splat(EXP_LO);
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo), x, lo);
    let t = _mm512_mul_ps(x, splat(LOG2E));
    let tm = _mm512_add_ps(t, splat(MAGIC));
    let n = _mm512_sub_ps(tm, splat(MAGIC));
    let ni = _mm512_sub_epi32(_mm512_castps_si512(tm), _mm512_set1_epi32(MAGIC.to_bits() as i32));
    let r1 = _mm512_sub_ps(x, _mm512_mul_ps(n, splat(C1)));
    let r = _mm512_sub_ps(r1, _mm512_mul_ps(n, splat(C2)));
    let z = _mm512_mul_ps(r, r);
    let p = horner(r, &EXP_P);
    let pz = _mm512_mul_ps(p, z);
    let pr = _mm512_add_ps(pz, r);
    let y = _mm512_add_ps(pr, splat(1.0));
    let n1 = _mm512_srai_epi32::<1>(ni);
    let n2 = _mm512_sub_epi32(ni, n1);
    let bias = _mm512_set1_epi32(127);
    let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n1, bias)));
    let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n2, bias)));
    _mm512_mul_ps(_mm512_mul_ps(y, s1), s2)
}

/// `math::tanh` on 16 lanes.
#[inline(always)]
unsafe fn tanh16(x: __m512) -> __m512 {
    let a = _mm512_abs_ps(x);
    let z = _mm512_mul_ps(x, x);
    let p = horner(z, &TANH_P);
    let pz = _mm512_mul_ps(p, z);
    let pzx = _mm512_mul_ps(pz, x);
    let small_v = _mm512_add_ps(pzx, x);
    let a2 = _mm512_add_ps(a, a);
    let e = exp16(a2);
    let e1 = _mm512_add_ps(e, splat(1.0));
    let q = _mm512_div_ps(splat(2.0), e1);
    let t = _mm512_sub_ps(splat(1.0), q);
    let nt = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(t), _mm512_set1_epi32(i32::MIN)));
    let neg = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, splat(0.0));
    let large_v = _mm512_mask_blend_ps(neg, t, nt);
    let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, splat(TANH_SMALL));
    _mm512_mask_blend_ps(small, large_v, small_v)
}

/// How a routine reads its source row: f32, or bf16 widened exactly (the same values, so the
/// same results).
pub(super) trait Load16 {
    /// Lanes `i..i + 16`.
    unsafe fn load(src: *const u8, i: usize) -> __m512;
    /// Lanes `i..i + k` (`k < 16`), zeros after them; reads nothing past them.
    unsafe fn part(src: *const u8, i: usize, k: usize) -> __m512;
    /// The element type, for the scalar tail of a row max.
    type Elem: Elem;
}

/// f32 rows.
pub(super) struct F32s;
/// bf16 rows.
pub(super) struct Bf16s;

impl Load16 for F32s {
    type Elem = f32;
    #[inline(always)]
    unsafe fn load(src: *const u8, i: usize) -> __m512 {
        _mm512_loadu_ps((src as *const f32).add(i))
    }
    #[inline(always)]
    unsafe fn part(src: *const u8, i: usize, k: usize) -> __m512 {
        _mm512_maskz_loadu_ps(((1u32 << k) - 1) as __mmask16, (src as *const f32).add(i))
    }
}

impl Load16 for Bf16s {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load(src: *const u8, i: usize) -> __m512 {
        let h = _mm256_loadu_si256((src as *const u16).add(i) as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[inline(always)]
    unsafe fn part(src: *const u8, i: usize, k: usize) -> __m512 {
        let mut b = [0u16; 16];
        std::ptr::copy_nonoverlapping((src as *const u16).add(i), b.as_mut_ptr(), k);
        Self::load(b.as_ptr() as *const u8, 0)
    }
}

/// The 16 lanes of `v`.
#[inline(always)]
unsafe fn lanes(v: __m512) -> [f32; 16] {
    let mut l = [0f32; 16];
    _mm512_storeu_ps(l.as_mut_ptr(), v);
    l
}

/// `dst[i] = f(src[i] - shift)` for `i < n`, 16 lanes at a time (masked tails), while
/// prefetching; returns the row sum of the results in the column loop's order (see
/// [`tree_sum`]; the last `n % 4` columns added in order).
#[inline(always)]
unsafe fn map<L: Load16>(
    dst: *mut f32,
    n: usize,
    src: *const u8,
    shift: f32,
    pf: [(*const u8, usize); 3],
    f: impl Fn(__m512) -> __m512,
) -> f32 {
    let store = !dst.is_null();
    let shift = _mm512_set1_ps(shift);
    let mut pf = Prefetch::new(pf, n);
    let n4 = n / 4 * 4;
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n4 {
        pf.step();
        let a = f(_mm512_sub_ps(L::load(src, i), shift));
        let b = f(_mm512_sub_ps(L::load(src, i + 16), shift));
        if store {
            _mm512_storeu_ps(dst.add(i), a);
            _mm512_storeu_ps(dst.add(i + 16), b);
        }
        acc = _mm512_add_ps(acc, a);
        acc = _mm512_add_ps(acc, b);
        i += 32;
    }
    // Whole vectors of four: lanes of the sum as in the loop.
    while i < n4 {
        let rest = (n4 - i).min(16);
        let m: __mmask16 = if rest == 16 { 0xffff } else { (1u16 << rest) - 1 };
        let x = if rest == 16 { L::load(src, i) } else { L::part(src, i, rest) };
        let a = f(_mm512_sub_ps(x, shift));
        if store {
            _mm512_mask_storeu_ps(dst.add(i), m, a);
        }
        acc = _mm512_mask_add_ps(acc, m, acc, a);
        i += rest;
    }
    let mut sum = tree_sum(&lanes(acc));
    // The scalar tail columns, in order.
    if n4 < n {
        let m: __mmask16 = (1u16 << (n - n4)) - 1;
        let a = f(_mm512_sub_ps(L::part(src, n4, n - n4), shift));
        if store {
            _mm512_mask_storeu_ps(dst.add(n4), m, a);
        }
        for x in &lanes(a)[..n - n4] {
            sum += *x;
        }
    }
    sum
}

#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512<L: Load16>(dst: *mut f32, n: u64, src: *const u8, shift: f32, pf: [(*const u8, usize); 3]) -> f32 {
    map::<L>(dst, n as usize, src, shift, pf, |x| exp16(x))
}

#[target_feature(enable = "avx512f")]
unsafe fn tanh_avx512<L: Load16>(dst: *mut f32, n: u64, src: *const u8, shift: f32, pf: [(*const u8, usize); 3]) -> f32 {
    map::<L>(dst, n as usize, src, shift, pf, |x| tanh16(x))
}

super::x86::row_fns!(exp_row, exp_row_bf16, exp_avx512);
super::x86::row_fns!(tanh_row, tanh_row_bf16, tanh_avx512);

#[target_feature(enable = "avx512f")]
unsafe fn max_avx512<L: Load16>(src: *const u8, n: u64, n4: u64) -> f32 {
    let (n, n4) = (n as usize, n4 as usize);
    // Four independent chains over interleaved blocks of 16 (one chain would wait on the
    // compare-and-blend latency), combined in block order.
    let mut accs = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
    let mut nan: __mmask16 = 0;
    let mut i = 0;
    while i + 64 <= n4 {
        for (k, acc) in accs.iter_mut().enumerate() {
            let x = L::load(src, i + 16 * k);
            let lt = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(*acc, x);
            *acc = _mm512_mask_blend_ps(lt, *acc, x);
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        }
        i += 64;
    }
    let mut acc = accs[0];
    for a in &accs[1..] {
        let lt = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(acc, *a);
        acc = _mm512_mask_blend_ps(lt, acc, *a);
    }
    while i + 16 <= n4 {
        let x = L::load(src, i);
        let lt = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(acc, x);
        acc = _mm512_mask_blend_ps(lt, acc, x);
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        i += 16;
    }
    if i < n4 {
        let m: __mmask16 = (1u16 << (n4 - i)) - 1;
        let x = L::part(src, i, n4 - i);
        let lt = _mm512_mask_cmp_ps_mask::<_CMP_LT_OQ>(m, acc, x);
        acc = _mm512_mask_blend_ps(lt, acc, x);
        nan |= _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(m, x, x);
    }
    combine_max::<L::Elem>(&lanes(acc), nan, src, n4, n)
}

super::x86::max_fns!(max_row, max_row_bf16, max_avx512);

/// `y[i] (= or +=) gelu(t[i])` on 16 lanes, with the operations of the scalar
/// [`crate::gemm::gelu`] in its order (the same bits); the last `len % 16` in scalar code.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn gelu_rows(y: &mut [f32], t: &[f32], accumulate: bool) {
    let n = y.len().min(t.len());
    let (c, s) = (splat(0.044715), splat(crate::gemm::gelu_scale()));
    let mut i = 0;
    while i + 16 <= n {
        let x = _mm512_loadu_ps(t.as_ptr().add(i));
        let cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(c, x), x), x);
        let th = tanh16(_mm512_mul_ps(s, _mm512_add_ps(x, cube)));
        let mut g = _mm512_mul_ps(_mm512_mul_ps(splat(0.5), x), _mm512_add_ps(splat(1.0), th));
        if accumulate {
            g = _mm512_add_ps(_mm512_loadu_ps(y.as_ptr().add(i)), g);
        }
        _mm512_storeu_ps(y.as_mut_ptr().add(i), g);
        i += 16;
    }
    super::x86::gelu_tail(&mut y[i..n], &t[i..n], accumulate);
}
