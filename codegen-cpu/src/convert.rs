//! bf16 matrices widened to f32 and f32 matrices rounded to bf16 in the widest vectors of the
//! level in use ([`crate::isa::current`]): the same scalar operations ([`widen_bits`],
//! [`bf16_bits`]) compiled for AVX-512 or AVX2 as well as for this crate's SSE2 baseline
//! ([`crate::at_level`]), so every level gives the same bits. For code outside the generated kernels that converts whole
//! rows (the CPU attention's heads).

use crate::gemm::{bf16_bits, widen_bits};

/// `dst[r * cols + c] = widen_bits(src[r * stride + c])` for `r < rows`, `c < cols` (exact):
/// a strided bf16 matrix widened into a contiguous f32 one.
///
/// # Safety
/// `src` must point at `rows` readable rows of `cols` values, `stride` apart.
pub unsafe fn widen_rows(dst: &mut [f32], src: *const u16, rows: usize, cols: usize, stride: usize) {
    assert!(dst.len() >= rows * cols, "widen_rows: the destination is too short");
    assert!(rows <= 1 || stride >= cols, "widen_rows: rows overlap");
    let row = |r: usize| std::slice::from_raw_parts(src.add(r * stride), cols);
    crate::at_level!(crate::isa::current(), widen(dst, rows, cols, row))
}

/// `dst[r * stride + c] = bf16_bits(src[r * cols + c])` (nearest, ties to even, NaN kept
/// quiet): a contiguous f32 matrix rounded into a strided bf16 one.
///
/// # Safety
/// `dst` must point at `rows` writable rows of `cols` values, `stride` apart, that nothing else
/// touches meanwhile.
pub unsafe fn round_rows(dst: *mut u16, src: &[f32], rows: usize, cols: usize, stride: usize) {
    assert!(src.len() >= rows * cols, "round_rows: the source is too short");
    assert!(rows <= 1 || stride >= cols, "round_rows: rows overlap");
    let row = |r: usize| std::slice::from_raw_parts_mut(dst.add(r * stride), cols);
    crate::at_level!(crate::isa::current(), round(src, rows, cols, row))
}

#[inline(always)]
fn widen<'a>(dst: &mut [f32], rows: usize, cols: usize, src: impl Fn(usize) -> &'a [u16]) {
    for r in 0..rows {
        dst[r * cols..(r + 1) * cols].iter_mut().zip(src(r)).for_each(|(x, h)| *x = widen_bits(*h));
    }
}

#[inline(always)]
fn round<'a>(src: &[f32], rows: usize, cols: usize, dst: impl Fn(usize) -> &'a mut [u16]) {
    for r in 0..rows {
        dst(r).iter_mut().zip(&src[r * cols..(r + 1) * cols]).for_each(|(h, x)| *h = bf16_bits(*x));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;

    /// Rounds `src` into a strided matrix and widens it back on `isa`'s copies.
    fn roundtrip(isa: Isa, src: &[f32], rows: usize, cols: usize, stride: usize) -> (Vec<u16>, Vec<f32>) {
        let mut strided = vec![0xabcdu16; rows * stride];
        let mut back = vec![0f32; rows * cols];
        let p = strided.as_mut_ptr();
        // SAFETY: the buffer holds `rows` rows of `stride`, each used once at a time.
        let out = |r: usize| unsafe { std::slice::from_raw_parts_mut(p.add(r * stride), cols) };
        // SAFETY: as above.
        let inp = |r: usize| unsafe { std::slice::from_raw_parts(p.add(r * stride) as *const u16, cols) };
        crate::at_level!(isa, round(src, rows, cols, out));
        crate::at_level!(isa, widen(&mut back, rows, cols, inp));
        (strided, back)
    }

    /// Every level the host has gives the scalar bits, NaNs, infinities, ties and subnormals
    /// included, at row lengths around the vector widths, and leaves the rest of a strided row
    /// alone.
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
        for (rows, cols, stride) in [(1, 0, 1), (1, 7, 7), (3, 8, 11), (2, 17, 17), (5, 33, 40), (1, vals.len(), vals.len())] {
            let src: Vec<f32> = (0..rows * cols).map(|i| vals[i % vals.len()]).collect();
            let want: Vec<u16> = src.iter().map(|v| bf16_bits(*v)).collect();
            let widened: Vec<u32> = want.iter().map(|h| widen_bits(*h).to_bits()).collect();
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.supported()) {
                let (strided, back) = roundtrip(isa, &src, rows, cols, stride);
                let got: Vec<u16> = (0..rows).flat_map(|r| strided[r * stride..r * stride + cols].to_vec()).collect();
                assert_eq!(got, want, "{}", isa.name());
                assert!((0..rows).all(|r| strided[r * stride + cols..(r + 1) * stride].iter().all(|&h| h == 0xabcd)), "{}", isa.name());
                assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), widened, "{}", isa.name());
            }
        }
    }
}
