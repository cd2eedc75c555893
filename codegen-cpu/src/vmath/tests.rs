//! The AVX2 and AVX-512 routines against each other, and their bf16-source versions against
//! the f32 ones on the widened values, bit for bit, at every length around their loop steps
//! (the kernel tests check them against the generated code).

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

/// `values` rounded to bf16: the bits, and the widened f32 values.
fn bf16_of(v: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let h: Vec<u16> = v.iter().map(|x| crate::gemm::bf16_bits(*x)).collect();
    let w = h.iter().map(|b| crate::gemm::widen_bits(*b)).collect();
    (h, w)
}

#[test]
fn avx2_and_avx512_row_maps_agree_bit_for_bit() {
    if !both() {
        return;
    }
    // (f32 source, bf16 source) per routine, AVX2 then AVX-512.
    let routines: [([RowFn; 2], [RowFn; 2], &str); 2] = [
        ([avx2::exp_row, avx2::exp_row_bf16], [avx512::exp_row, avx512::exp_row_bf16], "exp"),
        ([avx2::tanh_row, avx2::tanh_row_bf16], [avx512::tanh_row, avx512::tanh_row_bf16], "tanh"),
    ];
    for (f8, f16, name) in routines {
        for n in (0..=140).chain([1013, 1024]) {
            for (seed, shift) in [(1, 0.0f32), (2, 1.5), (3, -7.25)] {
                let src = values(n, seed + n as u64);
                let (half, wide) = bf16_of(&src);
                // Every routine on the f32 row (and the bf16 ones on its bf16 copy, against the
                // f32 ones on the widened copy): results and sums.
                let mut runs: Vec<(Vec<f32>, f32, String)> = vec![];
                let cases: [(&[RowFn; 2], usize, *const u8, &str); 4] = [
                    (&f8, 0, src.as_ptr() as *const u8, "avx2 f32"),
                    (&f16, 0, src.as_ptr() as *const u8, "avx512 f32"),
                    (&f8, 1, half.as_ptr() as *const u8, "avx2 bf16"),
                    (&f16, 1, half.as_ptr() as *const u8, "avx512 bf16"),
                ];
                for (fs, k, p, label) in cases {
                    let mut d = vec![0f32; n];
                    // SAFETY: the source holds `n` values, `d` too; prefetched ranges need not be
                    // valid.
                    let sum = unsafe { fs[k](d.as_mut_ptr(), n as u64, p, shift, p, 4 * n as u64, p, 0, p, 64) };
                    // No store (`dst` null): the same sum.
                    let sn = unsafe { fs[k](std::ptr::null_mut(), n as u64, p, shift, p, 0, p, 0, p, 0) };
                    assert!(same(sn, sum), "{name} {label} n={n}: sum without stores {sn} vs {sum}");
                    runs.push((d, sum, label.to_string()));
                }
                let mut d = vec![0f32; n];
                let sw = unsafe {
                    f16[0](
                        d.as_mut_ptr(),
                        n as u64,
                        wide.as_ptr() as *const u8,
                        shift,
                        std::ptr::null(),
                        0,
                        std::ptr::null(),
                        0,
                        std::ptr::null(),
                        0,
                    )
                };
                let pairs = [(0, &runs[1].0, runs[1].1), (2, &d, sw), (3, &d, sw)];
                for (i, want, wsum) in pairs {
                    let (got, gsum, label) = (&runs[i].0, runs[i].1, &runs[i].2);
                    assert!(same(gsum, wsum), "{name} {label} n={n}: sums {gsum} vs {wsum}");
                    for c in 0..n {
                        assert!(same(got[c], want[c]), "{name} {label} n={n} column {c}: {} vs {}", got[c], want[c]);
                    }
                }
            }
        }
    }
}

#[test]
fn avx2_and_avx512_row_maxima_agree_bit_for_bit() {
    if !both() {
        return;
    }
    let maxes: [(MaxFn, MaxFn, &str); 2] = [(avx2::max_row, avx512::max_row, "f32"), (avx2::max_row_bf16, avx512::max_row_bf16, "bf16")];
    for n in (0..=150).chain([1000, 1024]) {
        for seed in 0..4u64 {
            let mut src: Vec<f32> = values(n, 100 + seed).into_iter().map(|x| if x.is_nan() && seed < 2 { -1.0 } else { x }).collect();
            if seed == 1 && n > 0 {
                src.iter_mut().for_each(|x| *x = if x.is_sign_negative() { -0.0 } else { 0.0 });
            }
            let (half, wide) = bf16_of(&src);
            for n4 in [n / 4 * 4, n / 8 * 4] {
                let at = |f: MaxFn, p: *const u8| unsafe { f(p, n as u64, n4 as u64) };
                // SAFETY (above): every row holds `n` values.
                let want_bf16 = at(avx512::max_row, wide.as_ptr() as *const u8);
                for (m8, m16, kind) in maxes {
                    let p = if kind == "f32" { src.as_ptr() as *const u8 } else { half.as_ptr() as *const u8 };
                    let (a, b) = (at(m8, p), at(m16, p));
                    assert!(same(a, b), "max {kind} n={n} n4={n4} seed {seed}: {a} vs {b}");
                    if kind == "bf16" {
                        assert!(same(a, want_bf16), "max bf16 n={n} n4={n4} seed {seed}: {a} vs f32 on the widened row {want_bf16}");
                    }
                }
            }
        }
    }
}

#[test]
fn gelu_rows_give_the_scalar_epilogue_bits_on_every_path() {
    let mut rng = fusec_ir::rng::Rng::new(7);
    for len in [0, 1, 7, 8, 15, 16, 17, 33, 1000] {
        let t: Vec<f32> = (0..len).map(|i| if i % 5 == 0 { (i as f32 - 50.0) * 0.5 } else { rng.normal() as f32 * 3.0 }).collect();
        let acc: Vec<f32> = (0..len).map(|_| rng.normal() as f32).collect();
        for accumulate in [false, true] {
            let want: Vec<u32> =
                t.iter().zip(&acc).map(|(x, a)| if accumulate { a + crate::gemm::gelu(*x) } else { crate::gemm::gelu(*x) }.to_bits()).collect();
            let mut paths: Vec<(&str, fn(&mut [f32], &[f32], bool))> = vec![("dispatch", super::gelu_rows)];
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    paths.push(("avx512", |y, t, a| unsafe { super::avx512::gelu_rows(y, t, a) }));
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    paths.push(("avx2", |y, t, a| unsafe { super::avx2::gelu_rows(y, t, a) }));
                }
            }
            for (name, f) in paths {
                let mut y = acc.clone();
                f(&mut y, &t, accumulate);
                let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{name}, len {len}, accumulate {accumulate}");
            }
        }
    }
}
