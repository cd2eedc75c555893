//! Tests of [`super`]: the fast normals against the exact path, bit for bit.

use super::*;

/// The standard deviations GPT-2 uses (0.02, and 0.02/√(2L) for L = 48), and 1.
const STDS: [f64; 3] = [0.02, 0.002_041_241_452_319_315, 1.0];
/// 2^-53: the spacing of the uniforms.
const EPS: f64 = 1.0 / (1u64 << 53) as f64;

/// Bit patterns of a slice of f32 (so that NaNs and signed zeros compare exactly).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `(std * box_muller(u1, u2)) as f32` through [`batch`] (one lane used), and whether the
/// exact path was taken.
fn one(u1: f64, u2: f64, std: f64) -> (f32, bool) {
    let mut out = [0f32];
    let n = batch(&[u1; LANES], &[u2; LANES], std, &mut out);
    (out[0], n == 1)
}

/// Every way of filling this host can run: [`fill`] as dispatched, the portable batches with
/// either conversion of the uniforms, and each vectorized build the host supports.
fn paths() -> Vec<(&'static str, FillFn)> {
    let mut v: Vec<(&'static str, FillFn)> =
        vec![("fill", fill), ("portable", fill_batches::<false>), ("portable native", fill_batches::<true>)];
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") {
            // SAFETY: detected just above.
            v.push(("avx2", |r, o, s| unsafe { fill_avx2(r, o, s) }));
        }
        if has!("avx512f") && has!("avx512dq") && has!("avx512vl") {
            // SAFETY: as above.
            v.push(("avx512", |r, o, s| unsafe { fill_avx512(r, o, s) }));
        }
    }
    v
}

#[test]
fn every_path_gives_the_exact_paths_bits_and_advances_the_stream_alike() {
    // Over 10^6 values in a debug build, 9.4·10^6 in release, for each path; lengths that are
    // no multiple of LANES and starts that are no multiple of two outputs.
    let len = if cfg!(debug_assertions) { 131_075 } else { (1 << 20) + 3 };
    for (name, path) in paths() {
        let mut fallbacks = 0;
        for seed in [1u64, 7, 0xDEAD_BEEF] {
            for std in STDS {
                let mut start = Rng::new(seed);
                start.skip(seed % 5);
                let (mut want, mut got) = (vec![0f32; len], vec![0f32; len]);
                let (mut a, mut b) = (start.clone(), start);
                fill_exact(&mut a, &mut want, std);
                fallbacks += path(&mut b, &mut got, std);
                assert!(bits(&got) == bits(&want), "{name}, seed {seed}, std {std}: values differ");
                assert_eq!(a.next_u64(), b.next_u64(), "{name}: the stream is left elsewhere");
            }
        }
        // About one value in 2^16 is recomputed exactly.
        assert!(fallbacks > 0 && fallbacks < 9 * len / 1000, "{name}: {fallbacks} fallbacks");
    }
}

#[test]
fn unit_split_is_unit_f64() {
    let mut rng = Rng::new(2);
    let edges = [0, 1 << 11, (1 << 11) - 1, 1 << 37, (1 << 37) - 1, u64::MAX, u64::MAX << 11, 1 << 63];
    for b in edges.into_iter().chain((0..100_000).map(|_| rng.next_u64())) {
        assert_eq!(unit_split(b).to_bits(), unit_f64(b).to_bits(), "{b:#x}");
    }
}

#[test]
fn parallel_slices_give_the_sequential_values() {
    let stream = Rng::new(3);
    let n = 200_001;
    let mut want = vec![0f32; n];
    let mut seq = stream.clone();
    seq.skip(2 * 17);
    fill_exact(&mut seq, &mut want, 0.02);
    let mut got = vec![0f32; n];
    par_fill(&stream, 17, &mut got, 0.02, fill);
    assert!(bits(&got) == bits(&want));
}

#[test]
fn edge_uniforms_and_stds_give_the_exact_paths_bits() {
    let near = |u: f64| [u - EPS, u, u + EPS];
    let mut u1s = vec![0.0, EPS, 2.0 * EPS, 3.0 * EPS, 1e-300, 2f64.powi(-40), 1.0 - 2.0 * EPS, 1.0 - EPS];
    u1s.extend([0.25, 0.5, std::f64::consts::FRAC_1_SQRT_2].into_iter().flat_map(near));
    let mut u2s = vec![0.0, EPS, 2.0 * EPS, 1.0 - 2.0 * EPS, 1.0 - EPS, 1.0 / 3.0, 0.1];
    u2s.extend([0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875].into_iter().flat_map(near));
    let mut stds = STDS.to_vec();
    stds.extend([0.0, -0.5, 1e-300, 1e-40, 1e38, 3e38, f64::INFINITY, f64::NAN, f64::MIN_POSITIVE]);
    for &u1 in &u1s {
        for &u2 in &u2s {
            for &std in &stds {
                let want = (std * box_muller(u1, u2)) as f32;
                let (got, _) = one(u1, u2, std);
                assert_eq!(got.to_bits(), want.to_bits(), "u1 {u1:e} u2 {u2:e} std {std:e}");
            }
        }
    }
    // Arguments of cos within 2^-30 of a multiple of π/2 take the exact path.
    for u2 in [0.0, EPS, 0.25, 0.5, 0.75] {
        assert!(one(0.3, u2, 1.0).1, "u2 {u2}");
    }
}

#[test]
fn values_on_f32_midpoints_take_the_exact_path() {
    // A std chosen so that std · normal lands on a midpoint between two f32 values: the fast
    // value is within an ulp or two of it, the exact path's perhaps on its other side.
    let mut rng = Rng::new(11);
    let (mut naive_wrong, cases) = (0, 1000);
    for _ in 0..cases {
        let (u1, u2) = (rng.uniform(), rng.uniform());
        let n = box_muller(u1, u2);
        let f = (0.02 * n) as f32;
        let mid = (f as f64 + f32::from_bits(f.to_bits() + 1) as f64) / 2.0;
        let std = mid / n;
        let want = (std * n) as f32;
        let (got, exact) = one(u1, u2, std);
        assert!(exact, "u1 {u1} u2 {u2}: a value on a midpoint took the fast path");
        assert_eq!(got.to_bits(), want.to_bits());
        let (fast, _) = fast_normal(u1, u2);
        naive_wrong += usize::from((std * fast) as f32 != want);
    }
    // Without the guard some of these would round the other way.
    assert!(naive_wrong > 0, "rounding the fast value was right {cases} times out of {cases}");
}

#[test]
fn rounds_safely_only_away_from_midpoints_in_the_normal_range() {
    let one_ulp = |x: f64, k: i64| f64::from_bits((x.to_bits() as i64 + k) as u64);
    for f in [1.0f32, 1.5, 0.02, -0.02, 3.0e-10, 1.7e38, f32::MIN_POSITIVE] {
        let up = f32::from_bits(f.to_bits() + 1);
        let mid = (f as f64 + up as f64) / 2.0;
        assert!(rounds_safely(f as f64), "{f}");
        for k in [-(GUARD as i64), -1, 0, 1, GUARD as i64] {
            assert!(!rounds_safely(one_ulp(mid, k)), "{f} {k}");
        }
        for k in [-(GUARD as i64) - 1, GUARD as i64 + 1, 1 << 20] {
            assert!(rounds_safely(one_ulp(mid, k)), "{f} {k}");
        }
    }
    // The bottom of a binade: the nearest midpoint is half an f32 ulp of the binade below.
    assert!(rounds_safely(one_ulp(0.5, -(1 << 20))));
    for y in [0.0, 1e-39, 1e-45, 2f64.powi(127) * 1.5, 1e300, f64::INFINITY, f64::NAN] {
        assert!(!rounds_safely(y) && !rounds_safely(-y), "{y}");
    }
}

#[test]
fn ln_cos_and_the_normal_are_within_the_bound_of_the_exact_ones() {
    // The module comment's bound: a few ulps for ln and cos, under 32 for the normal (seen:
    // 2, 2 and 5 units of 2^-53).
    let rel = |a: f64, b: f64| ((a - b) / b).abs() / EPS;
    let mut rng = Rng::new(5);
    let (mut worst_ln, mut worst_cos, mut worst_normal) = (0f64, 0f64, 0f64);
    for _ in 0..200_000 {
        let (u1, u2) = (rng.uniform().max(1e-300), rng.uniform());
        worst_ln = worst_ln.max(rel(ln(u1), u1.ln()));
        let x = 2.0 * std::f64::consts::PI * u2;
        let (c, ok) = cos(x);
        if ok {
            worst_cos = worst_cos.max(rel(c, x.cos()));
            worst_normal = worst_normal.max(rel(fast_normal(u1, u2).0, box_muller(u1, u2)));
        }
    }
    assert!(worst_ln <= 4.0 && worst_cos <= 4.0 && worst_normal <= 16.0, "{worst_ln} {worst_cos} {worst_normal} ulps");
}
