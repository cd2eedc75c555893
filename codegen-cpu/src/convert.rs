//! bf16 rows widened to f32 and f32 rows rounded to bf16 in the widest vectors of the level in
//! use ([`crate::isa::current`]): the same scalar operations ([`widen_bits`], [`bf16_bits`]),
//! compiled for AVX-512 or AVX2 as well as for this crate's SSE2 baseline, so every level gives
//! the same bits. For code outside the generated kernels that converts whole rows (the CPU
//! attention's heads).

use crate::gemm::{bf16_bits, widen_bits};
use crate::isa::Isa;

/// `dst[i] = widen_bits(src[i])` (exact); the slices have the same length.
pub fn widen_row(dst: &mut [f32], src: &[u16]) {
    assert_eq!(dst.len(), src.len(), "widen_row: lengths differ");
    match crate::isa::current() {
        // SAFETY: the level in use is one the host supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => unsafe { widen_avx512(dst, src) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { widen_avx2(dst, src) },
        _ => widen(dst, src),
    }
}

/// `dst[i] = bf16_bits(src[i])` (nearest, ties to even, NaN kept quiet); same lengths.
pub fn round_row(dst: &mut [u16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "round_row: lengths differ");
    match crate::isa::current() {
        // SAFETY: the level in use is one the host supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => unsafe { round_avx512(dst, src) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { round_avx2(dst, src) },
        _ => round(dst, src),
    }
}

#[inline(always)]
fn widen(dst: &mut [f32], src: &[u16]) {
    dst.iter_mut().zip(src).for_each(|(x, h)| *x = widen_bits(*h));
}

#[inline(always)]
fn round(dst: &mut [u16], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(h, x)| *h = bf16_bits(*x));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(dst: &mut [f32], src: &[u16]) {
    widen(dst, src)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn widen_avx512(dst: &mut [f32], src: &[u16]) {
    widen(dst, src)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_avx2(dst: &mut [u16], src: &[f32]) {
    round(dst, src)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn round_avx512(dst: &mut [u16], src: &[f32]) {
    round(dst, src)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every level the host has gives the scalar bits, NaNs, infinities, ties and subnormals
    /// included, at lengths around the vector widths.
    #[test]
    fn every_level_gives_the_scalar_bits() {
        let mut x = 0x2545f4914f6cdd1du64;
        let mut vals: Vec<f32> = (0..1000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                f32::from_bits((x >> 32) as u32)
            })
            .collect();
        vals.extend([0.0, -0.0, 1.0 + f32::EPSILON * 64.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE / 3.0]);
        vals.extend([f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000), f32::from_bits(0x7f80_0001)]);
        for n in [0, 1, 7, 8, 15, 16, 17, 33, vals.len()] {
            let src = &vals[..n];
            let want: Vec<u16> = src.iter().map(|v| bf16_bits(*v)).collect();
            let widened: Vec<f32> = want.iter().map(|h| widen_bits(*h)).collect();
            let (mut got, mut back) = (vec![0u16; n], vec![0f32; n]);
            round(&mut got, src);
            assert_eq!(got, want);
            widen(&mut back, &got);
            assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), widened.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            #[cfg(target_arch = "x86_64")]
            for isa in [Isa::Avx2, Isa::Avx512] {
                if !isa.supported() {
                    continue;
                }
                let (mut got, mut back) = (vec![0u16; n], vec![0f32; n]);
                // SAFETY: the host supports the level.
                unsafe {
                    if isa == Isa::Avx2 {
                        round_avx2(&mut got, src);
                        widen_avx2(&mut back, &got);
                    } else {
                        round_avx512(&mut got, src);
                        widen_avx512(&mut back, &got);
                    }
                }
                assert_eq!(got, want, "{}", isa.name());
                assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), widened.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
        }
    }
}
