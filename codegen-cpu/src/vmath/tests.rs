//! The AVX2 and AVX-512 routines against each other, bit for bit, at every length around
//! their loop steps (the kernel tests check them against the generated code).

use super::{avx2, avx512, MaxFn, RowFn};
use crate::isa::Isa;

/// Values that reach every branch: both clamps of `exp`, both halves of `tanh`, zeros of both
/// signs, infinities, NaN, subnormals.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let special = [0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 88.7, 89.5, -103.9, -104.5, 0.625, -0.625, 1e-40, f32::MAX];
    let mut s = seed;
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            if i % 11 == 5 {
                special[(s >> 33) as usize % special.len()]
            } else {
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 24.0
            }
        })
        .collect()
}

fn both() -> bool {
    if Isa::Avx512.supported() {
        return true;
    }
    fusec_ir::testkit::skip("vmath AVX2 vs AVX-512", "this host has no AVX-512F");
    false
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn avx2_and_avx512_row_maps_agree_bit_for_bit() {
    if !both() {
        return;
    }
    let pairs: [(RowFn, RowFn, &str); 2] = [(avx2::exp_row, avx512::exp_row, "exp"), (avx2::tanh_row, avx512::tanh_row, "tanh")];
    for (f8, f16, name) in pairs {
        for n in (0..=140).chain([1013, 1024]) {
            for (seed, shift) in [(1, 0.0f32), (2, 1.5), (3, -7.25)] {
                let src = values(n, seed + n as u64);
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                let pf = src.as_ptr() as *const u8;
                // SAFETY: `src`, `a` and `b` hold `n` values; prefetched ranges need not be valid.
                let (sa, sb) = unsafe {
                    (
                        f8(a.as_mut_ptr(), n as u64, src.as_ptr(), shift, pf, 4 * n as u64, pf, 0, pf, 64),
                        f16(b.as_mut_ptr(), n as u64, src.as_ptr(), shift, pf, 4 * n as u64, pf, 0, pf, 64),
                    )
                };
                assert!(same(sa, sb), "{name} n={n}: sums {sa} vs {sb}");
                for i in 0..n {
                    assert!(same(a[i], b[i]), "{name} n={n} column {i}: {} vs {}", a[i], b[i]);
                }
                // No store (`dst` null): the same sum.
                let sn = unsafe { f8(std::ptr::null_mut(), n as u64, src.as_ptr(), shift, pf, 0, pf, 0, pf, 0) };
                assert!(same(sn, sa), "{name} n={n}: sum without stores {sn} vs {sa}");
            }
        }
    }
}

#[test]
fn avx2_and_avx512_row_maxima_agree_bit_for_bit() {
    if !both() {
        return;
    }
    let (m8, m16): (MaxFn, MaxFn) = (avx2::max_row, avx512::max_row);
    for n in (0..=150).chain([1000, 1024]) {
        for seed in 0..4u64 {
            let mut src: Vec<f32> = values(n, 100 + seed).into_iter().map(|x| if x.is_nan() && seed < 2 { -1.0 } else { x }).collect();
            if seed == 1 && n > 0 {
                src.iter_mut().for_each(|x| *x = if x.is_sign_negative() { -0.0 } else { 0.0 });
            }
            for n4 in [n / 4 * 4, n / 8 * 4] {
                // SAFETY: `src` holds `n` values.
                let (a, b) = unsafe { (m8(src.as_ptr(), n as u64, n4 as u64), m16(src.as_ptr(), n as u64, n4 as u64)) };
                assert!(same(a, b), "max n={n} n4={n4} seed {seed}: {a} vs {b}");
            }
        }
    }
}
