//! The row routines in 8 lanes (AVX2), bit for bit the AVX-512 routines' results: a 16-lane
//! value of those is a pair of halves here, `(lanes 0..8, lanes 8..16)`, so sums and maxima
//! see every column in the same lane and the same order.

use std::arch::x86_64::*;

use super::x86::{combine_max, tree_sum, Elem, Prefetch, C1, C2, EXP_HI, EXP_LO, EXP_P, LOG2E, MAGIC, TANH_P, TANH_SMALL};

#[inline(always)]
unsafe fn splat(x: f32) -> __m256 {
    _mm256_set1_ps(x)
}

/// `c[0] x^n + ...`, as `Fx::horner`: multiply, then add, one rounding each.
#[inline(always)]
unsafe fn horner(x: __m256, cs: &[f32]) -> __m256 {
    let mut p = splat(cs[0]);
    for &c in &cs[1..] {
        p = _mm256_mul_ps(p, x);
        p = _mm256_add_ps(p, splat(c));
    }
    p
}

/// `math::exp` on 8 lanes (the operations of `avx512::exp16`).
#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    let hi = splat(EXP_HI);
    let x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi));
    let lo = splat(EXP_LO);
    let x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo));
    let t = _mm256_mul_ps(x, splat(LOG2E));
    let tm = _mm256_add_ps(t, splat(MAGIC));
    let n = _mm256_sub_ps(tm, splat(MAGIC));
    let ni = _mm256_sub_epi32(_mm256_castps_si256(tm), _mm256_set1_epi32(MAGIC.to_bits() as i32));
    let r1 = _mm256_sub_ps(x, _mm256_mul_ps(n, splat(C1)));
    let r = _mm256_sub_ps(r1, _mm256_mul_ps(n, splat(C2)));
    let z = _mm256_mul_ps(r, r);
    let p = horner(r, &EXP_P);
    let pz = _mm256_mul_ps(p, z);
    let pr = _mm256_add_ps(pz, r);
    let y = _mm256_add_ps(pr, splat(1.0));
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let bias = _mm256_set1_epi32(127);
    let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
    let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
    _mm256_mul_ps(_mm256_mul_ps(y, s1), s2)
}

/// `math::tanh` on 8 lanes (the operations of `avx512::tanh16`).
#[inline(always)]
unsafe fn tanh8(x: __m256) -> __m256 {
    let a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX)));
    let z = _mm256_mul_ps(x, x);
    let p = horner(z, &TANH_P);
    let pz = _mm256_mul_ps(p, z);
    let pzx = _mm256_mul_ps(pz, x);
    let small_v = _mm256_add_ps(pzx, x);
    let a2 = _mm256_add_ps(a, a);
    let e = exp8(a2);
    let e1 = _mm256_add_ps(e, splat(1.0));
    let q = _mm256_div_ps(splat(2.0), e1);
    let t = _mm256_sub_ps(splat(1.0), q);
    let nt = _mm256_xor_ps(t, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN)));
    let large_v = _mm256_blendv_ps(t, nt, _mm256_cmp_ps::<_CMP_LT_OQ>(x, splat(0.0)));
    _mm256_blendv_ps(large_v, small_v, _mm256_cmp_ps::<_CMP_LT_OQ>(a, splat(TANH_SMALL)))
}

/// All-ones in the first `k` lanes (`k` may exceed 8 or be negative).
#[inline(always)]
unsafe fn first(k: i64) -> __m256i {
    let k = k.clamp(0, 8) as i32;
    _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// How a routine reads its source row: f32, or bf16 widened exactly.
pub(super) trait Load8 {
    /// Lanes `i..i + 8`.
    unsafe fn load(src: *const u8, i: usize) -> __m256;
    /// Lanes `i..i + k` (`k < 8`), zeros after them; reads nothing past them.
    unsafe fn part(src: *const u8, i: usize, k: usize) -> __m256;
    /// The element type, for the scalar tail of a row max.
    type Elem: Elem;
}

/// f32 rows.
pub(super) struct F32s;
/// bf16 rows.
pub(super) struct Bf16s;

impl Load8 for F32s {
    type Elem = f32;
    #[inline(always)]
    unsafe fn load(src: *const u8, i: usize) -> __m256 {
        _mm256_loadu_ps((src as *const f32).add(i))
    }
    #[inline(always)]
    unsafe fn part(src: *const u8, i: usize, k: usize) -> __m256 {
        _mm256_maskload_ps((src as *const f32).add(i), first(k as i64))
    }
}

impl Load8 for Bf16s {
    type Elem = u16;
    #[inline(always)]
    unsafe fn load(src: *const u8, i: usize) -> __m256 {
        let h = _mm_loadu_si128((src as *const u16).add(i) as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
    #[inline(always)]
    unsafe fn part(src: *const u8, i: usize, k: usize) -> __m256 {
        let mut b = [0u16; 8];
        std::ptr::copy_nonoverlapping((src as *const u16).add(i), b.as_mut_ptr(), k);
        Self::load(b.as_ptr() as *const u8, 0)
    }
}

/// Lanes `i..i + k` of the row (`k <= 8`; zeros after them).
#[inline(always)]
unsafe fn load_upto<L: Load8>(src: *const u8, i: usize, k: usize) -> __m256 {
    if k >= 8 {
        L::load(src, i)
    } else if k == 0 {
        _mm256_setzero_ps()
    } else {
        L::part(src, i, k)
    }
}

/// The 16 lanes of the pair `(lo, hi)`.
#[inline(always)]
unsafe fn lanes(lo: __m256, hi: __m256) -> [f32; 16] {
    let mut l = [0f32; 16];
    _mm256_storeu_ps(l.as_mut_ptr(), lo);
    _mm256_storeu_ps(l.as_mut_ptr().add(8), hi);
    l
}

/// `dst[i] = f(src[i] - shift)` for `i < n`, 8 lanes at a time (masked tails), while
/// prefetching; returns the row sum of the results in the column loop's order (column
/// `c < n4` into lane `c % 16` of the pair of accumulators, then [`tree_sum`]; the last
/// `n % 4` columns added in order).
#[inline(always)]
unsafe fn map<L: Load8>(
    dst: *mut f32,
    n: usize,
    src: *const u8,
    shift: f32,
    pf: [(*const u8, usize); 3],
    f: impl Fn(__m256) -> __m256,
) -> f32 {
    let store = !dst.is_null();
    let shift = _mm256_set1_ps(shift);
    let mut pf = Prefetch::new(pf, n);
    let n4 = n / 4 * 4;
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i + 32 <= n4 {
        pf.step();
        let mut v = [_mm256_setzero_ps(); 4];
        for (k, v) in v.iter_mut().enumerate() {
            *v = f(_mm256_sub_ps(L::load(src, i + 8 * k), shift));
            if store {
                _mm256_storeu_ps(dst.add(i + 8 * k), *v);
            }
        }
        acc[0] = _mm256_add_ps(acc[0], v[0]);
        acc[1] = _mm256_add_ps(acc[1], v[1]);
        acc[0] = _mm256_add_ps(acc[0], v[2]);
        acc[1] = _mm256_add_ps(acc[1], v[3]);
        i += 32;
    }
    // Whole vectors of four: column `i` goes to half `(i % 16) / 8`, as in the loop.
    while i < n4 {
        let rest = (n4 - i).min(8);
        let m = first(rest as i64);
        let a = f(_mm256_sub_ps(load_upto::<L>(src, i, rest), shift));
        if store {
            _mm256_maskstore_ps(dst.add(i), m, a);
        }
        let h = &mut acc[(i % 16) / 8];
        *h = _mm256_blendv_ps(*h, _mm256_add_ps(*h, a), _mm256_castsi256_ps(m));
        i += rest;
    }
    let mut sum = tree_sum(&lanes(acc[0], acc[1]));
    // The scalar tail columns, in order.
    if n4 < n {
        let m = first((n - n4) as i64);
        let a = f(_mm256_sub_ps(L::part(src, n4, n - n4), shift));
        if store {
            _mm256_maskstore_ps(dst.add(n4), m, a);
        }
        for x in &lanes(a, a)[..n - n4] {
            sum += *x;
        }
    }
    sum
}

#[target_feature(enable = "avx2")]
unsafe fn exp_avx2<L: Load8>(dst: *mut f32, n: u64, src: *const u8, shift: f32, pf: [(*const u8, usize); 3]) -> f32 {
    map::<L>(dst, n as usize, src, shift, pf, |x| exp8(x))
}

#[target_feature(enable = "avx2")]
unsafe fn tanh_avx2<L: Load8>(dst: *mut f32, n: u64, src: *const u8, shift: f32, pf: [(*const u8, usize); 3]) -> f32 {
    map::<L>(dst, n as usize, src, shift, pf, |x| tanh8(x))
}

super::x86::row_fns!(exp_row, exp_row_bf16, exp_avx2);
super::x86::row_fns!(tanh_row, tanh_row_bf16, tanh_avx2);

/// One step of a max chain over a 16-lane block: `acc = acc < x ? x : acc` in the lanes of
/// `m`, and the NaN flags of `x` in those lanes.
#[inline(always)]
unsafe fn max_step(acc: &mut [__m256; 2], nan: &mut [__m256; 2], x: [__m256; 2], m: [__m256; 2]) {
    for h in 0..2 {
        let lt = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(acc[h], x[h]), m[h]);
        acc[h] = _mm256_blendv_ps(acc[h], x[h], lt);
        nan[h] = _mm256_or_ps(nan[h], _mm256_and_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(x[h], x[h]), m[h]));
    }
}

#[target_feature(enable = "avx2")]
unsafe fn max_avx2<L: Load8>(src: *const u8, n: u64, n4: u64) -> f32 {
    let (n, n4) = (n as usize, n4 as usize);
    // The chains of `avx512::max_avx512`, each a pair of halves.
    let all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    let load = |at: usize| [L::load(src, at), L::load(src, at + 8)];
    let mut accs = [[_mm256_set1_ps(f32::NEG_INFINITY); 2]; 4];
    let mut nan = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i + 64 <= n4 {
        for (k, acc) in accs.iter_mut().enumerate() {
            max_step(acc, &mut nan, load(i + 16 * k), [all; 2]);
        }
        i += 64;
    }
    let mut acc = accs[0];
    let mut none = [_mm256_setzero_ps(); 2];
    for a in &accs[1..] {
        // Chains are NaN-free here (NaN lanes are flagged, never taken by `<`).
        max_step(&mut acc, &mut none, *a, [all; 2]);
    }
    while i + 16 <= n4 {
        max_step(&mut acc, &mut nan, load(i), [all; 2]);
        i += 16;
    }
    if i < n4 {
        let rest = n4 - i;
        let m = [first(rest as i64), first(rest as i64 - 8)];
        let x = [load_upto::<L>(src, i, rest), load_upto::<L>(src, i + 8, rest.saturating_sub(8))];
        max_step(&mut acc, &mut nan, x, [_mm256_castsi256_ps(m[0]), _mm256_castsi256_ps(m[1])]);
    }
    let flags = (_mm256_movemask_ps(nan[0]) as u16) | ((_mm256_movemask_ps(nan[1]) as u16) << 8);
    combine_max::<L::Elem>(&lanes(acc[0], acc[1]), flags, src, n4, n)
}

super::x86::max_fns!(max_row, max_row_bf16, max_avx2);

/// `y[i] (= or +=) gelu(t[i])` on 8 lanes, with the operations of the scalar
/// [`crate::gemm::gelu`] in its order (the same bits); the last `len % 8` in scalar code.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn gelu_rows(y: &mut [f32], t: &[f32], accumulate: bool) {
    let n = y.len().min(t.len());
    let (c, s) = (splat(0.044715), splat(crate::gemm::gelu_scale()));
    let mut i = 0;
    while i + 8 <= n {
        let x = _mm256_loadu_ps(t.as_ptr().add(i));
        let cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(c, x), x), x);
        let th = tanh8(_mm256_mul_ps(s, _mm256_add_ps(x, cube)));
        let mut g = _mm256_mul_ps(_mm256_mul_ps(splat(0.5), x), _mm256_add_ps(splat(1.0), th));
        if accumulate {
            g = _mm256_add_ps(_mm256_loadu_ps(y.as_ptr().add(i)), g);
        }
        _mm256_storeu_ps(y.as_mut_ptr().add(i), g);
        i += 8;
    }
    super::x86::gelu_tail(&mut y[i..n], &t[i..n], accumulate);
}
