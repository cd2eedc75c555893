//! The micro-kernels of the packed paths ([`Micro`]): `vdpbf16ps` on bf16 pairs (AVX512-BF16),
//! and f32 FMA on widened values in 16 lanes (AVX-512F) or 8 (AVX2). Each keeps an `MR x NR`
//! block of sums in registers (24 vectors at AVX-512, 12 at AVX2) and per k step broadcasts one
//! value of `a` per row against `NR / lanes` vectors of `b`.

use std::arch::x86_64::*;

use super::packed::{pack_pair, pack_wide, Micro};

/// AVX512-BF16 dot products: 12 x 32 sums, k in pairs.
pub(super) struct Dot512;

impl Micro for Dot512 {
    const MR: usize = 12;
    const NR: usize = 32;
    const KU: usize = 2;
    const MC: usize = 96;
    const KC: usize = 128;

    fn pack(lo: u16, hi: u16) -> u32 {
        pack_pair(lo, hi)
    }

    unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
        dot512(a, b, kc, c, ldc, first)
    }
}

#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
unsafe fn dot512(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
    const MR: usize = Dot512::MR;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if !first {
        for (i, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm512_loadu_ps(c.add(i * ldc));
            acc[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
        }
    }
    for q in 0..kc {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * 32) as *const _));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * 32 + 16) as *const _));
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

/// AVX-512F FMA on widened values: 12 x 32 sums.
pub(super) struct Fma512;

impl Micro for Fma512 {
    const MR: usize = 12;
    const NR: usize = 32;
    const KU: usize = 1;
    const MC: usize = 96;
    const KC: usize = 128;

    fn pack(lo: u16, hi: u16) -> u32 {
        pack_wide(lo, hi)
    }

    unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
        fma512(a as *const f32, b as *const f32, kc, c, ldc, first)
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn fma512(a: *const f32, b: *const f32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
    const MR: usize = Fma512::MR;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if !first {
        for (i, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm512_loadu_ps(c.add(i * ldc));
            acc[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
        }
    }
    for q in 0..kc {
        let b0 = _mm512_loadu_ps(b.add(q * 32));
        let b1 = _mm512_loadu_ps(b.add(q * 32 + 16));
        for (i, acc) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a.add(q * MR + i));
            acc[0] = _mm512_fmadd_ps(av, b0, acc[0]);
            acc[1] = _mm512_fmadd_ps(av, b1, acc[1]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(c.add(i * ldc), acc[0]);
        _mm512_storeu_ps(c.add(i * ldc + 16), acc[1]);
    }
}

/// AVX2 FMA on widened values: 6 x 16 sums.
pub(super) struct Fma256;

impl Micro for Fma256 {
    const MR: usize = 6;
    const NR: usize = 16;
    const KU: usize = 1;
    const MC: usize = 96;
    const KC: usize = 256;

    fn pack(lo: u16, hi: u16) -> u32 {
        pack_wide(lo, hi)
    }

    unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
        fma256(a as *const f32, b as *const f32, kc, c, ldc, first)
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn fma256(a: *const f32, b: *const f32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
    const MR: usize = Fma256::MR;
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    if !first {
        for (i, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm256_loadu_ps(c.add(i * ldc));
            acc[1] = _mm256_loadu_ps(c.add(i * ldc + 8));
        }
    }
    for q in 0..kc {
        let b0 = _mm256_loadu_ps(b.add(q * 16));
        let b1 = _mm256_loadu_ps(b.add(q * 16 + 8));
        for (i, acc) in acc.iter_mut().enumerate() {
            let av = _mm256_set1_ps(*a.add(q * MR + i));
            acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
            acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(c.add(i * ldc), acc[0]);
        _mm256_storeu_ps(c.add(i * ldc + 8), acc[1]);
    }
}
